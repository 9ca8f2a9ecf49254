"""dynchat: a chat app around an in-process speculative decoding engine."""
__version__ = "0.1.0"

import logging as _logging
from pathlib import Path as _Path

ROOT = _Path(__file__).resolve().parents[1]     # the repository: models.yaml, data/

# torchao (weight-only quantization) reports on import every CUDA extension a CPU machine lacks,
# and torch warns about an enum torchao registers: nothing a user can act on.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

"""dynchat: a chat app around an in-process speculative decoding engine."""
__version__ = "0.1.0"

import logging as _logging

# torchao (weight-only quantization) reports on import every CUDA extension a CPU machine lacks,
# and torch warns about an enum torchao registers: nothing a user can act on.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

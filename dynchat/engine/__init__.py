"""The decoding engine: models' forwards, drafters, lookahead policies and the one decoding loop.

It imports nothing of dynchat outside this folder (no presets, app, store or UI).
"""
import os
from pathlib import Path

QUANTIZATIONS = ("none", "int8", "int4")   # weight-only formats the engine runs (linear.py)


def cache_root() -> Path:
    """Where dynchat keeps what it fetches or builds once: models, native kernels (DYNCHAT_CACHE)."""
    return Path(os.environ.get("DYNCHAT_CACHE") or Path.home() / ".cache" / "dynchat").expanduser()

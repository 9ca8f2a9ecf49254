"""How many CPU threads model work gets: a machine shared with a web server wants one core left free."""
from __future__ import annotations

import os

import torch

from .config import ConfigError


def set_cpu_threads(serving: bool) -> int:
    """Torch's CPU threads for model work; returns the number set.

    DYNCHAT_THREADS wins. Otherwise, when serving on a machine with 4 cores or fewer, one core is
    left to the web server and the clients: an OpenMP team that shares its cores with other busy
    processes stalls at every barrier (measured on 2 cores: the app showed 0.45-0.59 of the engine's
    tokens/s with 2 threads, 0.92-1.01 with 1), while on an idle machine the second thread adds ~12-16%.
    """
    forced = os.environ.get("DYNCHAT_THREADS", "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ConfigError(f"DYNCHAT_THREADS must be a positive whole number, got {forced!r}")
        n = int(forced)
    elif serving and cores <= 4:
        n = max(1, cores - 1)
    else:
        n = torch.get_num_threads()
    torch.set_num_threads(n)
    return torch.get_num_threads()

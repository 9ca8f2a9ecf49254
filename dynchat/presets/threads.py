"""How many CPU threads model work gets: a machine shared with a web server wants one core left free."""
from __future__ import annotations

import os

import torch

from .config import ConfigError

# a serving engine whose step streams at least this many bytes of weights takes every core
ALL_CORES_FROM_BYTES = 64_000_000


def set_cpu_threads(serving: bool, step_bytes: int = 0) -> int:
    """Torch's CPU threads for model work; returns the number set.

    DYNCHAT_THREADS wins. Otherwise, when serving on a machine with 4 cores or fewer, one core is
    left to the web server and the clients unless a step of the target streams ALL_CORES_FROM_BYTES
    of weights or more (`step_bytes`, known once it is loaded). An OpenMP team that shares its cores
    with other busy processes stalls at every barrier, and a small model's step is little work
    between barriers while its fast replies keep the web server busy: on 2 cores the demo preset's
    app (34 MB a step) made 371-385 tokens/s with 2 threads, 540-600 with 1. SmolLM2 (97-538 MB a
    step) gained with the second core in every alternating pair: plain decoding 289-314 tokens/s
    against 259-275, lookup 377-465 against 349-374 (`bench-app`, docs/benchmarks.md).
    """
    forced = os.environ.get("DYNCHAT_THREADS", "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ConfigError(f"DYNCHAT_THREADS must be a positive whole number, got {forced!r}")
        n = int(forced)
    elif serving and cores <= 4:
        n = cores if step_bytes >= ALL_CORES_FROM_BYTES else max(1, cores - 1)
    else:
        n = torch.get_num_threads()
    torch.set_num_threads(n)
    return torch.get_num_threads()

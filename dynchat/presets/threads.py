"""How many CPU threads model work gets: a machine shared with a web server wants one core left free."""
from __future__ import annotations

import os

import torch

from ..engine.decoder import Decoder
from .config import ConfigError


def on_space() -> bool:
    """Running as a Hugging Face Space (the platform sets SPACE_ID): the clients' browsers are elsewhere."""
    return bool(os.environ.get("SPACE_ID", "").strip())


def set_cpu_threads(serving: bool) -> int:
    """Torch's CPU threads for model work; returns the number set.

    DYNCHAT_THREADS wins. Otherwise, when serving on a machine with 4 cores or fewer, one core is
    left to the web server and the browser, unless the app runs as a Space (its browsers are
    elsewhere). An OpenMP team that shares its cores with other busy processes stalls at every
    barrier: on 2 cores with chromium on the same machine rendering every streamed round, lookup
    showed 88-147 tokens/s on the page with 2 threads against 189-258 with 1. Driven through its
    API from the same machine, as a Space is from remote browsers, the app made 421 / 559 tokens/s
    (plain / lookup) with 2 threads against 337 / 460 with 1 (docs/benchmarks.md). A prompt's prefill,
    while the page waits, takes every core (Decoder.prompt_threads).
    """
    forced = os.environ.get("DYNCHAT_THREADS", "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    prompt_threads = None
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ConfigError(f"DYNCHAT_THREADS must be a positive whole number, got {forced!r}")
        n = int(forced)
    elif serving and cores <= 4 and not on_space():
        n = max(1, cores - 1)
        # the core left free while a reply streams: a long prompt's prefill, while the page waits, takes it too
        prompt_threads = cores if n < cores else None
    else:
        n = torch.get_num_threads()
    torch.set_num_threads(n)
    Decoder.prompt_threads = prompt_threads
    return torch.get_num_threads()

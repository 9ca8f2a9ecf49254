"""Counting the reads of tensor data into Python, which stall an accelerator's queue.

`.item()`, `.tolist()`, `.cpu()`, `.numpy()` (not of a tensor `.cpu()` already read), truth tests
and `int()`/`float()`/`index()` of a tensor, by caller. On a CPU nothing stalls, but the same code
runs on a GPU: the tests bound the engine's reads per round with it, and the device check reports
them on the device.
"""
from __future__ import annotations

import traceback
from collections import Counter

import torch

NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    def __init__(self):
        self.by_caller: Counter = Counter()

    def __enter__(self):
        self._orig = {n: getattr(torch.Tensor, n) for n in NAMES}

        def wrap(name, f):
            def read(t, *a, **k):
                if not (name == "numpy" and getattr(t, "_read_by_cpu", False)):   # x.cpu().numpy(): one read
                    frame = traceback.extract_stack(limit=2)[0]
                    self.by_caller[f"{name} {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
                out = f(t, *a, **k)
                if name == "cpu" and isinstance(out, torch.Tensor):
                    out._read_by_cpu = True
                return out
            return read

        for n, f in self._orig.items():
            setattr(torch.Tensor, n, wrap(n, f))
        return self

    def __exit__(self, *exc):
        for n, f in self._orig.items():
            setattr(torch.Tensor, n, f)

    @property
    def total(self) -> int:
        return sum(self.by_caller.values())

"""The file format of a reply corpus: the target's own responses as token ids, in `.npz` shards.

Written by `prepare-responses` (train/responses.py), read by the trainers and by the lookup
drafter's index. A shard holds prompt indices, offsets and the concatenated token ids (uint16 when
the vocabulary fits, else int32), its sampling temperature and the seconds it took.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_shard(path: Path, prompt_index: list[int], responses: list[list[int]], temperature: float,
                seconds: float) -> None:
    """One shard, atomically (a stop mid-write leaves no half shard)."""
    flat = np.fromiter((t for r in responses for t in r), dtype=np.int64)
    dtype = np.uint16 if flat.size == 0 or flat.max() < 65536 else np.int32
    offsets = np.cumsum([0] + [len(r) for r in responses]).astype(np.int64)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, prompt_index=np.asarray(prompt_index, dtype=np.int32), offsets=offsets,
                            tokens=flat.astype(dtype), temperature=np.float32(temperature), seconds=np.float64(seconds))
    tmp.replace(path)


def read_shard(path: Path) -> tuple[list[int], list[np.ndarray], float]:
    """(prompt indices, response token arrays, temperature)."""
    with np.load(path) as z:
        tokens, offsets = z["tokens"].astype(np.int32), z["offsets"]
        return (z["prompt_index"].tolist(), [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)],
                round(float(z["temperature"]), 4))     # stored as float32


def load_replies(folder: Path, temperature: float | None = None) -> list[np.ndarray]:
    """Every response in a folder's shards (at one temperature, when given), in shard order."""
    out = []
    for path in sorted(Path(folder).glob("shard-*.npz")):
        _, responses, t = read_shard(path)
        if temperature is None or t == temperature:
            out.extend(responses)
    return out

"""How long a target forward takes right after forwards of another size: whether a verify slows what follows it.

A verify's own time is what the bench's cost curve and the lookahead policies weigh; on some CPUs the
forwards after a long verify run slower for a while as well (on a 2-core Xeon a one-token step right
after two 5-token verifies took 5.6-5.8 ms in some minutes against 3.7 after steps, and no longer in
others). Each cell: the median, over `--trials`, of a forward of `cur` tokens timed right after two
untimed forwards of `prev` tokens, all after a 128-token context; passes repeat the table so the
machine's drift shows.

Usage: python scripts/forward-after.py [--preset P] [--passes 3] [--trials 40] [--prev 1,2,3,5,9] [--cur 1,2,3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynchat.engines import open_engine  # noqa: E402
from dynchat.presets.config import get_preset  # noqa: E402


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="default: the default preset")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--prev", type=sizes, default=[1, 2, 3, 5, 9])
    ap.add_argument("--cur", type=sizes, default=[1, 2, 3])
    args = ap.parse_args()
    engine = open_engine(get_preset(args.preset))
    engine.warm_up()
    lm = engine.decoder("baseline").target
    ids = torch.randint(100, lm.vocab_size, (128 + max(args.prev + args.cur),), generator=torch.Generator().manual_seed(0))
    lm.reset()
    lm.forward(ids[:128], last_only=True)

    def forward(n: int) -> float:
        t = time.perf_counter()
        lm.forward(ids[128:128 + n])
        seconds = time.perf_counter() - t
        lm.rollback(128)
        return seconds

    table: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.passes):
        for prev in args.prev:
            for cur in args.cur:
                times = []
                for _ in range(args.trials):
                    forward(prev)
                    forward(prev)
                    times.append(forward(cur))
                table.setdefault((cur, prev), []).append(statistics.median(times) * 1000)
    print(f"ms of a forward of `cur` tokens right after two of `prev` (one column per pass; {engine.preset.name})")
    for (cur, prev), ms in sorted(table.items()):
        print(f"cur {cur:2d} after {prev:2d}: " + " ".join(f"{x:6.2f}" for x in ms))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Command-line entry point. Errors in user input exit with code 2 and one clear line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _train_demo(args) -> int:
    from dynchat.train.demo import Plan, run

    plan = Plan(target_steps=args.target_steps, draft_steps=args.draft_steps, seed=args.seed,
                batch_size=args.batch_size, seq_len=args.seq_len)
    run(Path(args.out), Path(args.work_dir), plan)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dynchat", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train-demo", help="rebuild the embedded demo target and draft (CPU hours)")
    t.add_argument("--out", default=str(ROOT / "data" / "models"))
    t.add_argument("--work-dir", default=str(ROOT / "data" / "work"), help="corpus, tokenizer, checkpoints")
    t.add_argument("--target-steps", type=int, default=1100)
    t.add_argument("--draft-steps", type=int, default=600)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=_train_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)

"""Write data/bench_long_chat_prompts.jsonl: conversations at their 7th turn, ~900 tokens of context.

A chat grows: by its seventh question the model reads its own six earlier answers with every new
token. Each conversation here is six everyday questions of data/bench_chat_prompts.jsonl answered
by the default preset's own greedy replies (128 new tokens at most), then a seventh question; the
conversations differ in their seventh question. Usage: python scripts/make-long-chats.py [--preset P]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynchat.bench.engine import load_prompts  # noqa: E402
from dynchat.engine.decoder import run  # noqa: E402
from dynchat.engine.sampling import SamplingParams  # noqa: E402
from dynchat.presets.config import load_presets  # noqa: E402
from dynchat.presets.loading import load_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="default: models.yaml's default")
    ap.add_argument("--turns", type=int, default=6, help="answered questions before the last")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "data" / "bench_long_chat_prompts.jsonl"))
    args = ap.parse_args()
    presets, default = load_presets()
    engine = load_engine(presets[args.preset or default])
    questions = [p["prompt"] for p in load_prompts(ROOT / "data" / "bench_chat_prompts.jsonl", None) if "prompt" in p]
    history: list[dict] = []
    for q in questions[:args.turns]:
        history.append({"role": "user", "content": q})
        reply, _ = run(engine.decoder("baseline"), engine.encode(history), 128, SamplingParams())
        history.append({"role": "assistant", "content": engine.tokenizer.decode(reply, skip_special_tokens=True).strip()})
    lines = []
    for q in questions[args.turns:args.turns + args.conversations]:
        messages = history + [{"role": "user", "content": q}]
        lines.append(json.dumps({"kind": "long chat", "messages": messages}, ensure_ascii=False))
        print(f"{len(engine.encode(messages))} tokens of context: {q}")
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

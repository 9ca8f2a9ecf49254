"""How often an EAGLE-3 head's chain, and lookup's draft, would be right at every position of the bench replies.

Each bench prompt's greedy reply is decoded plainly; the target's features for the whole conversation
come from one forward over it; then at every reply position the head drafts a 4-token chain from the
real positions before it (teacher-forced, as a round that starts there would) and lookup finds its
candidate. The figures count every position once, where a timed bench visits only the positions its
rounds start at (a copied span is one lookup round there, several here), so they compare heads exactly
and without timing noise; speed is what `python -m dynchat bench` measures.

Usage: python scripts/head-chains-on-bench.py [--preset P] [--eagle3 DIR ...] [--limit N] [--out FILE.json]
Prints, per head: the share of positions whose first j chain tokens are all right (j = 1..4), the
expected tokens a round with a 4-token chain makes (1 + their sum), and against lookup's candidate:
how often its first token is right, how often it equals the head's, and who is right when they differ.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynchat.bench.engine import load_prompts  # noqa: E402
from dynchat.engine.decoder import run  # noqa: E402
from dynchat.engine.kv_cache import common_prefix  # noqa: E402
from dynchat.engine.policies import Constant  # noqa: E402
from dynchat.engine.sampling import Sampler, SamplingParams  # noqa: E402

CHAIN = 4



@torch.inference_mode()
def chains(engine, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """Per prompt: its kind, the conversation (prompt and greedy reply), its prompt length, and per reply
    position the head's chain and lookup's candidate."""
    plain, decoder = engine.decoder("baseline"), engine.decoder("eagle3")
    head, lookup = decoder.drafter.model, decoder.drafter.lookup
    sampler, out = Sampler(SamplingParams(), engine.device), []
    for prompt in prompts:
        ids = engine.encode(prompt.get("messages") or prompt["prompt"])
        reply, _ = run(plain, ids, max_new_tokens, SamplingParams(), None, threading.Event())
        seq = ids + reply
        tokens = torch.tensor(seq)
        lm = decoder.target
        lm.use_session(None)
        held = lm.begin(seq, 0, None)
        lm.forward(tokens[held:], last_only=True)         # features of every position, the reply's included
        head.reset()
        lookup.reset()
        head.started = True                               # the first call reads the prompt's features
        rows = []
        for p in range(len(ids) + 1, len(seq)):
            proposal = head.propose(tokens[:p], CHAIN, Constant(CHAIN), sampler)
            candidate = lookup.candidate(tokens[:p])
            rows.append({"head": proposal.tokens.tolist(), "lookup": list(candidate.tokens)})
        out.append({"kind": prompt.get("kind", ""), "prompt_tokens": len(ids), "seq": seq, "rows": rows})
    return out


def report(data: list[dict]) -> dict:
    n, right, lk, lk_right, agree, only_head, only_lookup = 0, [0] * CHAIN, 0, 0, 0, 0, 0
    for item in data:
        seq, start = item["seq"], item["prompt_tokens"] + 1
        for i, row in enumerate(item["rows"]):
            p, hd = start + i, row["head"]
            n += 1
            for j in range(common_prefix(seq[p:], hd, CHAIN)):
                right[j] += 1
            if row["lookup"]:
                lk += 1
                first_l, first_h = row["lookup"][0] == seq[p], bool(hd) and hd[0] == seq[p]
                lk_right += first_l
                if hd and row["lookup"][0] == hd[0]:
                    agree += 1
                else:
                    only_head += first_h
                    only_lookup += first_l
    return {"positions": n, "chain_right_by_step": [round(r / n, 3) for r in right],
            "expected_tokens_4_chain": round(1 + sum(right) / n, 3),
            "lookup_positions": lk, "lookup_first_right": round(lk_right / max(lk, 1), 3),
            "lookup_agrees_with_head": round(agree / max(lk, 1), 3),
            "differ_head_right": only_head, "differ_lookup_right": only_lookup}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m-int4")
    p.add_argument("--eagle3", action="append", default=[], help="a head folder (repeat to compare; default: the preset's)")
    p.add_argument("--prompts-file", default=str(ROOT / "data" / "bench_chat_prompts.jsonl"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, help="the first N prompts only")
    p.add_argument("--out", help="write every position's chains and candidates here (JSON)")
    args = p.parse_args()
    from dynchat.cli import build_parser
    from dynchat.engines import engine_from_flags

    prompts, results = load_prompts(Path(args.prompts_file), args.limit), {}
    for head in args.eagle3 or [None]:
        flags = ["bench", "--preset", args.preset] + (["--eagle3", head] if head else [])
        engine = engine_from_flags(build_parser().parse_args(flags))
        engine.warm_up()                # lookup's calibration, as the bench's engine has it
        data = chains(engine, prompts, args.max_new_tokens)
        results[head or "preset"] = {"report": report(data), "prompts": data}
        print(head or "the preset's head", json.dumps(results[head or "preset"]["report"]))
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

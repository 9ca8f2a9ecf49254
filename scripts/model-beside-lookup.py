"""Who drafts in a model's mode with lookup beside it (WithLookup), and how good the model's drafts are
where lookup has a candidate and where it has none.

Runs the bench prompts greedily through the mode's decoder twice, each with a fresh throughput policy
(as a new app session): as the app runs it (lookup's draft when it expects more than the model's), and
with the model drafting one token every round, lookup never chosen, so that its first token is judged
at every position. Per reply, rounds by drafter: the model, lookup inside a model round, lookup in a
round the policy kept plain, or a plain step. The policy keeps the model off where its rounds do not
pay at the acceptance they show, and lookup takes the positions where the model is right most often.

Usage: python scripts/model-beside-lookup.py [--preset smollm2-135m-int4] [--mode eagle3] [--prompts FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dynchat.engine import lookup  # noqa: E402
from dynchat.engine.decoder import run  # noqa: E402
from dynchat.engine.policies import Constant  # noqa: E402
from dynchat.engine.sampling import SamplingParams  # noqa: E402
from dynchat.engines import open_engine  # noqa: E402
from dynchat.presets.config import get_preset  # noqa: E402


class Watch:
    """Counts WithLookup's rounds by who drafted, and the model's first-token acceptance by whether lookup
    had a candidate, by wrapping the drafter's methods (nothing else changes)."""

    def __init__(self, drafter: lookup.WithLookup):
        self.rounds, self.first = collections.Counter(), collections.defaultdict(lambda: [0, 0])
        self._had_candidate = False
        candidate, propose, free, rollback = drafter._candidate, drafter.propose, drafter.free_draft, drafter.rollback

        def watched_candidate(committed, max_tokens):
            cand = candidate(committed, max_tokens)
            self._had_candidate = bool(cand.tokens)
            return cand

        def watched_propose(committed, max_tokens, policy, sampler):
            proposal = propose(committed, max_tokens, policy, sampler)
            self.rounds["model" if drafter._used == "model" else "lookup in a model round"] += 1
            return proposal

        def watched_free(committed, max_tokens):
            proposal = free(committed, max_tokens)
            self.rounds["lookup in a plain round" if proposal.tokens.numel() else "plain"] += 1
            return proposal

        def watched_rollback(n_accepted, path=None):
            if drafter._used == "model":
                counts = self.first["lookup had a candidate" if self._had_candidate else "lookup had none"]
                counts[0] += 1
                counts[1] += n_accepted > 0
            return rollback(n_accepted, path)

        drafter._candidate, drafter.propose = watched_candidate, watched_propose
        drafter.free_draft, drafter.rollback = watched_free, watched_rollback


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m-int4")
    p.add_argument("--mode", default="eagle3", choices=["eagle3", "assistant"])
    p.add_argument("--prompts", default=str(ROOT / "data" / "bench_chat_prompts.jsonl"))
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    engine = open_engine(get_preset(args.preset))
    engine.warm_up()
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    for label, model_only in (("as the app runs it", False), ("the model one token every round", True)):
        engine._decoders.clear()                   # a fresh drafter (its running means) for each pass
        decoder = engine.decoder(args.mode)
        if not isinstance(decoder.drafter, lookup.WithLookup):
            raise SystemExit(f"{args.mode} on {args.preset} has no lookup beside its model")
        if model_only:
            decoder.drafter.model_mean = float("inf")      # lookup's draft never expects more (and inf stays inf)
        watch = Watch(decoder.drafter)
        policy = Constant(1) if model_only else engine.policy(args.mode, "throughput")
        print(f"\n{args.mode} with lookup, {label}")
        for i, prompt in enumerate(prompts):
            before = collections.Counter(watch.rounds)
            ids = engine.encode(prompt.get("prompt") or prompt.get("messages"))
            new, _ = run(decoder, ids, args.max_new_tokens, SamplingParams(), policy, threading.Event(),
                         max_reuse=decoder.target.shared_rows(ids))
            rounds = watch.rounds - before
            print(f"  prompt {i:2d} ({prompt['kind']}, {len(new)} tokens): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(rounds.items())))
        for where, (n, right) in sorted(watch.first.items()):
            print(f"  the model's first token right where {where}: {right / n:.3f} of {n} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

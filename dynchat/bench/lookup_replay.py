"""Lookup drafting replayed on the target's own greedy responses, without running the target.

`python -m dynchat.bench.lookup_replay --target SRC --replies data/responses/smollm2 --holdout s2`
indexes the folder's greedy responses except the held-out shards (names containing --holdout), then
walks each held-out response as greedy decoding would: each round drafts from the conversation so
far and the index, accepts the draft's longest prefix that matches the response, and adds one token.
The verify-cost curve (ms by tokens verified, as `bench` measures it) turns rounds into a modelled
speedup over plain decoding. A model of the loop for comparing LookupConfig settings in seconds;
real speed is what `python -m dynchat bench` measures. Its figures are optimistic where held-out
and indexed prompts come from the same templates (first-stage shards: modelled 1.80x, mean accepted
length 2.88, where the bench's hand-written prompts give 1.27x and 1.85): compare settings with it,
not products. `--index-fractions 0,0.25,1` replays the same held-out responses against fixed random
shares of the index: what more of the target's replies would buy.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..engine.forward import VerifyCosts
from ..engine.lookup import LookupConfig, LookupDrafter, ReplyIndex, best_prefix
from ..engine.reply_shards import read_shard


def replay(drafter: LookupDrafter, prompt: list[int], response: np.ndarray, costs: VerifyCosts,
           lookup_ms: float) -> tuple[float, float, int, int]:
    """(modelled ms with lookup, ms of plain decoding, draft rounds, accepted draft tokens) for one response."""
    drafter.reset()
    seq = torch.tensor(prompt + response.tolist())
    n0, pos, ms, rounds, accepted = len(prompt), 1, costs.ms(1), 0, 0      # the first token: the prefill
    while pos < response.size:
        cand = best_prefix(drafter.candidate(seq[:n0 + pos]), costs)
        draft = cand.tokens[:response.size - pos - 1]
        a = 0
        while a < len(draft) and draft[a] == response[pos + a]:
            a += 1
        ms += costs.ms(len(draft) + 1) + lookup_ms
        rounds += bool(draft)
        accepted += a
        pos += a + 1
    return ms, costs.ms(1) * response.size, rounds, accepted


def replay_all(drafter: LookupDrafter, picked: list, prompts: list[list[int]], costs: VerifyCosts,
               lookup_ms: float) -> tuple[list[float], dict[str, list[float]]]:
    """replay() over the picked held-out responses: the totals (ms with lookup, ms plain, draft rounds,
    accepted draft tokens, tokens) and each response's modelled speedup by kind."""
    total, by_kind = [0.0, 0.0, 0, 0, 0], {}
    for (kind, response), prompt in zip(picked, prompts):
        ms, plain, rounds, acc = replay(drafter, prompt, response, costs, lookup_ms)
        by_kind.setdefault(kind, []).append(plain / ms)
        for j, v in enumerate((ms, plain, rounds, acc, response.size)):
            total[j] += v
    return total, by_kind


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target's source (for its tokenizer and chat template)")
    p.add_argument("--replies", type=Path, required=True)
    p.add_argument("--holdout", default="s2", help="held-out shards: names containing this")
    p.add_argument("--limit", type=int, default=400, help="held-out responses replayed")
    p.add_argument("--verify-ms", default="1:25.0,2:31.7,5:39.3,9:52.0,17:84.0")
    p.add_argument("--lookup-ms", type=float, default=0.3, help="host time of one lookup")
    p.add_argument("--config", default="{}", help="LookupConfig fields as JSON, e.g. '{\"prior\": 0.3}'")
    p.add_argument("--index-fractions", default="1",
                   help="shares of the indexed responses to replay against, each a fixed random subset (0: no index)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from ..presets.loading import local_source

    tok = AutoTokenizer.from_pretrained(local_source("target", args.target))
    cfg = replace(LookupConfig(), **json.loads(args.config))
    costs = VerifyCosts({int(k): float(v) for k, v in (x.split(":") for x in args.verify_ms.split(","))})
    fractions = [float(x) for x in args.index_fractions.split(",")]
    if any(not 0 <= f <= 1 for f in fractions):
        p.error("--index-fractions: each share must be between 0 and 1")
    indexed, held = [], []
    for path in sorted(args.replies.glob("shard-*-t0-*.npz")):
        prompt_index, responses, _ = read_shard(path)
        stage = int(path.name.split("-")[1][1:])
        if args.holdout in path.name:
            held += [(stage, i, r) for i, r in zip(prompt_index, responses)]
        else:
            indexed += responses
    chats = {s: [json.loads(line)["messages"] for line in (args.replies / f"prompts-{s}.jsonl").read_text().splitlines()]
             for s in {h[0] for h in held}}
    rng = np.random.default_rng(0)
    picked, prompts = [], []
    for stage, i, response in (held[j] for j in sorted(rng.choice(len(held), min(args.limit, len(held)), replace=False))):
        chat = chats[stage][i]
        kind = "first-stage" if stage == 1 else "everyday" if stage == 3 else "follow-up" if len(chat) > 1 else "text work"
        picked.append((kind, response))
        prompts.append(list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]))
    order = np.random.default_rng(1).permutation(len(indexed))
    for fraction in fractions:
        share = [indexed[j] for j in order[:round(fraction * len(indexed))]]
        t0 = time.perf_counter()
        drafter = LookupDrafter(ReplyIndex(share, cfg=cfg) if share else None, cfg, costs)
        print(f"index: {len(share)} of {len(indexed)} responses, built in {time.perf_counter() - t0:.1f} s; "
              f"replaying {len(picked)}")
        (ms, plain, rounds, acc, tokens), by_kind = replay_all(drafter, picked, prompts, costs, args.lookup_ms)
        print(f"modelled speedup {plain / ms:.3f} (tokens {tokens}, draft rounds {rounds}, accepted {acc}, "
              f"mean accepted length {1 + acc / max(rounds, 1):.2f})")
        for kind, v in sorted(by_kind.items()):
            print(f"  {kind:10s} n={len(v):4d}  median speedup {np.median(v):.3f}  mean {np.mean(v):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m dynchat quality`: what weight-only quantization and int8 activations (a preset's `int_dot`,
or DYNCHAT_INT_DOT=1) cost, against the same model's float weights and activations ("float32").

Two measures a user can weigh against the speed: perplexity and next-token agreement on held-out
text (documentation of Python's standard library as installed here: English prose with code, not
text any dynchat model was trained on), and greedy agreement on the preset's bench prompts (how many
of the float model's reply tokens the quantized model reproduces before its first different token).
"""
from __future__ import annotations

import dataclasses
import json
import pydoc
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from ..engine.decoder import run
from ..engine.forward import make_lm
from ..engine.sampling import SamplingParams

TEXT_MODULES = ("json", "collections", "itertools", "functools", "pathlib", "textwrap", "csv", "heapq",
                "bisect", "statistics", "datetime", "string")


def held_out_texts(modules=TEXT_MODULES) -> list[str]:
    """The plain-text documentation of some standard-library modules, as `pydoc` renders it."""
    import importlib

    return [pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext) for name in modules]



STEP_ROWS = 8      # fed as a verify feeds them: a decode step's path, not a long prompt's batched prefill


@torch.inference_mode()
def teacher_forced(lm, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each next token, top-1 prediction) over the sequence, fed STEP_ROWS tokens a
    forward: the numbers a reply is decoded with (a long prompt's prefill may take another matmul path)."""
    lm.reset()
    logits = torch.cat([lm.forward(ids[i:i + STEP_ROWS]) for i in range(0, ids.numel(), STEP_ROWS)]).float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, ids[1:, None])[:, 0], logits[:-1].argmax(-1)


def compare(engines: dict[str, object], texts: list[str], prompts: list[list[int]], context: int = 512,
            max_new_tokens: int = 128) -> pd.DataFrame:
    """One row per weights: perplexity, next-token agreement with the first engine, greedy agreement."""
    names = list(engines)
    reference = engines[names[0]]
    chunks = [torch.tensor(reference.tokenizer(t, add_special_tokens=False)["input_ids"][:context], device=reference.device)
              for t in texts]
    forced, replies = {}, {}
    for name in tqdm(names, desc="weights"):
        lm = make_lm(engines[name].target)
        forced[name] = [teacher_forced(lm, ids) for ids in chunks]
        decoder = engines[name].decoder("baseline")
        replies[name] = [run(decoder, ids, max_new_tokens, SamplingParams())[0] for ids in prompts]
    rows = []
    for name in names:
        logp = torch.cat([lp for lp, _ in forced[name]])
        agree = torch.cat([(top == ref_top) for (_, top), (_, ref_top) in zip(forced[name], forced[names[0]])])
        kept, identical = [], 0
        for mine, ref in zip(replies[name], replies[names[0]]):
            same = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            kept.append(same / max(1, len(ref)))
            identical += mine == ref
        rows.append({"weights": name, "perplexity": float(torch.exp(-logp.mean())),
                     "next_token_agreement": float(agree.float().mean()), "text_tokens": int(logp.numel()),
                     "greedy_replies_identical": identical, "greedy_replies": len(prompts),
                     "greedy_prefix_kept": sum(kept) / len(kept)})
    return pd.DataFrame(rows).set_index("weights")


def main(args) -> int:
    from ..bench.engine import load_prompts
    from ..presets.config import get_preset
    from ..presets.loading import load_engine

    preset = get_preset(args.preset)
    # the reference, then int8 activations on the preset's weights, then each quantization with float32
    # activations, and int8 weights with int8 activations (both rounded: the int8 preset's fast path)
    rows = [("float32", None, False), ("int8 activations", None, True)]
    for q in args.weights.split(","):
        if q not in ("float32", "none", ""):
            rows.append((q, q, False))
            if q == "int8":
                rows.append(("int8 x int8 activations", q, True))
    engines = {}
    for name, quantization, on in rows:            # each row's models carry its activations (Preset.int_dot)
        engines[name] = load_engine(dataclasses.replace(preset, int_dot=on), quantization=quantization)
    prompt_file = Path(preset.bench_prompts) if preset.bench_prompts else None
    prompt_rows = load_prompts(prompt_file, args.limit) if prompt_file else []
    prompts = [engines["float32"].encode(r.get("messages") or r["prompt"], raw=r.get("raw", False)) for r in prompt_rows]
    table = compare(engines, held_out_texts(), prompts, max_new_tokens=args.max_new_tokens)
    print(table.round(4).to_string())
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"preset": preset.name, "texts": list(TEXT_MODULES), "context": 512,
                                   "max_new_tokens": args.max_new_tokens,
                                   "weights": json.loads(table.to_json(orient="index"))}, indent=2))
    return 0

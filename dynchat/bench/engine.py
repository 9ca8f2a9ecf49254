"""`python -m dynchat bench`: every method on the same held-out prompts, interleaved, after a warm-up.

Methods: plain decoding (our loop, the baseline every speedup is relative to), assistant mode under
each lookahead policy, and Transformers' own `generate()` with and without `assistant_model`
(configured through the assistant's generation_config, where Transformers reads it). Greedy
methods must all produce the same tokens; the report says whether they did.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from ..engine.decoder import run
from ..engine.events import RoundEvent, mean_accepted_length
from ..engine.forward import make_lm, verify_cost_curve
from ..engine.policies import make_policy
from ..engine.sampling import SamplingParams
from .peer import compare, merge_runs, run_peer

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "bench_prompts.jsonl"


@dataclass
class Method:
    name: str
    kind: str                 # ours | hf
    mode: str                 # baseline | assistant
    policy: str | None = None
    k: int | None = None
    backend: str | None = None       # None: the fastest forward; "transformers": Transformers modules
    tree: object = None              # EAGLE-3: a TreeShape, or None for chain drafting
    lookup: bool = True              # assistant / EAGLE-3 rounds may take a lookup draft instead
    branches: bool | None = None     # ... or verify it beside the model's as a second branch (None: the preset's)


def methods_for(engine) -> list[Method]:
    """Every method for this engine; a quantized one leaves out Transformers' (they would run float weights)."""
    hf = engine.quantization == "none"
    ms = [Method("baseline", "ours", "baseline")]
    if hf:
        ms += [Method("hf-generate", "hf", "baseline"),
               Method("baseline-hf-modules", "ours", "baseline", backend="transformers")]
    if "lookup" in engine.modes:
        ms += [Method(f"lookup-{p}", "ours", "lookup", p) for p in ("throughput", "dynamic")]
        ms.append(Method("lookup-constant-16", "ours", "lookup", "constant", 16))
    if "assistant" in engine.modes:
        ms += [Method(f"assistant-constant-{k}", "ours", "assistant", "constant", k) for k in (1, 2, 3, 4, 6)]
        ms += [Method(f"assistant-{p}", "ours", "assistant", p) for p in ("heuristic", "dynamic", "adaptive", "throughput")]
        ms.append(Method("assistant-throughput-alone", "ours", "assistant", "throughput", lookup=False))
        ms.append(other_branching(engine, "assistant"))
        if hf:
            ms.append(Method("assistant-dynamic-hf-modules", "ours", "assistant", "dynamic", backend="transformers"))
            ms.append(Method("hf-assisted", "hf", "assistant"))
    if "eagle3" in engine.modes:
        from ..engine.eagle_drafter import TreeShape

        ms += [Method(f"eagle3-chain-constant-{k}", "ours", "eagle3", "constant", k) for k in (2, 3, 4, 5, 6)]
        ms += [Method(f"eagle3-chain-{p}", "ours", "eagle3", p) for p in ("dynamic", "throughput")]
        ms.append(Method("eagle3-chain-throughput-alone", "ours", "eagle3", "throughput", lookup=False))
        ms.append(other_branching(engine, "eagle3"))
        # the head's own acceptance: constant chains, no lookup (its model card quotes these)
        ms += [Method(f"eagle3-chain-constant-{k}-alone", "ours", "eagle3", "constant", k, lookup=False) for k in (1, 4)]
        for top_k, depth, total in ((2, 4, 8), (4, 5, 16), (4, 6, 24), (8, 6, 48)):
            ms.append(Method(f"eagle3-tree-{top_k}x{depth}-{total}", "ours", "eagle3",
                             tree=TreeShape(top_k, depth, total)))
    return ms


def other_branching(engine, mode: str) -> Method:
    """The mode's throughput rounds with lookup's draft the other way than the engine's default: as a
    second branch (`-two-branches`) where the default verifies one candidate, else one (`-one-branch`)."""
    two = not engine.lookup_branches
    name = f"{'eagle3-chain' if mode == 'eagle3' else mode}-throughput-{'two-branches' if two else 'one-branch'}"
    return Method(name, "ours", mode, "throughput", branches=two)


RECORDED = ("new_tokens", "tokens_per_s", "wall_s", "decode_tokens_per_s", "acceptance_rate", "mean_accepted_length",
            "draft_rounds", "draft_tokens", "accepted_tokens", "per_position_acceptance", "reused_tokens", "ttft_s")


# a prompt's samples per method at most, short replies' further passes included (extra_passes)
MAX_REPEATS = 12


def extra_passes(plain_walls: dict[int, list[float]], repeats: int, min_seconds: float) -> dict[int, int]:
    """Further passes for each prompt whose plain replies are short: enough that each method's samples of it
    add up to min_seconds (MAX_REPEATS in all at most). A 12-token reply takes ~35 ms, where one scheduling
    hiccup or a slow spell of the machine moves it by 10%: with two samples such replies decided their
    prompt kind's median (0.96 to 1.05 between runs, where 15 alternating samples gave 1.08-1.13)."""
    out = {}
    for i, walls in plain_walls.items():
        wanted = math.ceil(min_seconds / max(statistics.median(walls), 1e-6)) if min_seconds > 0 else 0
        out[i] = max(0, min(MAX_REPEATS, wanted) - repeats)
    return out


# --follow-ups: the untimed reply that leaves a conversation's earlier turns in the caches is this long, so
# that a draft model that starts after a reply's first tokens (assistant_start_after) has read them too
PRIMING_TOKENS = 16


def load_prompts(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


class RoundTimes:
    """Where each method's decoding time goes, by the tokens a round's target forward verified: how many
    such rounds, the tokens they committed, and their seconds in the target's forward (verify), in
    drafting, and in the loop's own work between (other). What makes a speedup what it is: the rows a
    verify adds against the tokens they bring, and what drafting costs beside."""

    def __init__(self):
        self.by = collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0])   # (method, rows) -> sums

    def reply(self, method: str):
        """The RoundEvent callback for one reply of `method` (its first event, the prefill's, is left out)."""
        last_s: float | None = None

        def add(ev: RoundEvent) -> None:
            nonlocal last_s
            if last_s is not None:
                a = self.by[(method, ev.drafted + 1)]
                a[0] += 1
                a[1] += len(ev.token_ids)
                a[2] += ev.verify_s
                a[3] += ev.draft_s
                a[4] += max(0.0, ev.elapsed_s - last_s - ev.verify_s - ev.draft_s)
            last_s = ev.elapsed_s
        return add

    def table(self) -> pd.DataFrame:
        rows = []
        for (method, verified), (n, tokens, verify, draft, other) in sorted(self.by.items()):
            rows.append({"method": method, "verified_tokens": verified, "rounds": n, "tokens_per_round": tokens / n,
                         "verify_ms": 1000 * verify / n, "draft_ms": 1000 * draft / n, "other_ms": 1000 * other / n,
                         "ms_per_token": 1000 * (verify + draft + other) / tokens, "seconds": verify + draft + other})
        df = pd.DataFrame(rows)
        if not df.empty:
            df["share_of_time"] = df["seconds"] / df.groupby("method")["seconds"].transform("sum")
        return df.drop(columns=["seconds"], errors="ignore")


class Runner:
    """Runs one method on one prompt and returns (token ids, stats dict)."""

    def __init__(self, engine, max_new_tokens: int, sampling: SamplingParams = SamplingParams()):
        self.engine, self.max_new, self.sampling = engine, max_new_tokens, sampling
        self.policies: dict[str, object] = {}
        self.follow_ups = 0
        self.hf_assistant = None
        self.rounds = RoundTimes()      # the timed runs' rounds (main turns it on after the warm-up)
        self.recording = False

    def __call__(self, method: Method, ids: list[int], history: list[int] | None = None,
                 seed: int | None = None) -> tuple[list[int], dict]:
        """history: the conversation before the prompt's last message, which the caches then hold before the
        timed run, as the app keeps a chat's caches between its turns (an untimed reply of PRIMING_TOKENS to
        it, by the same method from empty caches, leaves them so: every method's history is computed alike):
        the run prefills only what the prompt adds, where the forward keeps a cache between turns (as in
        the app: not Transformers' generate or modules). Without it every method prefills the prompt as
        a new chat in the app does: all but the start every chat shares (the chat template's system
        prompt, Engine.shared_prefix), whose cache rows are computed once (Transformers' methods keep
        no cache between requests: they prefill it all). seed: a sampled run's (every method the same
        for a prompt and pass)."""
        sampling = dataclasses.replace(self.sampling, seed=seed)
        if method.kind == "hf":
            return self._hf(method, ids, sampling)
        policy = None
        if method.policy:   # one policy object per method for the whole bench, as in a chat session
            policy = self.policies.setdefault(method.name, make_policy(method.policy, method.k, self.engine.verify_ms))
        decoder = self.engine.decoder(method.mode, method.backend, method.tree, method.lookup, method.branches)
        session = None
        if history:
            self.follow_ups += 1                 # a new conversation each time: never one an earlier run left
            session = ("bench follow-up", self.follow_ups)
            run(decoder, history, PRIMING_TOKENS, SamplingParams(), policy, threading.Event(), session=session)
        new, summary = run(decoder, ids, self.max_new, sampling, policy, threading.Event(),
                           max_reuse=None if history else decoder.target.shared_rows(ids), session=session,
                           on_round=self.rounds.reply(method.name) if self.recording else None)
        return new, {**summary.stats(), "reused_tokens": summary.reused_tokens}

    @torch.inference_mode()
    def _hf(self, method: Method, ids: list[int], sampling: SamplingParams) -> tuple[list[int], dict]:
        e = self.engine
        x = torch.tensor([ids], device=e.device)
        if not sampling.greedy:
            torch.manual_seed(sampling.seed or 0)
        sampled = {} if sampling.greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p,
                                                  top_k=sampling.top_k)      # 0: off, as ours (not its default 50)
        kwargs = dict(max_new_tokens=self.max_new, do_sample=not sampling.greedy, **sampled, eos_token_id=e.eos_token_ids,
                      pad_token_id=e.tokenizer.pad_token_id or e.eos_token_ids[0], attention_mask=torch.ones_like(x))
        if method.mode == "assistant":
            if self.hf_assistant is None:        # Transformers modifies the assistant it is given: its own copy
                import copy

                self.hf_assistant = copy.deepcopy(e.assistant)
                gc = self.hf_assistant.generation_config   # read from here only (transformers issue #40739)
                gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 20, "constant"
                gc.assistant_confidence_threshold = 0.4
            kwargs["assistant_model"] = self.hf_assistant
            if e.assistant_tokenizer_differs:     # Transformers' universal assisted generation
                kwargs.update(tokenizer=e.tokenizer, assistant_tokenizer=e.assistant_tokenizer)
        t0 = time.perf_counter()
        out = e.target.generate(x, **kwargs)
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        return new, {"new_tokens": len(new), "tokens_per_s": len(new) / wall, "wall_s": wall,
                     "acceptance_rate": None, "mean_accepted_length": None, "per_position_acceptance": []}


def _plots(df: pd.DataFrame, table: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    t = table.sort_values("speedup")
    axes[0].barh(t.index, t["speedup"], color=["tab:orange" if i.startswith("hf") else "tab:blue" for i in t.index])
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xlabel("speedup over baseline (median over prompts)")
    for name, row in table.iterrows():
        pp = row["per_position_acceptance"]
        if pp:
            axes[1].plot(range(1, len(pp) + 1), pp, marker=".", label=name)
    axes[1].set_xlabel("draft position")
    axes[1].set_ylabel("per-position acceptance rate")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=100)
    plt.close(fig)


def summarise(df: pd.DataFrame) -> pd.DataFrame:
    """Per method: median tokens/s, speedup (median over prompts of the per-prompt ratio), acceptance.

    Acceptance rate and mean accepted length pool every run's counts, as vLLM's counters do
    (accepted / drafted, 1 + accepted / draft rounds), rather than averaging per-prompt ratios
    that a 9-token reply would weigh as much as a 96-token one.
    """
    per_prompt = df.groupby(["method", "prompt_id"])["tokens_per_s"].median().unstack()
    speedup = per_prompt.div(per_prompt.loc["baseline"], axis=1).median(axis=1)
    rows = {}
    for name, g in df.groupby("method", sort=False):
        counted = bool(g["draft_rounds"].notna().all())      # our loop's runs; Transformers' report no counts
        drafted, accepted = g["draft_tokens"].sum(), g["accepted_tokens"].sum()
        mal = mean_accepted_length(accepted, g["draft_rounds"].sum()) if counted else None
        pp = [x for x in g["per_position_acceptance"] if x]
        width = max((len(x) for x in pp), default=0)
        per_pos = [statistics.mean(x[i] for x in pp if len(x) > i) for i in range(min(width, 20))]
        decode = pd.to_numeric(g["decode_tokens_per_s"], errors="coerce") if "decode_tokens_per_s" in g else None
        rows[name] = {
            "tokens_per_s": g["tokens_per_s"].median(),
            # without the prompt's prefill, as llama.cpp's llama-bench tg counts (Transformers': not measured)
            "decode_tokens_per_s": None if decode is None or decode.isna().all() else decode.median(),
            "speedup": speedup[name],
            "acceptance_rate": (accepted / drafted if drafted else 0.0) if counted else None,
            "mean_accepted_length": mal,
            "speedup_per_accepted_length": speedup[name] / mal if mal else None,
            "new_tokens": g["new_tokens"].mean(),
            # None where sampled: not compared
            "same_tokens_as_baseline": None if g["same_as_baseline"].isna().all() else bool(g["same_as_baseline"].all()),
            "per_position_acceptance": [round(x, 3) for x in per_pos],
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def main(args) -> int:
    from ..engines import engine_from_flags
    from ..presets.config import preset_from_flags

    torch.manual_seed(0)
    preset = preset_from_flags(args)
    if preset.engine == "vllm":           # said before any server starts
        raise ValueError(f"preset {preset.name!r} serves through vLLM: measure it with "
                         f"`python -m dynchat bench --preset {preset.name} --concurrency 1,4,8`")
    engine = engine_from_flags(args)
    engine.warm_up()            # as the app does: lazy setup paid, the verify-cost curve measured for the policies
    prompts_file = args.prompts_file or engine.preset.bench_prompts or str(DEFAULT_PROMPTS)
    prompts = load_prompts(Path(prompts_file), args.limit)
    methods = methods_for(engine)
    if args.methods:
        wanted = set(args.methods.split(","))
        unknown = wanted - {m.name for m in methods}
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(sorted(unknown))}; have {', '.join(m.name for m in methods)}")
        methods = [m for m in methods if m.name in wanted or m.name == "baseline"]
    sampling = SamplingParams(temperature=getattr(args, "temperature", 0.0), top_p=getattr(args, "top_p", 1.0))
    runner = Runner(engine, args.max_new_tokens, sampling)
    encoded = [engine.encode(p.get("messages") or p["prompt"], raw=p.get("raw", False)) for p in prompts]
    # --follow-ups: a conversation's earlier turns are in the caches, as in the app (its last message is new)
    histories = [engine.encode(p["messages"][:-1]) if getattr(args, "follow_ups", False) and len(p.get("messages") or [])
                 > 1 else None for p in prompts]
    for m in tqdm(methods, desc="warm-up"):
        runner(m, encoded[0])
    runner.recording = True
    with_peer = getattr(args, "peer", False)
    peer_runs = [run_peer()] if with_peer else []          # llama.cpp before and after ours: same run
    on_cpu = engine.device.type == "cpu"
    memory_rates = [memory_read_gb_per_s()] if on_cpu else []     # the memory's pace, before and after too
    reference: dict[int, list[int]] = {}
    records = []

    def measure(order, desc):
        for r, i, j in tqdm(order, desc=desc):
            m = methods[(j + i + r) % len(methods)]      # rotate the order so no method always runs first
            # sampled: a seed per prompt and pass, the same for every method (their draws still differ:
            # a speculative round consumes the generator otherwise than a step)
            new, stats = runner(m, encoded[i], histories[i], seed=None if sampling.greedy else 1_000_003 * r + i)
            if m.name == "baseline":
                reference.setdefault(i, new)
            records.append({"method": m.name, "prompt_id": i, "kind": prompts[i].get("kind", ""), "repeat": r,
                            "tokens": new, **{k: stats.get(k) for k in RECORDED}})

    measure([(r, i, j) for r in range(args.repeats) for i in range(len(prompts)) for j in range(len(methods))], "bench")
    plain = collections.defaultdict(list)
    for rec in records:
        if rec["method"] == "baseline":
            plain[rec["prompt_id"]].append(rec["wall_s"])
    min_seconds = getattr(args, "min_seconds", 0.0)
    extra = extra_passes(plain, args.repeats, min_seconds)
    measure([(r, i, j) for r in range(args.repeats, args.repeats + max(extra.values(), default=0))
             for i in range(len(prompts)) if r < args.repeats + extra[i] for j in range(len(methods))], "short replies")
    if with_peer:
        peer_runs.append(run_peer())
    if on_cpu:
        memory_rates.append(memory_read_gb_per_s())
    df = pd.DataFrame(records)
    # sampled, methods draw differently and their tokens are not compared (the tests check the distribution)
    df["same_as_baseline"] = [rec["tokens"] == reference[rec["prompt_id"]] if sampling.greedy else None for rec in records]
    table = summarise(df)
    kinds = speedup_by_kind(df)
    curve = verify_cost_curve(make_lm(engine.target))
    streamed = weight_streaming(engine, curve, statistics.mean(memory_rates) if memory_rates else None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.drop(columns=["tokens"]).to_csv(out / "runs.csv", index=False)
    table.to_csv(out / "summary.csv")
    kinds.to_csv(out / "speedup_by_kind.csv")
    runner.rounds.table().to_csv(out / "rounds.csv", index=False)
    meta = {"preset": engine.preset.name, "device": str(engine.device), "weights": engine.weights, "prompts": len(prompts),
            "prompts_file": Path(prompts_file).name, "repeats": args.repeats,
            "min_seconds": min_seconds, "max_new_tokens": args.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "torch_threads": torch.get_num_threads()}
    peer = merge_runs(peer_runs) if peer_runs else None
    versus = compare(engine.weights, table.loc["baseline", "decode_tokens_per_s"], peer,
                     (streamed or {}).get("stored_as"), streamed) if peer else None
    (out / "summary.json").write_text(json.dumps({
        "meta": meta, "methods": json.loads(table.to_json(orient="index")),
        "speedup_by_kind": json.loads(kinds.to_json(orient="index")), "verify_ms_by_tokens": curve,
        "weight_streaming": streamed, "llama_cpp": peer, "plain_vs_llama_cpp": versus}, indent=2))
    _plots(df, table, out)
    show = table.drop(columns=["per_position_acceptance"]).round(3)
    print(json.dumps(meta))
    print(show.to_string())
    if not sampling.greedy:
        print(f"sampled at temperature {sampling.temperature} (top-p {sampling.top_p}): each method draws its own "
              "tokens, so they are not compared with plain decoding's; speculative sampling keeps the target's "
              "distribution (tests), and a speedup here is over replies of differing lengths")
    if len(kinds.columns) > 1:
        print("\nspeedup by prompt kind (median over the kind's prompts)")
        print(kinds.round(2).to_string())
    print("\ntarget forward, ms by tokens verified (context of 128):",
          ", ".join(f"{n}: {ms:.1f}" for n, ms in curve.items()))
    if peer:
        print("llama.cpp in the same run, tg128 tokens/s:", ", ".join(f"{m} {v:.1f}" for m, v in sorted(peer["tg128"].items())),
              "| Q8_0 forward ms by tokens:", ", ".join(f"{k}: {v:.1f}" for k, v in sorted(peer["q8_0_forward_ms"].items())))
    if versus:
        print(f"plain decoding {versus['dynchat_tokens_per_s']:.1f} decode tokens/s = {versus['ratio']:.2f}x llama.cpp "
              f"{versus['llama_cpp_file']} ({versus['llama_cpp_tokens_per_s']:.1f})")
    if streamed:
        print(f"one-token forward streams {streamed['weight_mb']:.0f} MB of weights: {streamed['gb_per_s']:.1f} GB/s "
              f"(route {streamed['route']}; matrices stored as {streamed['stored_as']})")
    if streamed and streamed.get("memory_read_gb_per_s"):
        line = (f"memory reads {streamed['memory_read_gb_per_s']:.1f} GB/s in this run ({MEMORY_PROBE_MB} MB summed, "
                f"{meta['torch_threads']} threads): the one-token forward streams at "
                f"{streamed['share_of_memory_read']:.0%} of it")
        if versus and versus.get("llama_cpp_share_of_memory_read"):
            line += (f", llama.cpp {versus['llama_cpp_file']} at {versus['llama_cpp_share_of_memory_read']:.0%}; "
                     f"at this pace plain decoding could reach at most {versus['most_over_llama_cpp_at_this_memory']:.2f}x "
                     f"llama.cpp's")
        print(line)
    return 0


def speedup_by_kind(df: pd.DataFrame) -> pd.DataFrame:
    """Methods x prompt kinds: the median over a kind's prompts of the per-prompt speedup."""
    per_prompt = df.groupby(["method", "prompt_id"])["tokens_per_s"].median().unstack()
    ratio = per_prompt.div(per_prompt.loc["baseline"], axis=1)
    kind_of = df.groupby("prompt_id")["kind"].first()
    return ratio.T.groupby(kind_of).median().T


MEMORY_PROBE_MB = 256         # far past any CPU's last-level cache: read from memory every pass (MB: 10^6 bytes)


def memory_read_gb_per_s(mb: int = MEMORY_PROBE_MB, passes: int = 7) -> float:
    """The machine's memory read rate now, with torch's threads: the median of `passes` sums over a
    float32 buffer of `mb` MB. A one-token step reads every weight once, so this rate bounds decoding;
    on a shared 2-core VM it moved between 27 and 40 GB/s from hour to hour, so it is measured in the run."""
    x = torch.ones(mb * 10**6 // 4)
    times = []
    for _ in range(passes + 1):               # the first pass maps the pages
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times[1:]) / 1e9


def weight_streaming(engine, curve: dict[int, float], memory_gb_per_s: float | None = None) -> dict | None:
    """MB of weights a one-token target forward reads, and the GB/s that makes at the curve's
    1-token time: how close decoding runs to the memory's limit (a one-token step is weight-bound);
    with the memory's read rate measured in the run, the share of it."""
    lm = make_lm(engine.target)
    if not hasattr(lm, "weight_bytes") or 1 not in curve:
        return None          # Transformers' forward (not a Llama-family model)
    mb = lm.weight_bytes() / 1e6
    stored = collections.Counter(getattr(w, "format", "float") for layer in lm.weights for w in layer.values())
    stored[f"output head {getattr(lm.head, 'format', 'float')}"] += 1
    streamed = {"weight_mb": mb, "route": lm.route, "stored_as": dict(stored), "forward_1_token_ms": curve[1],
                "gb_per_s": mb / curve[1]}
    if memory_gb_per_s:
        streamed |= {"memory_read_gb_per_s": memory_gb_per_s, "share_of_memory_read": streamed["gb_per_s"] / memory_gb_per_s}
    return streamed

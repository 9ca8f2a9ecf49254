"""`python -m dynchat device-check`: what a GPU machine must confirm, in one short run (scripts/device-check.sh).

1. lossless: the demo preset on the device, every mode (assistant, EAGLE-3 chain and tree), greedy,
   against plain decoding of the same target, in float32 (identical) and bfloat16 (how many tokens
   agree before a near-tie parts them); host reads per target forward;
2. the engine at real size: random weights shaped like Llama-3.1-8B and an EAGLE-3 head of its
   width, drafts accepted at a known rate (bench/scripted.py; 1.0 is the ceiling), chain and tree,
   at 128 and 4,096 tokens of context: target forward ms for 1-17 tokens and tokens/s with CUDA
   graphs on and off, accepted length, host reads, the share of time the GPU waits for the host,
   peak memory.

Everything is written to --out as JSON as it is measured; nothing needs the network. On a CPU
(`--dry-run`) it runs the same steps with small shapes (to test this script, not to measure).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from .host_reads import HostReads

SHAPES = {  # name: target config kwargs
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lossless(device: str, dtype: str, max_new_tokens: int = 64, prompts: int = 12) -> dict:
    """Greedy tokens of every mode against plain decoding, demo preset, on the device."""
    from ..engine.decoder import run
    from ..engine.eagle_drafter import TreeShape
    from ..engine.policies import Constant, make_policy
    from ..engine.sampling import SamplingParams
    from ..presets.config import get_preset
    from ..presets.loading import load_engine
    from .engine import DEFAULT_PROMPTS, load_prompts

    engine = load_engine(get_preset("demo"), device=device, dtype=dtype)
    cases = {"assistant-dynamic": ("assistant", make_policy("dynamic"), "preset"),
             "eagle3-chain-4": ("eagle3", Constant(4), None),
             "eagle3-tree-4x5-16": ("eagle3", None, TreeShape(4, 5, 16))}
    prompts = [engine.encode(p["prompt"]) for p in load_prompts(DEFAULT_PROMPTS, prompts)]
    same, agreeing, total = dict.fromkeys(cases, 0), dict.fromkeys(cases, 0), 0
    reads, forwards = dict.fromkeys(["plain", *cases], 0), dict.fromkeys(["plain", *cases], 0)
    for mode, policy, tree in [("baseline", None, "preset"), *cases.values()]:
        # built before reads are counted: loading reads the host (a route timed, weights checked for GGUF blocks)
        run(engine.decoder(mode, tree=tree), prompts[0], 4, SamplingParams(), policy, max_reuse=0)
    for ids in prompts:
        with HostReads() as counted:
            plain, summary = run(engine.decoder("baseline"), ids, max_new_tokens, SamplingParams(), max_reuse=0)
        reads["plain"] += counted.total
        forwards["plain"] += summary.target_forwards
        total += len(plain)
        for name, (mode, policy, tree) in cases.items():
            with HostReads() as counted:
                new, summary = run(engine.decoder(mode, tree=tree), ids, max_new_tokens, SamplingParams(), policy,
                                   max_reuse=0)
            same[name] += new == plain
            agreeing[name] += next((i for i, (a, b) in enumerate(zip(new, plain)) if a != b), min(len(new), len(plain)))
            reads[name] += counted.total
            forwards[name] += summary.target_forwards
    # bfloat16 rounds a verify's rows and a step differently, so greedy paths may part at a near-tie:
    # the share of plain decoding's tokens each mode reproduced before parting says how often
    return {"prompts": len(prompts), "dtype": dtype, "identical_to_plain": same,
            "tokens_agreeing_before_parting": {k: round(v / max(1, total), 3) for k, v in agreeing.items()},
            "host_reads_per_target_forward": {k: round(reads[k] / max(1, forwards[k]), 2) for k in reads}}


def random_model(shape: dict, dtype: torch.dtype, device: torch.device, context: int = 8192):
    """A Llama-shaped model with random weights, built on the device directly (no host copy). The
    output head is drawn wide (std 1): logits then have clear winners, so greedy decoding is the same
    in a step and in a verify despite bfloat16's rounding (with std 0.02 near-ties flip)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=context, tie_word_embeddings=False, **shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 if name == "lm_head.weight" else 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)   # its buffers were on meta
    return model.eval()


def random_head(target, dtype: torch.dtype, draft_vocab: int = 32000):
    """An EAGLE-3 head shaped for the target (one layer of its width, a 32k draft vocabulary as the
    published Llama-3.1-8B head has), random weights on the device; a wide output head, so its
    drafts are confident and a tree grows as deep as a trained head's (flat logits keep it shallow)."""
    from transformers import LlamaConfig

    from ..engine.eagle3_head import Eagle3Head

    tc, device = target.config, target.device
    draft_vocab = min(draft_vocab, tc.vocab_size)
    cfg = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                      num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
                      num_hidden_layers=1, draft_vocab_size=draft_vocab, max_position_embeddings=tc.max_position_embeddings)
    with torch.device(device):                       # ~0.4 B parameters at 8B width: made where they live
        head = Eagle3Head(cfg, own_embedding=False).to(dtype)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 1.0 if name == "lm_head.weight" else 0.02)
        ids = torch.randperm(tc.vocab_size, device=device)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab, device=device))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head.eval()


def gpu_idle_share(fn, device: torch.device) -> float | None:
    """Share of fn's wall time during which no GPU kernel ran (host overhead), from the profiler."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    # kernels only: an operator's self device time is its kernels' time again (counted twice before)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    return max(0.0, 1.0 - busy_us / 1e6 / wall)


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of time spans (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _forward_ms(lm, vocab: int, device: torch.device, context: int = 128) -> dict:
    """Median ms of a target forward of 1-17 new tokens after `context` cached ones."""
    prefix = torch.randint(0, vocab, (context,), device=device)
    out = {}
    for n in (1, 2, 5, 9, 17):
        ids = torch.randint(0, vocab, (n,), device=device)
        times = []
        for _ in range(6):
            lm.reset()
            lm.forward(prefix, last_only=True)
            sync(device)
            t0 = time.perf_counter()
            lm.forward(ids)
            sync(device)
            times.append(time.perf_counter() - t0)
        out[n] = round(1000 * sorted(times)[len(times) // 2], 2)
    return out


def ceiling(shape_name: str, device: torch.device, dtype: torch.dtype, max_new_tokens: int = 128,
            contexts: tuple[int, ...] = (128, 4096), on_row=None) -> dict:
    """The engine at real size on random weights: target forward cost by tokens (graphs on and off),
    then per context plain decoding against a random EAGLE-3 head whose drafts are accepted at a
    known rate (ScriptedAcceptance: 1.0 is the ceiling, 0.7 a good trained head), chain and tree;
    tokens/s, accepted length, host reads per target forward, GPU idle share. on_row(report) after
    each row, so a stopped run keeps what it measured."""
    from ..engine.decoder import Decoder, run
    from ..engine.eagle_drafter import Eagle3Drafter, TreeShape
    from ..engine.forward import make_lm
    from ..engine.policies import Constant
    from ..engine.sampling import SamplingParams
    from .scripted import ScriptedAcceptance

    target_shape = SHAPES[shape_name]
    vocab = target_shape["vocab_size"]
    target = random_model(target_shape, dtype, device, context=max(contexts) + 2 * max_new_tokens + 64)
    lm = make_lm(target)
    graphs = getattr(lm, "static", None) is not None
    report = {"shape": shape_name, "graphs": graphs, "target_forward_ms_by_tokens": _forward_ms(lm, vocab, device),
              "methods": {}}
    if graphs:
        lm.use_static_steps(False)
        report["target_forward_ms_by_tokens_graphs_off"] = _forward_ms(lm, vocab, device)
        lm.use_static_steps(True)
    head = random_head(target, dtype)
    plain = Decoder(target, target_lm=lm)
    chain, tree = Eagle3Drafter(head, target), Eagle3Drafter(head, target, TreeShape(4, 5, 16))
    sampling = SamplingParams()

    def measure(name: str, decoder, policy, prompt):
        run(decoder, prompt, 16, sampling, policy, max_reuse=0)                      # warm-up (and graph capture)
        with HostReads() as reads:
            _, summary = run(decoder, prompt, max_new_tokens, sampling, policy, max_reuse=0)
        st = summary.stats()
        idle = gpu_idle_share(lambda: run(decoder, prompt, 32, sampling, policy, max_reuse=0), device)
        report["methods"][name] = {
            "tokens_per_s": round(st["tokens_per_s"], 1), "mean_accepted_length": round(st["mean_accepted_length"], 2),
            "target_forwards": st["target_forwards"],
            "host_reads_per_target_forward": round(reads.total / max(1, st["target_forwards"]), 2),
            "gpu_idle_share": None if idle is None else round(idle, 3)}
        base = report["methods"].get(name.split("/")[0] + "/plain", {}).get("tokens_per_s")
        report["methods"][name]["speedup"] = round(st["tokens_per_s"] / base, 2) if base else None
        if on_row:
            on_row(report)

    for context in contexts:
        prompt = torch.randint(0, vocab, (context,)).tolist()
        reference = prompt + run(plain, prompt, max_new_tokens + 24, sampling, max_reuse=0)[0]
        measure(f"ctx{context}/plain", plain, None, prompt)
        for rate in (1.0, 0.7):
            for name, drafter, policy in (("chain-k4", chain, Constant(4)), ("tree-4x5-16", tree, None)):
                decoder = Decoder(target, ScriptedAcceptance(drafter, reference, rate, vocab), target_lm=lm)
                measure(f"ctx{context}/eagle3-{name}-accept-{rate:g}", decoder, policy, prompt)
        if graphs and context == contexts[0]:          # what the graphs buy, in whole rounds
            lm.use_static_steps(False)
            measure(f"ctx{context}/plain-graphs-off", plain, None, prompt)
            measure(f"ctx{context}/eagle3-chain-k4-accept-0.7-graphs-off",
                    Decoder(target, ScriptedAcceptance(chain, reference, 0.7, vocab), target_lm=lm), Constant(4), prompt)
            lm.use_static_steps(True)
    report["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
    return report


LIMIT_MIB = 64         # what a device run may carry


# what the check does not read: left behind by `scripts/device-check.sh --slim` (untracked and ignored
# until --unslim; the files stay on disk), so what travels fits the limit with the wheels
LEFT_BEHIND = ("data/models/smollm2-draft", "data/models/smollm2-eagle3", "data/responses", "data/bench/smollm2-135m",
               "docs")


def travel_size(root: Path) -> dict:
    """What a device run carries: the working tree's tracked and unignored files (git ls-files), plus the
    wheels folder it is given; the total against the limit, the largest files, and the total once
    --slim leaves LEFT_BEHIND out."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                           check=True).stdout.decode().split("\0")
    sizes = {n: (root / n).stat().st_size for n in names if n and (root / n).is_file()}
    wheels = root / ".device-wheels"
    if wheels.is_dir():
        sizes.update({str(p.relative_to(root)): p.stat().st_size for p in wheels.glob("*.whl")})
    total = sum(sizes.values()) / 2**20
    slim = sum(b for n, b in sizes.items() if not n.startswith(LEFT_BEHIND)) / 2**20
    carried = sum(b for n, b in sizes.items() if n.startswith(".device-wheels/")) / 2**20
    return {"mib": round(total, 1), "limit_mib": LIMIT_MIB, "fits": total <= LIMIT_MIB, "slim_mib": round(slim, 1),
            "slim_fits": slim <= LIMIT_MIB, "wheels_mib": round(carried, 1),
            "largest": {n: round(b / 2**20, 1) for n, b in sorted(sizes.items(), key=lambda x: -x[1])[:6]}}


def main(args) -> int:
    from ..presets.config import ROOT
    from ..presets.loading import resolve_device

    if getattr(args, "dry_run", False):       # on this machine: what would travel, and the check's CPU half
        size = travel_size(ROOT)
        print(json.dumps({"travel": size}), flush=True)
        args.device, args.shape = "cpu", "small"
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    shape = args.shape or ("llama-8b" if cuda else "small")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
              "torch": torch.__version__}

    def save(name=None, part=None):
        if name:
            report[name] = part
        (out / "device_check.json").write_text(json.dumps(report, indent=2))

    # on a CPU (the dry run) fewer prompts and tokens: it tests the steps, it measures nothing
    steps = [("lossless_float32", lambda: lossless(str(device), "float32", prompts=12 if cuda else 6))]
    if cuda:
        steps.append(("lossless_bfloat16", lambda: lossless(str(device), "bfloat16")))
    steps.append(("ceiling", lambda: ceiling(shape, device, torch.bfloat16 if cuda else torch.float32,
                                             max_new_tokens=128 if cuda else 48,
                                             contexts=(128, 4096) if cuda else (128, 512),
                                             on_row=lambda part: save("ceiling", part))))
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            report[name] = step()
        except Exception as e:  # noqa: BLE001 - one step failing must not lose the others' figures
            report[name] = {**report.get(name, {}), "error": f"{type(e).__name__}: {str(e)[:500]}"}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        save()
        print(json.dumps({name: report[name]}), flush=True)
    return 0

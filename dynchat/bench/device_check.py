"""`python -m dynchat device-check`: what a GPU machine must confirm, in one short run (scripts/device-check.sh).

1. lossless: the demo preset on the device, every mode (assistant, EAGLE-3 chain and tree), greedy,
   against plain decoding of the same target: how many prompts give identical tokens;
2. the bench's methods on the demo preset on the device;
3. the engine's ceiling at real size: random weights shaped like Llama-3.1-8B (target) and
   Llama-3.2-1B (draft), the target drafting for itself (every draft token accepted), so the figures
   are the loop's own: ms per target forward for 1-17 tokens, tokens/s plain vs speculative, and the
   time per round the GPU spends idle waiting for the host (round overhead).

Everything is written to --out as JSON; nothing needs the network. On a CPU it runs the same steps
with --shape small (to test this script, not to measure).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from .host_reads import HostReads

SHAPES = {  # name: (target config kwargs, draft config kwargs)
    "llama-8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
                 dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)),
    "small": (dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=4096),
              dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=4096)),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lossless(device: str, dtype: str, max_new_tokens: int = 64) -> dict:
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
    prompts = [engine.encode(p["prompt"]) for p in load_prompts(DEFAULT_PROMPTS, 12)]
    same = dict.fromkeys(cases, 0)
    reads, forwards = dict.fromkeys(["plain", *cases], 0), dict.fromkeys(["plain", *cases], 0)
    for mode, policy, tree in [("baseline", None, "preset"), *cases.values()]:
        # built before reads are counted: loading reads the host (a route timed, weights checked for GGUF blocks)
        run(engine.decoder(mode, tree=tree), prompts[0], 4, SamplingParams(), policy, max_reuse=0)
    for ids in prompts:
        with HostReads() as counted:
            plain, summary = run(engine.decoder("baseline"), ids, max_new_tokens, SamplingParams(), max_reuse=0)
        reads["plain"] += counted.total
        forwards["plain"] += summary.target_forwards
        for name, (mode, policy, tree) in cases.items():
            with HostReads() as counted:
                new, summary = run(engine.decoder(mode, tree=tree), ids, max_new_tokens, SamplingParams(), policy,
                                   max_reuse=0)
            same[name] += new == plain
            reads[name] += counted.total
            forwards[name] += summary.target_forwards
    return {"prompts": len(prompts), "dtype": dtype, "identical_to_plain": same,
            "host_reads_per_target_forward": {k: round(reads[k] / max(1, forwards[k]), 2) for k in reads}}


def random_model(shape: dict, dtype: torch.dtype, device: torch.device):
    """A Llama-shaped model with random weights, built on the device directly (no host copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)   # its buffers were on meta
    return model.eval()


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


def ceiling(shape_name: str, device: torch.device, dtype: torch.dtype, max_new_tokens: int = 128) -> dict:
    """Plain vs speculative with the target as its own drafter: the engine's best case at this size."""
    from ..engine.decoder import Decoder, run
    from ..engine.drafters import DraftModelDrafter
    from ..engine.forward import make_lm
    from ..engine.policies import Constant
    from ..engine.sampling import SamplingParams

    target_shape, draft_shape = SHAPES[shape_name]
    target = random_model(target_shape, dtype, device)
    lm = make_lm(target)
    prefix = torch.randint(0, target_shape["vocab_size"], (128,), device=device)
    forward_ms = {}
    for n in (1, 2, 5, 9, 17):
        ids = torch.randint(0, target_shape["vocab_size"], (n,), device=device)
        times = []
        for _ in range(6):
            lm.reset()
            lm.forward(prefix, last_only=True)
            sync(device)
            t0 = time.perf_counter()
            lm.forward(ids)
            sync(device)
            times.append(time.perf_counter() - t0)
        forward_ms[n] = round(1000 * sorted(times)[len(times) // 2], 2)
    prompt = torch.randint(0, target_shape["vocab_size"], (64,)).tolist()
    plain = Decoder(target)
    rows = {}
    runs = {"plain": (plain, None)}
    for k in (3, 5, 7):
        runs[f"self-draft-k{k}"] = (Decoder(target, DraftModelDrafter(target, target_shape["vocab_size"], exact=True)),
                                    Constant(k))
    for name, (decoder, policy) in runs.items():
        run(decoder, prompt, 16, SamplingParams(), policy)                     # warm-up
        _, summary = run(decoder, prompt, max_new_tokens, SamplingParams(), policy, max_reuse=0)
        st = summary.stats()
        idle = gpu_idle_share(lambda d=decoder, p=policy: run(d, prompt, 32, SamplingParams(), p), device)
        rows[name] = {"tokens_per_s": round(st["tokens_per_s"], 1), "mean_accepted_length": st["mean_accepted_length"],
                      "target_forwards": st["target_forwards"], "gpu_idle_share": idle}
    base = rows["plain"]["tokens_per_s"]
    for row in rows.values():
        row["speedup"] = round(row["tokens_per_s"] / base, 2) if base else None
    del target, lm, plain, runs
    draft = random_model(draft_shape, dtype, device)
    draft_lm = make_lm(draft, exact=False)
    draft_lm.forward(prefix, last_only=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        draft_lm.forward(prefix[:1])
    sync(device)
    return {"shape": shape_name, "target_forward_ms_by_tokens": forward_ms, "methods": rows,
            "draft_step_ms": round((time.perf_counter() - t0) / 20 * 1000, 2),
            "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}


LIMIT_MIB = 64         # what a device run may carry


def travel_size(root: Path) -> dict:
    """What a device run carries: the working tree's tracked and unignored files (git ls-files), plus the
    wheels folder it is given; the total against the limit, and the largest files."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                           check=True).stdout.decode().split("\0")
    sizes = {n: (root / n).stat().st_size for n in names if n and (root / n).is_file()}
    wheels = root / ".device-wheels"
    if wheels.is_dir():
        sizes.update({str(p.relative_to(root)): p.stat().st_size for p in wheels.glob("*.whl")})
    total = sum(sizes.values()) / 2**20
    return {"mib": round(total, 1), "limit_mib": LIMIT_MIB, "fits": total <= LIMIT_MIB,
            "largest": {n: round(b / 2**20, 1) for n, b in sorted(sizes.items(), key=lambda x: -x[1])[:6]}}


def main(args) -> int:
    from ..presets.config import ROOT
    from ..presets.loading import resolve_device

    if getattr(args, "dry_run", False):       # on this machine: what would travel, and the check's CPU half
        size = travel_size(ROOT)
        print(json.dumps({"travel": size}), flush=True)
        args.device, args.shape = "cpu", "small"
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = args.shape or ("llama-8b" if device.type == "cuda" else "small")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__}
    steps = [("lossless", lambda: lossless(str(device), "bfloat16" if device.type == "cuda" else "float32")),
             ("ceiling", lambda: ceiling(shape, device, dtype))]
    for name, step in steps:
        t0 = time.perf_counter()
        try:
            report[name] = step()
        except Exception as e:  # noqa: BLE001 - one step failing must not lose the others' figures
            report[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        report[name]["seconds"] = round(time.perf_counter() - t0, 1)
        (out / "device_check.json").write_text(json.dumps(report, indent=2))
        print(json.dumps({name: report[name]}), flush=True)
    return 0

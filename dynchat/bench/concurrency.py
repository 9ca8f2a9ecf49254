"""`python -m dynchat bench --preset P --concurrency 1,4,8`: several chats at once, in-process vs vLLM.

N clients work through the preset's held-out prompts together: each sends one, reads the whole
reply, sends the next, so every N serves the same replies. The in-process engine serves one at a
time (the others queue on its lock, as in the app); vLLM batches them. Reported per engine, mode
and N: aggregate tokens/s (all replies' tokens / the time until the last ended), the mean per-reply
tokens/s while generating, and the mean and worst time a reply took (queueing included). Both
engines run the preset's models on the same machine, one after the other.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from ..engine.events import Summary
from ..engine.sampling import SamplingParams
from ..vllm.engine import QUIET_AFTER_S
from .engine import DEFAULT_PROMPTS, load_prompts


def clients_round(engine, mode: str, encoded: list[list[int]], n: int, max_new: int) -> dict:
    """n clients at once work through all the prompts (each takes the next when its reply ended)."""
    todo = list(range(len(encoded)))
    lock = threading.Lock()
    results: list[dict] = []
    time.sleep(QUIET_AFTER_S)              # vLLM servers of the other mode stop polling first

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            t0 = time.perf_counter()
            with engine.lock:                  # in-process: one at a time; vLLM: no wait
                policy = engine.policy(mode) if mode != "baseline" else None
                events = list(engine.decoder(mode).generate(encoded[i], max_new, SamplingParams(), policy,
                                                            threading.Event(), max_reuse=0))
            s = next(e for e in events if isinstance(e, Summary))
            with lock:
                results.append({"tokens": s.new_tokens, "tokens_per_s": s.tokens_per_s,
                                "latency_s": time.perf_counter() - t0, "accepted": s.accepted_tokens,
                                "rounds": s.draft_rounds})

    threads = [threading.Thread(target=client) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    rounds = sum(r["rounds"] for r in results)
    return {"clients": n, "replies": len(results), "tokens": tokens, "wall_s": wall,
            "aggregate_tokens_per_s": tokens / wall,
            "mean_reply_tokens_per_s": statistics.mean(r["tokens_per_s"] for r in results),
            "mean_latency_s": statistics.mean(r["latency_s"] for r in results),
            "max_latency_s": max(r["latency_s"] for r in results),
            "mean_accepted_length": 1 + sum(r["accepted"] for r in results) / rounds if rounds else 1.0}


def engines_for(preset):
    """The preset's models in-process, and on vLLM (always for engine: vllm presets)."""
    from ..presets.loading import load_engine
    from ..vllm.engine import VllmEngine

    yield "dynchat", load_engine(preset)
    yield "vllm", VllmEngine(preset)


def main(args) -> int:
    from ..presets.config import get_preset
    from ..presets.threads import set_cpu_threads

    set_cpu_threads(serving=True)
    preset = get_preset(args.preset)
    prompts = load_prompts(Path(args.prompts_file or preset.bench_prompts or DEFAULT_PROMPTS), args.limit)
    counts = sorted({int(c) for c in args.concurrency.split(",")})
    rows = []
    for name, engine in engines_for(preset):
        modes = ["baseline"] + [m for m in ("eagle3", "assistant") if m in engine.modes][:1]
        encoded = [engine.encode(p.get("messages") or p["prompt"], raw=p.get("raw", False)) for p in prompts]
        for mode in modes:                                  # warm-up
            clients_round(engine, mode, encoded[:2], 2, 8)
        for mode in modes:
            for n in tqdm(counts, desc=f"{name} {mode}"):
                rows.append({"engine": name, "mode": mode, **clients_round(engine, mode, encoded, n, args.max_new_tokens)})
        if hasattr(engine, "close"):
            engine.close()
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "concurrency.csv", index=False)
    meta = {"preset": preset.name, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "clients": counts}
    (out / "concurrency.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=2))
    _plot(df, out / "concurrency.png", preset.name)
    print(json.dumps(meta))
    print(df.round(2).to_string(index=False))
    return 0


def _plot(df: pd.DataFrame, path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (engine, mode), g in df.groupby(["engine", "mode"]):
        ax.plot(g["clients"], g["aggregate_tokens_per_s"], marker="o", label=f"{engine} {mode}")
    ax.set_xlabel("chats at once")
    ax.set_ylabel("tokens/s, all chats together")
    ax.set_title(f"{name}: concurrent chats")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

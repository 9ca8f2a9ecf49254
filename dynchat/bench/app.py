"""`python -m dynchat bench-app`: tokens/s the app shows vs the engine alone, same prompts and budget.

The app runs as its own process (`python app.py`, as deployed) on 127.0.0.1 and is driven through
its API with gradio_client from this process (streaming on, baseline comparison off), as a
browser would; the figure taken for the app is the tokens/s it displays and logs. The engine
alone runs the same decoder on the same prompt ids here, with no UI, twice: with the torch
thread count the app uses (it leaves a core to the web server on small machines, see
`presets.threads.set_cpu_threads`), and with torch's default. Runs rotate app / engine order per prompt
and repeat, after a warm-up of all three.

Then, per mode, a few three-turn chats through the app with the baseline comparison on (as a user
meets it): the time to the first token of each turn, which a kept conversation cache holds near the
first turn's however long the history grows.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import threading
from pathlib import Path

from tqdm import tqdm

from ..vllm.server import free_port

FOLLOW_UPS = ("Can you explain that in more detail?", "Thanks. Can you give me one more example?")


def launch_app(env: dict, log=None):
    """`python app.py` (this checkout's) on a free local port with `env` added to the environment, its
    output to `log` (a file, or nowhere); returns (the process, its URL) once the page answers."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from ..presets.config import ROOT

    port = free_port()
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env={**os.environ, **env, "GRADIO_SERVER_PORT": str(port)},
                           stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT if log else subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    for _ in range(600):
        try:
            urllib.request.urlopen(url, timeout=2)
            return app, url
        except Exception:  # noqa: BLE001 - not up yet
            if app.poll() is not None:
                raise RuntimeError("the app exited during start-up") from None
            time.sleep(0.5)
    app.terminate()
    raise RuntimeError("the app did not answer within 5 minutes")


def turn_ttft(client, store, preset: str, mode: str, policy: str, max_new: int, prompts: list[dict]) -> list[float]:
    """Median seconds to the first token of turns 1, 2, 3 of chats through the app (comparison on)."""
    by_turn: list[list[float]] = [[] for _ in range(1 + len(FOLLOW_UPS))]
    for i, prompt in enumerate(prompts):
        session, history = f"bench-app-turns-{mode}-{i}", []
        for message in (prompt["prompt"], *FOLLOW_UPS):
            history = client.predict(message, history, session, preset, mode, policy, max_new, 0.0, 1.0, True,
                                     api_name="/chat")[0]
        turns = store.session_turns(session)
        for t, v in enumerate(turns["ttft_s"].tolist()[-len(by_turn):]):
            by_turn[t].append(float(v))
    return [statistics.median(v) for v in by_turn]


def main(args) -> int:

    import torch
    from gradio_client import Client

    from ..app.store import Store
    from ..engine.decoder import run
    from ..engine.sampling import SamplingParams
    from ..engines import open_engine
    from ..presets.config import get_preset, preset_policy
    from ..presets.threads import set_cpu_threads
    from .engine import load_prompts

    preset = get_preset(args.preset)
    prompts = [p for p in load_prompts(Path(args.prompts_file), args.limit) if not p.get("raw")]
    db = Path(tempfile.mkdtemp(prefix="dynchat-bench-app-")) / "log.db"
    app, url = launch_app({"DYNCHAT_DB": str(db), "DYNCHAT_PRESET": preset.name, "DYNCHAT_STORE_TEXT": "0",
                           "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"})
    client = Client(url, verbose=False)
    engine = open_engine(preset)
    default_threads = torch.get_num_threads()
    app_threads = set_cpu_threads(serving=True)          # what the app process set for itself
    torch.set_num_threads(default_threads)
    store = Store(db)
    rows, ttft = [], {}
    try:
        for mode in args.modes.split(","):
            if mode not in engine.modes:
                continue
            policy_name = preset.generation.get(f"{'eagle3_' if mode == 'eagle3' else ''}lookahead") or "dynamic"
            name, k = preset_policy(preset, policy_name, None, mode)
            decoder = engine.decoder(mode)

            def through_app(i, prompt):
                client.predict(prompt["prompt"], [], f"bench-app-{mode}-{i}", preset.name, mode, name,
                               args.max_new_tokens, 0.0, 1.0, False, api_name="/chat")
                turns = store.session_turns(f"bench-app-{mode}-{i}")
                return float(turns["tokens_per_s"].iloc[-1]), int(turns["new_tokens"].iloc[-1])

            def alone(prompt, threads):
                torch.set_num_threads(threads)
                ids = engine.encode(prompt["prompt"])
                pol = engine.policy(mode, name)          # as the chat service sizes drafts
                try:
                    _, s = run(decoder, ids, args.max_new_tokens, SamplingParams(), pol, threading.Event(),
                               max_reuse=0)
                finally:
                    torch.set_num_threads(default_threads)
                return s.tokens_per_s, s.new_tokens

            runs = {"app": through_app, "engine": lambda i, p: alone(p, app_threads),
                    "engine_default_threads": lambda i, p: alone(p, default_threads)}
            for fn in runs.values():            # warm-up of every path
                fn(0, prompts[0])
            names = list(runs)
            for r in tqdm(range(args.repeats), desc=f"app vs engine ({mode})"):
                for i, p in enumerate(prompts):
                    shift = (i + r) % len(names)
                    res = {n: runs[n](i, p) for n in names[shift:] + names[:shift]}
                    rows.append({"mode": mode, "prompt": i, "repeat": r,
                                 **{f"{n}_tokens_per_s": v[0] for n, v in res.items()},
                                 **{f"{n}_new_tokens": v[1] for n, v in res.items()}})
            ttft[mode] = turn_ttft(client, store, preset.name, mode, name, args.max_new_tokens, prompts[:args.chats])
    finally:
        app.terminate()
        app.wait(30)
    summary = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        med = {n: statistics.median(r[f"{n}_tokens_per_s"] for r in rs) for n in ("app", "engine",
                                                                                 "engine_default_threads")}
        summary[mode] = {"app_tokens_per_s": med["app"], "engine_tokens_per_s": med["engine"],
                         "app_over_engine": med["app"] / med["engine"],
                         "engine_default_threads_tokens_per_s": med["engine_default_threads"],
                         "app_over_engine_default_threads": med["app"] / med["engine_default_threads"],
                         "same_token_counts": all(r["app_new_tokens"] == r["engine_new_tokens"]
                                                  == r["engine_default_threads_new_tokens"] for r in rs),
                         "runs": len(rs), "ttft_s_by_turn": ttft.get(mode)}
    out = {"preset": preset.name, "max_new_tokens": args.max_new_tokens, "app_threads": app_threads,
           "default_threads": default_threads, "prompts": len(prompts),
           "repeats": args.repeats, "summary": summary, "runs": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    return 0

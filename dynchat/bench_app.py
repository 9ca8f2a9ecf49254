"""`python -m dynchat bench-app`: tokens/s the app shows vs the engine alone, same prompts and budget.

The app runs as its own process (`python app.py`, as deployed) on 127.0.0.1 and is driven through
its API with gradio_client from this process (streaming on, baseline comparison off), as a
browser would; the figure taken for the app is the tokens/s it displays and logs. The engine
alone runs the same decoder on the same prompt ids here, with no UI. Runs alternate app / engine
per prompt and repeat, after a warm-up of both.
"""
from __future__ import annotations

import json
import socket
import statistics
import tempfile
import threading
from pathlib import Path

from tqdm import tqdm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(args) -> int:
    from gradio_client import Client

    from .bench import load_prompts
    from .config import get_preset, preset_policy
    from .engine.decoder import run
    from .engine.policies import make_policy
    from .engine.sampling import SamplingParams
    from .store import Store

    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from .config import ROOT
    from .loading import load_engine

    preset = get_preset(args.preset)
    prompts = [p for p in load_prompts(Path(args.prompts_file), args.limit) if not p.get("raw")]
    db = Path(tempfile.mkdtemp(prefix="dynchat-bench-app-")) / "log.db"
    port = _free_port()
    env = {**os.environ, "DYNCHAT_DB": str(db), "DYNCHAT_PRESET": preset.name, "GRADIO_SERVER_PORT": str(port),
           "DYNCHAT_STORE_TEXT": "0", "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            break
        except Exception:  # noqa: BLE001 - not up yet
            if app.poll() is not None:
                raise RuntimeError("the app exited during start-up") from None
            time.sleep(0.5)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    engine = load_engine(preset)
    store = Store(db)
    rows = []
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

            def alone(prompt):
                ids = engine.encode(prompt["prompt"])
                pol = None                       # as the chat service sizes drafts
                if mode == "eagle3" and engine.tree is not None:
                    pol = make_policy("constant", engine.tree.depth)
                elif mode != "baseline":
                    pol = make_policy(name, k)
                _, s = run(decoder, ids, args.max_new_tokens, SamplingParams(), pol, threading.Event())
                return s.tokens_per_s, s.new_tokens

            through_app(0, prompts[0])          # warm-up of both paths
            alone(prompts[0])
            for r in tqdm(range(args.repeats), desc=f"app vs engine ({mode})"):
                for i, p in enumerate(prompts):
                    first, second = (through_app, alone) if (i + r) % 2 == 0 else (alone, through_app)
                    res = {}
                    for fn in (first, second):
                        res[fn.__name__] = fn(i, p) if fn is through_app else fn(p)
                    rows.append({"mode": mode, "prompt": i, "repeat": r, "app_tokens_per_s": res["through_app"][0],
                                 "engine_tokens_per_s": res["alone"][0], "app_new_tokens": res["through_app"][1],
                                 "engine_new_tokens": res["alone"][1]})
    finally:
        app.terminate()
        app.wait(30)
    summary = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        app_tps = statistics.median(r["app_tokens_per_s"] for r in rs)
        eng_tps = statistics.median(r["engine_tokens_per_s"] for r in rs)
        summary[mode] = {"app_tokens_per_s": app_tps, "engine_tokens_per_s": eng_tps, "app_over_engine": app_tps / eng_tps,
                         "same_token_counts": all(r["app_new_tokens"] == r["engine_new_tokens"] for r in rs),
                         "runs": len(rs)}
    out = {"preset": preset.name, "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
           "repeats": args.repeats, "summary": summary, "runs": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    return 0

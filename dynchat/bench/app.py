"""`python -m dynchat bench-app`: tokens/s the app shows vs the engine alone, same prompts and budget.

The app runs as its own process (`python app.py`, as deployed) on 127.0.0.1 and is driven through
its API with gradio_client from this process (streaming on, baseline comparison off), as a
browser would; the figure taken for the app is the tokens/s it displays and logs. The engine
alone runs the same decoder on the same prompt ids here, with no UI, twice: with the torch
thread count the app uses (it leaves a core to the web server on small machines, see
`presets.threads.set_cpu_threads`), and with torch's default. Runs rotate app / engine order per prompt
and repeat. The app adds each reply to its lookup index (a later turn may draft from it), so the
engine alone does the same, and every prompt first runs once untimed on every path: each timed reply
is then one its path has written before, for the app and the engine alike. The tokens/s the app
shows include its prefill, which its kept caches shorten (a chat's earlier prompt, the prefix every
chat shares) where the engine alone prefills the whole prompt: the app's own cost per round is read
from the decode rates (tokens after the first over the time after it), `app_over_engine_decode`.

Then, per mode, a few three-turn chats through the app with the baseline comparison on (as a user
meets it): the time to the first token of each turn. A kept conversation cache prefills only the new
message and the template's tokens after it (the cache computes the next turn's start after each turn),
however long the history grows, so a turn's first token costs what its message costs. The last turn's
message is then sent alone, as a new chat's first: the last turn's time over that one is what the
history costs. Each follow-up comes READ_S after the reply before it, as a reader's would (much later).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

from ..vllm.server import free_port

FOLLOW_UPS = ("Can you explain that in more detail?", "Thanks. Can you give me one more example?")
# seconds before each follow-up: a reader's pause, far shorter than reading a reply takes. The app's worker
# computes the next turn's start in it (and the engine's time to the first token does not count a wait
# for that behind it)
READ_S = 0.5


def launch_app(env: dict, log=None):
    """`python app.py` (this checkout's) on a free local port with `env` added to the environment, its
    output to `log` (a file, or nowhere); returns (the process, its URL) once the page answers."""
    import os
    import subprocess
    import sys
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


def turn_ttft(client, store, preset: str, mode: str, policy: str, max_new: int, prompts: list[dict],
              shared: int) -> dict:
    """Medians over chats through the app (comparison on) for turns 1, 2, 3: seconds to the first
    token; and the last turn's message sent alone, as a new chat's first: the same new text without
    the history, so the last turn's time over it is what the history costs (the turns' messages differ
    in length). Prompt tokens prefilled where the log tells them: a chat's first turn all but the
    prefix every chat shares (`shared` rows); a later turn's count the log does not hold (the chat's
    cache holds its start, computed after the turn before)."""
    turns_n = 1 + len(FOLLOW_UPS)
    ttft: list[list[float]] = [[] for _ in range(turns_n)]
    first_prefilled, alone_ttft, alone_prefilled, last_over_alone = [], [], [], []
    for i, prompt in enumerate(prompts):
        session, history = f"bench-app-turns-{mode}-{i}", []
        for t, message in enumerate((prompt["prompt"], *FOLLOW_UPS)):
            time.sleep(READ_S if t else 0.0)
            history = client.predict(message, history, session, preset, mode, policy, max_new, 0.0, 1.0, True,
                                     api_name="/chat")[0]
        turns = store.session_turns(session).tail(turns_n)
        for t, v in enumerate(turns["ttft_s"].tolist()):
            ttft[t].append(float(v))
        first_prefilled.append(int(turns["prompt_tokens"].iloc[0]) - shared)
        fresh = f"bench-app-alone-{mode}-{i}"
        client.predict(FOLLOW_UPS[-1], [], fresh, preset, mode, policy, max_new, 0.0, 1.0, True, api_name="/chat")
        first = store.session_turns(fresh).iloc[-1]
        alone_ttft.append(float(first["ttft_s"]))
        alone_prefilled.append(int(first["prompt_tokens"]) - shared)
        last_over_alone.append(ttft[-1][-1] / alone_ttft[-1])
    return {"ttft_s_by_turn": [statistics.median(v) for v in ttft],
            "prefilled_tokens_first_turn": statistics.median(first_prefilled),
            "ttft_s_last_message_alone": statistics.median(alone_ttft),
            "prefilled_tokens_last_message_alone": statistics.median(alone_prefilled),
            "last_turn_over_alone": statistics.median(last_over_alone)}


def main(args) -> int:

    import torch
    from gradio_client import Client

    from ..app.store import Store
    from ..engine.decoder import run
    from ..engine.events import Summary
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
                last = store.session_turns(f"bench-app-{mode}-{i}").iloc[-1]
                logged = Summary(new_tokens=int(last["new_tokens"]), wall_s=float(last["wall_s"]),
                                 ttft_s=float(last["ttft_s"]))
                return float(last["tokens_per_s"]), logged.new_tokens, logged.decode_tokens_per_s

            def alone(prompt, threads):
                torch.set_num_threads(threads)
                ids = engine.encode(prompt["prompt"])
                pol = engine.policy(mode, name)          # as the chat service sizes drafts
                try:
                    out, s = run(decoder, ids, args.max_new_tokens, SamplingParams(), pol, threading.Event(),
                                 max_reuse=0)
                finally:
                    torch.set_num_threads(default_threads)
                if "lookup" in engine.modes:             # as the app does after each reply
                    engine.remember([out])
                return s.tokens_per_s, s.new_tokens, s.decode_tokens_per_s

            runs = {"app": through_app, "engine": lambda i, p: alone(p, app_threads),
                    "engine_default_threads": lambda i, p: alone(p, default_threads)}
            for i, p in enumerate(prompts):     # untimed: warms every path, and each learns every reply once
                for fn in runs.values():
                    fn(i, p)
            names = list(runs)
            for r in tqdm(range(args.repeats), desc=f"app vs engine ({mode})"):
                for i, p in enumerate(prompts):
                    shift = (i + r) % len(names)
                    res = {n: runs[n](i, p) for n in names[shift:] + names[:shift]}
                    rows.append({"mode": mode, "prompt": i, "repeat": r,
                                 **{f"{n}_tokens_per_s": v[0] for n, v in res.items()},
                                 **{f"{n}_new_tokens": v[1] for n, v in res.items()},
                                 **{f"{n}_decode_tokens_per_s": v[2] for n, v in res.items()}})
            shared = decoder.target.shared_rows(engine.encode(prompts[0]["prompt"]))
            ttft[mode] = turn_ttft(client, store, preset.name, mode, name, args.max_new_tokens, prompts[:args.chats],
                                   shared)
    finally:
        app.terminate()
        app.wait(30)
    summary = {}
    for mode in sorted({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == mode]
        turns = ttft[mode]                    # every mode measured ran its three-turn chats too
        paths = ("app", "engine", "engine_default_threads")
        med = {n: statistics.median(r[f"{n}_tokens_per_s"] for r in rs) for n in paths}
        dec = {n: statistics.median(r[f"{n}_decode_tokens_per_s"] for r in rs) for n in paths}
        summary[mode] = {"app_tokens_per_s": med["app"], "engine_tokens_per_s": med["engine"],
                         "app_over_engine": med["app"] / med["engine"],
                         "engine_default_threads_tokens_per_s": med["engine_default_threads"],
                         "app_over_engine_default_threads": med["app"] / med["engine_default_threads"],
                         "app_decode_tokens_per_s": dec["app"], "engine_decode_tokens_per_s": dec["engine"],
                         "app_over_engine_decode": dec["app"] / dec["engine"],
                         "app_over_engine_default_threads_decode": dec["app"] / dec["engine_default_threads"],
                         "same_token_counts": all(r["app_new_tokens"] == r["engine_new_tokens"]
                                                  == r["engine_default_threads_new_tokens"] for r in rs),
                         "runs": len(rs), **turns}
    out = {"preset": preset.name, "max_new_tokens": args.max_new_tokens, "app_threads": app_threads,
           "default_threads": default_threads, "prompts": len(prompts),
           "repeats": args.repeats, "summary": summary, "runs": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    return 0

"""Reliability and security of the public app: load, faults, hostile input, data isolation.

The slow ones are marked `slow` (select with -m slow, skip with -m "not slow").
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import MESSAGE, ROOT, reply_text
from sqlalchemy import event

from dynchat.app.store import Store
from dynchat.vllm.server import free_port


def chat(client, message, client_id, mode="assistant", max_new=12, preset="tiny", history=None, **kw):
    args = dict(message=message, history=history or [], client_id=client_id, preset=preset, mode=mode,
                policy="dynamic", max_new=max_new, temperature=0.0, top_p=1.0, compare=True)
    args.update(kw)
    return client.predict(**args, api_name="/chat")


@pytest.fixture(scope="module")
def hostile_yaml(tiny_preset, tmp_path_factory):
    """The tiny presets plus broken ones: an EAGLE-3 head for another target, an assistant whose
    tokenizer cannot carry text."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dynchat.engine.eagle3_head import Eagle3Head

    root = tiny_preset.parent
    if not (root / "wrong-head").exists():
        cfg = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=256)
        Eagle3Head(cfg, own_embedding=False).save_pretrained(root / "wrong-head")
        tok = AutoTokenizer.from_pretrained(root / "target")
        small = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
        small.save_pretrained(root / "no-tokenizer-draft")       # other vocabulary, no tokenizer to map through
        del tok
    text = tiny_preset.read_text() + (
        "  wrong-head:\n    target: target\n    eagle3: wrong-head\n    device: cpu\n"
        "  bad-assistant:\n    target: target\n    assistant: no-tokenizer-draft\n    device: cpu\n")
    path = root / "hostile.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def app(hostile_yaml, tmp_path_factory):
    from gradio_client import Client

    from dynchat.app.ui import create_app, launch

    db = tmp_path_factory.mktemp("db") / "app.db"
    demo = create_app(Store(db), hostile_yaml, engine_process=False)   # in-process: the OOM test patches the model
    demo.service.stream_interval = 0.0
    port = free_port()
    launch(demo, server_port=port, prevent_thread_lock=True, quiet=True)
    yield demo, port, Client(f"http://127.0.0.1:{port}/", verbose=False)
    demo.close()


# -- load ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_eight_clients_five_turns_each_mixed_modes(app):
    from gradio_client import Client

    demo, port, _ = app
    modes = ["baseline", "lookup", "assistant", "eagle3"]

    def user(u):
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        replies = []
        for t in range(5):
            out = chat(client, f"{MESSAGE} ({u}.{t})", f"load-{u}", mode=modes[(u + t) % 4], max_new=12)
            replies.append(reply_text(out[0]))
        return replies

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(user, range(8)))
    wall = time.perf_counter() - t0
    assert all(len(r) == 5 and all(r) for r in results)
    store = demo.service.store
    turns = [store.session_turns(f"load-{u}") for u in range(8)]
    assert sum(len(t) for t in turns) == 40
    assert all(set(t["status"]) == {"ok"} for t in turns)
    assert all(t["error"].isna().all() for t in turns)
    print(f"load: 40/40 turns in {wall:.1f} s")


@pytest.mark.slow
def test_a_full_queue_refuses_excess_politely(hostile_yaml, tmp_path, monkeypatch):
    """One chat runs and two wait (DYNCHAT_QUEUE_SIZE=2, one chat at a time): the other five are refused with a message.
    The running chat is held at a gate until the refusals are in, so a fast machine cannot finish
    each chat before the next arrives."""
    import threading

    from gradio_client import Client
    from gradio_client.utils import Status

    from dynchat.app import ui
    from dynchat.app.ui import create_app, launch

    monkeypatch.setenv("DYNCHAT_QUEUE_SIZE", "2")
    monkeypatch.setattr(ui, "CONCURRENT_CHATS", 1)      # one chat at a time (8 by default), as on ZeroGPU
    demo = create_app(Store(tmp_path / "q.db"), hostile_yaml, engine_process=False)
    lm = demo.service.engine("tiny").decoder("assistant").target
    gate, real = threading.Event(), lm.forward

    def held(*a, **k):
        gate.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(lm, "forward", held)
    port = free_port()
    launch(demo, server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        clients = [Client(f"http://127.0.0.1:{port}/", verbose=False) for _ in range(8)]

        def submit(i):
            return clients[i].submit(MESSAGE, [], f"q-{i}", "tiny", "assistant", "dynamic", 200, 0.0, 1.0, True,
                                     api_name="/chat")
        running = {Status.PROCESSING, Status.ITERATING, Status.PROGRESS}
        first, deadline = submit(0), time.time() + 120
        while time.time() < deadline and first.status().code not in running:
            time.sleep(0.1)          # the first chat has left the queue (held at the gate): then the others come
        jobs = [first] + [submit(i) for i in range(1, 8)]
        arrived = {Status.QUEUE_FULL, Status.IN_QUEUE, Status.SENDING_DATA, *running}
        while time.time() < deadline and not all(j.done() or j.status().code in arrived for j in jobs):
            time.sleep(0.1)                             # every chat has reached the queue (or been refused)
        gate.set()
        done, refused = 0, []
        for job in jobs:
            try:
                job.result(timeout=120)
                done += 1
            except Exception as e:  # noqa: BLE001 - the refusal is what we look at
                refused.append(str(e))
        assert done == 3 and len(refused) == 5, (done, refused)     # 1 runs, 2 wait
        assert all("queue" in r.lower() and "full" in r.lower() for r in refused), refused
        # and it still serves afterwards
        assert reply_text(chat(clients[0], MESSAGE, "q-after", max_new=4)[0])
        served = pd.concat(demo.service.store.session_turns(f"q-{i}") for i in range(8))
        assert list(served["status"]) == ["ok"] * done  # the refused left no turn behind
    finally:
        gate.set()
        demo.close()


# -- faults -------------------------------------------------------------------------------------
def _wait_for(url: str, timeout: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.3)
    raise TimeoutError(url)


def _serve(yaml_path, db, port):
    env = {**os.environ, "DYNCHAT_MODELS": str(yaml_path), "DYNCHAT_DB": str(db), "GRADIO_SERVER_PORT": str(port),
           "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _wait_for(f"http://127.0.0.1:{port}/")
    return proc


def _workers_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                    and b"dynchat.app.worker" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigkill_mid_generation_then_restart(tiny_preset, tmp_path):
    from gradio_client import Client

    db, port = tmp_path / "kill.db", free_port()
    proc = _serve(tiny_preset, db, port)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        for i in range(3):
            chat(client, f"{MESSAGE} {i}", "kill-me", max_new=8)
        before = Store(db).session_turns("kill-me", with_text=True)
        job = client.submit(MESSAGE, [], "kill-me", "tiny", "assistant", "dynamic", 200, 0.8, 1.0, True, api_name="/chat")
        t0 = time.time()
        while time.time() - t0 < 60:                    # kill while a turn is being generated
            with sqlite3.connect(db) as c:
                if c.execute("select count(*) from turns where status='running'").fetchone()[0]:
                    break
            time.sleep(0.005)
        workers = _workers_of(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        del job
        assert workers, "the app serves from an engine worker process"
        t0 = time.time()                                 # the orphaned worker notices and exits
        while time.time() - t0 < 20 and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    after = Store(db).session_turns("kill-me", with_text=True)       # reopening marks cut-off turns
    assert len(after) in (3, 4)
    cols = ["id", "status", "prompt_text", "reply_text", "new_tokens", "tokens_per_s", "speedup"]
    pd.testing.assert_frame_equal(after[cols].head(3), before[cols], check_dtype=False)
    if len(after) == 4:
        assert after.loc[3, "status"] == "incomplete"
    proc = _serve(tiny_preset, db, port)                              # and it serves again
    try:
        assert reply_text(chat(Client(f"http://127.0.0.1:{port}/", verbose=False), MESSAGE, "kill-me", max_new=4)[0])
    finally:
        proc.kill()
        proc.wait(10)


def test_out_of_memory_during_generation_is_a_clear_message(app, monkeypatch):
    demo, _, client = app
    engine = demo.service.engine("tiny")
    lm = engine.decoder("assistant").target
    calls = {"n": 0}
    real = lm.forward

    def oom_on_third(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a, **k)

    monkeypatch.setattr(lm, "forward", oom_on_third)
    out = chat(client, MESSAGE, "oom", max_new=12)
    assert "ran out of memory" in out[2]
    monkeypatch.setattr(lm, "forward", real)
    assert reply_text(chat(client, MESSAGE, "oom", max_new=4)[0])
    assert list(demo.service.store.session_turns("oom")["status"]) == ["error", "ok"]


def test_full_disk_for_the_database_is_a_clear_message(app):
    from gradio_client.exceptions import AppError

    demo, _, client = app
    store = demo.service.store
    chat(client, MESSAGE, "disk", max_new=4)
    with sqlite3.connect(store.path) as c:
        pages = c.execute("PRAGMA page_count").fetchone()[0]

    def full(conn, _):
        conn.execute(f"PRAGMA max_page_count={pages}")

    event.listen(store.engine, "connect", full)
    store.engine.dispose()
    try:
        with pytest.raises(AppError, match="database or disk is full"):
            for i in range(300):         # fill the last free pages, then the refusal
                chat(client, f"{i} " + "yes " * 60, "disk", max_new=4)
    finally:
        event.remove(store.engine, "connect", full)
        store.engine.dispose()
    assert reply_text(chat(client, MESSAGE, "disk", max_new=4)[0])
    turns = store.session_turns("disk")
    assert turns.loc[0, "status"] == "ok" and turns.iloc[-1]["status"] == "ok"


# -- hostile input ------------------------------------------------------------------------------
HOSTILE = [
    ({"message": ""}, "empty"),
    ({"message": "   \n\t "}, "empty"),
    ({"message": "x" * 100_000}, "limit is 32000"),
    ({"message": "\x00\x01\x07\x08"}, "empty"),                        # control characters only
    ({"message": "\x1b[31mred\x1b[0m \x00 text"}, None),              # terminal escapes: cleaned, answered
    ({"message": "word " * 790}, "too long for this model"),           # beyond the 256-token context
    ({"history": [{"role": "user", "content": [{"type": "text", "text": "word " * 150}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}] * 3},
     "dropped to fit"),
    ({"temperature": -1.0}, "less than minimum value"),
    ({"temperature": 1e9}, "greater than maximum value"),
    ({"top_p": 0.0}, "less than minimum value"),
    ({"top_p": 1.5}, "greater than maximum value"),
    ({"max_new": 0}, "less than minimum value"),
    ({"max_new": 10**7}, "greater than maximum value"),
    ({"mode": "telepathy"}, "not in the list of choices"),
    ({"policy": "psychic"}, "not in the list of choices"),
    ({"preset": "nope"}, "not in the list of choices"),
    ({"preset": "unreachable"}, "cannot load the target"),
    ({"preset": "wrong-head", "mode": "eagle3"}, "does not fit the target"),
    ({"preset": "bad-assistant"}, "vocabulary size"),
    ({"client_id": "x" * 10_000}, None),                              # odd client ids are just ids
]


def test_hostile_inputs_through_the_api(app):
    from gradio_client.exceptions import AppError

    demo, _, client = app
    store = demo.service.store
    chat(client, MESSAGE, "hostile", max_new=4)
    kept = store.session_turns("hostile", with_text=True)
    assert len(HOSTILE) >= 15
    for change, message in HOSTILE:
        args = {"message": MESSAGE, "client_id": "hostile", "max_new": 4, **change}
        if message is None:          # served like any other message, and logged under that id
            before = len(store.session_turns(args["client_id"]))
            assert reply_text(chat(client, **args)[0]).strip()
            assert list(store.session_turns(args["client_id"])["status"])[before:] == ["ok"]
        else:
            try:
                out = chat(client, **args)
            except AppError as e:
                assert message.lower() in str(e).lower(), (change, str(e))
            else:            # answered, with the notice in the metrics line
                assert message.lower() in out[2].lower(), (change, out[2])
        assert reply_text(chat(client, MESSAGE, "hostile-next", max_new=4)[0]), f"no answer after {change}"
    after = store.session_turns("hostile", with_text=True)
    cols = ["id", "status", "prompt_text", "reply_text"]
    assert after[cols].head(len(kept)).equals(kept[cols])


def raw_chat(port: int, message: str) -> tuple[str, str]:
    """POST to the REST API with the JSON escaped by hand (gradio_client cannot send lone surrogates)."""
    import json

    data = [message, [], "hostile-raw", "tiny", "assistant", "dynamic", 4, 0.0, 1.0, True]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/gradio_api/call/chat",
                                 data=json.dumps({"data": data}, ensure_ascii=True).encode(),
                                 headers={"Content-Type": "application/json"})
    event_id = json.loads(urllib.request.urlopen(req, timeout=30).read())["event_id"]
    stream = urllib.request.urlopen(f"http://127.0.0.1:{port}/gradio_api/call/chat/{event_id}", timeout=60).read().decode()
    events = [line.removeprefix("event: ") for line in stream.splitlines() if line.startswith("event: ")]
    return events[-1], stream


def test_lone_surrogates_and_raw_json(app):
    demo, port, _ = app
    status, stream = raw_chat(port, "a\ud800b\udfffc what is json?")
    assert status == "complete", stream
    turns = demo.service.store.session_turns("hostile-raw", with_text=True)
    assert list(turns["status"]) == ["ok"] and "\ud800" not in turns.loc[0, "prompt_text"]


@pytest.mark.slow
def test_malformed_models_yaml_is_one_clear_line(tmp_path):
    bad = tmp_path / "models.yaml"
    bad.write_text("presets:\n  x: [unclosed\n")
    r = subprocess.run([sys.executable, "app.py"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "DYNCHAT_MODELS": str(bad), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    assert "not valid YAML" in r.stderr and "Traceback" not in r.stderr


# -- isolation ----------------------------------------------------------------------------------
def test_sessions_never_see_each_other(app):
    import csv

    demo, port, client = app
    a = chat(client, "=cmd|' /C calc'!A0 alpha secret", "iso-a", max_new=4)
    b = chat(client, "bravo words", "iso-b", max_new=4)
    a_csv, b_csv = a[9], b[9]
    rows_a = list(csv.DictReader(open(a_csv, newline="")))
    rows_b = list(csv.DictReader(open(b_csv, newline="")))
    store = demo.service.store
    assert [int(r["id"]) for r in rows_a] == list(store.session_turns("iso-a")["id"])
    assert [int(r["id"]) for r in rows_b] == list(store.session_turns("iso-b")["id"])
    assert "bravo" not in open(a_csv).read() and "alpha" not in open(b_csv).read()
    assert rows_a[0]["prompt_text"].startswith("'=")                   # formula neutralised
    # files are served only where Gradio was told to; the database and config are not among them
    for path in (demo.service.store.path, ROOT / "models.yaml"):
        url = f"http://127.0.0.1:{port}/gradio_api/file={path}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code in (403, 404)
    table = client.predict(api_name="/analysis")
    assert "secret" not in str(table) and "bravo" not in str(table)

"""The app launched on 127.0.0.1 and driven through its API with gradio_client."""
from __future__ import annotations

import csv
import time

import pytest
from conftest import MESSAGE, baseline_text, is_thought, reply_text

from dynchat.app.store import Store
from dynchat.vllm.server import free_port

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def app(tiny_preset, tmp_path_factory):
    from gradio_client import Client

    from dynchat.app.ui import create_app, launch

    db = tmp_path_factory.mktemp("db") / "app.db"
    demo = create_app(Store(db), tiny_preset)
    demo.service.stream_interval = 0.0   # the tiny models finish a reply within one 100 ms batch
    port = free_port()
    launch(demo, server_port=port, prevent_thread_lock=True, quiet=True)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    yield demo, client
    demo.close()


def chat(client, message, client_id, mode="assistant", max_new=16, preset="tiny", **kw):
    args = dict(message=message, history=[], client_id=client_id, preset=preset, mode=mode, policy="dynamic",
                max_new=max_new, temperature=0.0, top_p=1.0, compare=True)
    args.update(kw)
    return client.predict(**args, api_name="/chat")


@pytest.mark.parametrize("mode", ["baseline", "lookup", "assistant", "eagle3"])
def test_a_turn_in_each_mode(app, mode):
    demo, client = app
    out = chat(client, MESSAGE, f"e2e-{mode}", mode=mode)
    history, _, metrics = out[0], out[1], out[2]
    conversation = [m for m in history if not is_thought(m)]
    assert conversation[-2]["role"] == "user" and reply_text(history)
    assert "tokens/s" in metrics and "speedup" in metrics
    if mode == "baseline":           # nothing to compare with: no second reply under it
        assert not baseline_text(history)
    else:                            # greedy: plain decoding's reply, shown under it, is the same text
        assert baseline_text(history) == reply_text(history)
        assert history[-1]["metadata"]["status"] == "done" and "tokens/s" in history[-1]["metadata"]["log"]
        assert "same tokens as the baseline" in metrics
    turns = demo.service.store.session_turns(f"e2e-{mode}")
    assert list(turns["status"]) == ["ok"] and turns.loc[0, "mode"] == mode
    assert turns.loc[0, "baseline_tokens_per_s"] > 0
    assert not demo.service.store.turn_rounds(int(turns.loc[0, "id"])).empty


def test_streaming_yields_several_updates(app):
    _, client = app
    # a budget long enough to span several socket reads from the engine worker however fast it runs (160 tokens
    # of the tiny model arrived in three)
    job = client.submit(MESSAGE, [], "e2e-stream", "tiny-long", "baseline", "dynamic", 1000, 0.0, 1.0, False,
                        api_name="/chat")
    job.result(timeout=120)
    outputs = job.outputs()
    lengths = [len(reply_text(o[0])) for o in outputs]
    assert len(outputs) >= 4 and lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_messages_keep_their_indentation(app):
    # Gradio dedents plain-string chat messages (inspect.cleandoc): code lost its indentation on the
    # page and in the history sent back with the next turn, and a streamed reply could shrink
    _, client = app
    message = "Fix this:\n    def f(x):\n        return x\n"
    history = chat(client, message, "e2e-indent", mode="baseline", max_new=4)[0]
    assert reply_text(history[-2:-1]) == message


def test_cancel_stops_generation_and_logs_it(app):
    demo, client = app
    # a message not asked before (no drafts from earlier replies finish it before the Stop), stopped as soon
    # as the reply streams
    # (the long-context pair: the tiny one's 256-token context ended the reply before the Stop arrived)
    job = client.submit("Tell me a long story.", [], "e2e-cancel", "tiny-long", "assistant", "constant", 1000, 0.0, 1.0,
                        True, api_name="/chat")
    deadline = time.time() + 60
    while len(job.outputs()) < 1 and time.time() < deadline:
        time.sleep(0.05)
    client.predict("e2e-cancel", api_name="/stop")
    job.cancel()
    deadline = time.time() + 30
    while time.time() < deadline:
        turns = demo.service.store.session_turns("e2e-cancel")
        if len(turns) and turns.loc[0, "status"] != "running":
            break
        time.sleep(0.1)
    assert turns.loc[0, "status"] == "cancelled" and turns.loc[0, "new_tokens"] < 1000
    # the app still answers
    assert reply_text(chat(client, "hello again", "e2e-cancel", max_new=4)[0])


def test_csv_has_this_sessions_rows_only_with_formulas_escaped(app):
    _, client = app
    chat(client, "=HYPERLINK(\"http://evil\")", "e2e-csv-a", max_new=4)
    chat(client, "@SUM(A1)", "e2e-csv-a", max_new=4)
    chat(client, "another session's secret", "e2e-csv-b", max_new=4)
    out = chat(client, "+1+1", "e2e-csv-a", max_new=4)
    path = out[9]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["prompt_text"] for r in rows] == ["'=HYPERLINK(\"http://evil\")", "'@SUM(A1)", "'+1+1"]
    assert all(r["status"] == "ok" for r in rows)
    assert "secret" not in open(path).read()


def test_bad_input_through_the_api_gets_a_clear_message(app):
    from gradio_client.exceptions import AppError

    demo, client = app
    for kwargs, message in [({"message": "   "}, "empty"), ({"mode": "telepathy"}, "not in the list of choices"),
                            ({"preset": "unreachable"}, "cannot load the target"),
                            ({"max_new": 10**6}, "greater than maximum value 1024"),
                            ({"message": "x" * 40_000}, "limit is 32000")]:
        with pytest.raises(AppError, match=message):
            chat(client, **{"message": MESSAGE, "client_id": "e2e-bad", **kwargs})
    assert demo.service.store.session_turns("e2e-bad").empty
    assert reply_text(chat(client, MESSAGE, "e2e-bad", max_new=4)[0])


def test_analysis_exposes_aggregates_only(app):
    _, client = app
    chat(client, "private words", "e2e-agg", max_new=4)
    table = client.predict(api_name="/analysis")
    assert set(table["headers"]) >= {"preset", "mode", "turns", "speedup"}
    assert "private words" not in str(table)

"""What the page says about a reply: the metrics line, and why a reply was slower than plain decoding."""
from __future__ import annotations

import pandas as pd

from dynchat.app.turns import TurnUpdate
from dynchat.app.ui import (
    after_stop,
    baseline_message,
    metrics_markdown,
    plots,
    settle_thoughts,
    slower_because,
)


def test_a_slower_reply_says_why():
    short = {"speedup": 0.7, "acceptance_rate": 0.8, "new_tokens": 9, "tokens_per_s": 20, "baseline_tokens_per_s": 28}
    assert "short reply" in metrics_markdown(short)
    low = {**short, "new_tokens": 120, "acceptance_rate": 0.2}
    assert "low acceptance" in slower_because(low)
    costly = {**short, "new_tokens": 120, "acceptance_rate": 0.6}
    assert "cost more" in slower_because(costly)
    assert slower_because({**short, "speedup": 1.4}) == ""
    assert slower_because({**short, "acceptance_rate": None}) == ""     # plain decoding has nothing to explain


def test_one_turn_gives_a_point_per_series():
    turns = pd.DataFrame([{"status": "ok", "tokens_per_s": 40.0, "baseline_tokens_per_s": 25.0, "acceptance_rate": 0.7}])
    speed, acc, _, _ = plots(turns, [], [])
    assert sorted(speed["series"]) == ["baseline", "method"] and list(speed["turn"]) == ["1", "1"]
    assert list(acc["acceptance_rate"]) == [0.7]


def test_turns_are_whole_labels_in_order():
    turns = pd.DataFrame([{"status": "ok", "tokens_per_s": 40.0 + i, "baseline_tokens_per_s": 25.0,
                           "acceptance_rate": 0.7} for i in range(12)])
    speed, acc, _, _ = plots(turns, [], [])
    assert list(dict.fromkeys(speed["turn"])) == [str(i) for i in range(1, 13)]     # the axis follows data order
    assert list(acc["turn"]) == [str(i) for i in range(1, 13)]


def test_the_baseline_under_the_reply_says_how_it_ended():
    figures = {"tokens_per_s": 90.0, "baseline_tokens_per_s": 75.0, "speedup": 1.2, "acceptance_rate": 0.5}
    assert "same tokens as the baseline" in metrics_markdown({**figures, "same_tokens_as_baseline": True})
    parted = metrics_markdown({**figures, "same_tokens_as_baseline": False, "baseline_parts_at": 41})
    assert "parts from the reply at token 42" in parted
    assert "same tokens" not in metrics_markdown(figures) and "parts" not in metrics_markdown(figures)   # sampled

    running = baseline_message(TurnUpdate(reply="a", status="baseline", baseline_reply="a b"), done=False)
    assert running[0]["metadata"]["status"] == "pending" and running[0]["content"][0]["text"] == "a b"
    finished = baseline_message(TurnUpdate(reply="a", status="ok", baseline_reply="a", metrics=figures), done=True)
    assert finished[0]["metadata"] == {"title": finished[0]["metadata"]["title"], "status": "done", "log": "75.0 tokens/s"}
    stopped = baseline_message(TurnUpdate(reply="a", status="ok", baseline_reply="a b"), done=True)
    assert stopped[0]["metadata"]["log"] == "stopped"
    assert baseline_message(TurnUpdate(reply="a", status="ok"), done=True) == []          # baseline mode, or no comparison

    # Stop while the baseline ran: the line saying it is being measured does not stay
    measuring = metrics_markdown({"tokens_per_s": 90.0, "acceptance_rate": 0.5}, status="baseline")
    assert "measuring the plain baseline" in measuring
    assert "stopped before the baseline finished" in after_stop(measuring) and "measuring" not in after_stop(measuring)
    assert after_stop(metrics_markdown(figures)) == metrics_markdown(figures)      # a finished turn's line stays

    # a turn stopped before its last update left the page a spinning baseline: the next turn settles it
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, *running]
    settled = settle_thoughts(history)
    assert settled[:2] == history[:2] and settled[2]["metadata"]["status"] == "done"
    assert settled[2]["metadata"]["log"] == "stopped" and running[0]["metadata"]["status"] == "pending"


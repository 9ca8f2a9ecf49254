"""What the page says about a reply: the metrics line, and why a reply was slower than plain decoding."""
from __future__ import annotations

import pandas as pd

from dynchat.app.ui import metrics_markdown, plots, slower_because


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

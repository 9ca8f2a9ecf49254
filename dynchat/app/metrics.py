"""A turn's metrics, defined once: the session log's columns, the page's turn table and the CSV
download all derive from TURN_METRICS; the engine's Summary (engine/events.py) supplies most."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    kind: type                 # int or float; every metric may be missing (a turn cut short)
    meaning: str
    shown: bool = True         # a column of the page's session table
    averaged: bool = False     # its mean over all sessions is reported (Store.aggregates)
    from_summary: bool = True  # read from the engine's Summary.stats() (else the chat computes it)


TURN_METRICS = (
    Metric("new_tokens", int, "tokens in the reply"),
    Metric("tokens_per_s", float, "new tokens / wall seconds, prefill included", averaged=True),
    Metric("baseline_tokens_per_s", float, "plain decoding of the same target, prompt and budget",
           from_summary=False, averaged=True),
    Metric("speedup", float, "tokens_per_s / baseline_tokens_per_s", from_summary=False, averaged=True),
    Metric("acceptance_rate", float, "accepted draft tokens / proposed draft tokens", averaged=True),
    Metric("mean_accepted_length", float, "1 + accepted draft tokens / draft rounds: tokens per verify forward", averaged=True),
    Metric("ttft_s", float, "seconds to the first token"),
    Metric("target_forwards", int, "target forward passes, the prompt's included", shown=False),
    Metric("draft_tokens", int, "draft tokens proposed", shown=False),
    Metric("accepted_tokens", int, "draft tokens accepted", shown=False),
    Metric("wall_s", float, "seconds from the request to the last token", shown=False),
)
METRIC_NAMES = [m.name for m in TURN_METRICS]
SUMMARY_METRICS = [m.name for m in TURN_METRICS if m.from_summary]
AVERAGED = [m.name for m in TURN_METRICS if m.averaged]
# a verify round as the log keeps it: name -> kind
ROUND_FIELDS = {"lookahead": int, "drafted": int, "accepted": int, "new_tokens": int, "draft_s": float, "verify_s": float}
TABLE_COLUMNS = ["id", "status", "mode", "policy"] + [m.name for m in TURN_METRICS if m.shown]

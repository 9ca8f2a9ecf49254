"""The bench's summary: speedups against the baseline, and acceptance pooled as vLLM's counters pool it."""
from __future__ import annotations

import pandas as pd
import pytest

from dynchat.bench.engine import summarise


def _run(method, prompt, tps, new, rounds=0, drafted=0, accepted=0):
    return {"method": method, "prompt_id": prompt, "tokens_per_s": tps, "new_tokens": new,
            "draft_rounds": rounds, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / rounds if rounds else 1.0,
            "per_position_acceptance": [], "same_as_baseline": True}


def test_acceptance_pools_counts_so_a_short_reply_weighs_by_its_rounds():
    df = pd.DataFrame([
        _run("baseline", 0, 100.0, 96), _run("baseline", 1, 100.0, 9),
        _run("spec", 0, 200.0, 96, rounds=24, drafted=96, accepted=71),   # tau 3.96
        _run("spec", 1, 120.0, 9, rounds=4, drafted=16, accepted=4),      # tau 2.0
        {**_run("hf", 0, 80.0, 96), "draft_rounds": None, "draft_tokens": None, "accepted_tokens": None,
         "acceptance_rate": None, "mean_accepted_length": None},
        {**_run("hf", 1, 80.0, 9), "draft_rounds": None, "draft_tokens": None, "accepted_tokens": None,
         "acceptance_rate": None, "mean_accepted_length": None},
    ])
    table = summarise(df)
    spec = table.loc["spec"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + 75 / 28)      # not the mean of 3.96 and 2.0
    assert spec["acceptance_rate"] == pytest.approx(75 / 112)
    assert spec["speedup"] == pytest.approx((2.0 + 1.2) / 2)                # median over prompts of per-prompt ratios
    assert table.loc["baseline", "mean_accepted_length"] == 1.0 and table.loc["baseline", "acceptance_rate"] == 0.0
    assert pd.isna(table.loc["hf", "mean_accepted_length"]) and pd.isna(table.loc["hf", "acceptance_rate"])
    assert table.loc["hf", "speedup"] == pytest.approx(0.8)

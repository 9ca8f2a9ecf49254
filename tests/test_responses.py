"""The response generator: batched, left-padded generation equals one prompt at a time; shards round-trip."""
from __future__ import annotations

import numpy as np
import torch
from conftest import tiny_model

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.reply_shards import load_replies, read_shard, write_shard
from dynchat.train.responses import generate_batch


def test_batched_greedy_generation_equals_one_prompt_at_a_time():
    model = tiny_model("llama")
    prompts = [[1, 5, 9], [1, 7, 3, 8, 22, 40, 11], [1, 60], [1, 30, 31, 32, 33]]
    got = generate_batch(model, prompts, 12, 0.0, [2], torch.Generator().manual_seed(0))
    for p, g in zip(prompts, got):
        want, _ = run(Decoder(model, eos_token_ids=[2]), p, 12)
        assert g == want


def test_shards_round_trip_and_filter_by_temperature(tmp_path):
    write_shard(tmp_path / "shard-s1-t0-000.npz", [0, 1], [[5, 6, 7], [8]], 0.0, 1.5)
    write_shard(tmp_path / "shard-s1-t0.7-000.npz", [1], [[70000, 3]], 0.7, 0.5)   # past uint16: int32
    index, replies, t = read_shard(tmp_path / "shard-s1-t0-000.npz")
    assert index == [0, 1] and [r.tolist() for r in replies] == [[5, 6, 7], [8]] and t == 0.0
    assert [r.tolist() for r in load_replies(tmp_path, 0.7)] == [[70000, 3]]
    assert len(load_replies(tmp_path)) == 3
    assert not list(tmp_path.glob("*.tmp"))
    assert np.load(tmp_path / "shard-s1-t0-000.npz")["tokens"].dtype == np.uint16


def test_everyday_prompts_open_as_people_type_and_resume_from_their_parts(tmp_path):
    """Stage 3: the target completes everyday openings into user turns; the prompts are unique, never a
    bench prompt, and a rerun rebuilds the same list from the parts on disk without generating again."""
    from pathlib import Path

    from conftest import ROOT

    from dynchat.train.responses import OPENINGS, ResponseBuilder, ResponsePlan

    plan = ResponsePlan(everyday_prompts=6, batch_size=8)
    builder = ResponseBuilder(Path(ROOT / "data" / "models" / "demo-target"), tmp_path, plan)
    builder.everyday_prompts()
    texts = [chat[0]["content"] for chat in builder.prompts(3)]
    assert len(texts) == 6 == len(set(texts))
    assert all(any(t.startswith(o) for o in OPENINGS) for t in texts)
    first = (tmp_path / "prompts-3.jsonl").read_text()
    parts = {p: p.stat().st_mtime_ns for p in tmp_path.glob("everyday-*.json")}
    (tmp_path / "prompts-3.jsonl").unlink()
    again = ResponseBuilder(Path(ROOT / "data" / "models" / "demo-target"), tmp_path,
                            ResponsePlan(everyday_prompts=6, batch_size=8, exclude=(texts[0],)))
    again.everyday_prompts()
    assert {p: p.stat().st_mtime_ns for p in parts} == parts          # read back, not generated again
    assert texts[0] not in [c[0]["content"] for c in again.prompts(3)]  # an excluded prompt never comes back
    assert first != (tmp_path / "prompts-3.jsonl").read_text()

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


def test_a_grown_corpus_keeps_every_response_on_disk_and_only_adds_shards(tmp_path):
    """More everyday prompts extend the list (old indices keep their prompts); responses and sampled
    picks already on disk are kept, and only the new ones are generated, in new shards."""
    from pathlib import Path

    from conftest import ROOT

    from dynchat.train.responses import ResponseBuilder, ResponsePlan

    target = Path(ROOT / "data" / "models" / "demo-target")
    small = dict(batch_size=8, shard_size=4, max_new_tokens=6, sampled=3)
    first = ResponseBuilder(target, tmp_path, ResponsePlan(everyday_prompts=6, **small))
    first.everyday_prompts()
    first.respond(3, 0.0, list(range(6)))
    picked = first.sampled_picks({3: 6})
    first.respond(3, 0.7, picked[3])
    before = {p.name: (p.stat().st_mtime_ns, read_shard(p)[0]) for p in tmp_path.glob("shard-*.npz")}
    old_prompts = first.prompts(3)

    grown = ResponseBuilder(target, tmp_path, ResponsePlan(everyday_prompts=10, **{**small, "sampled": 5}))
    grown.everyday_prompts()
    assert grown.prompts(3)[:6] == old_prompts and len(grown.prompts(3)) == 10
    grown.respond(3, 0.0, list(range(10)))
    picks = grown.sampled_picks({3: 10})
    assert set(picked[3]) <= set(picks[3]) and len(picks[3]) == 5
    grown.respond(3, 0.7, picks[3])
    after = {p.name: (p.stat().st_mtime_ns, read_shard(p)[0]) for p in tmp_path.glob("shard-*.npz")}
    assert all(after[name] == was for name, was in before.items())           # nothing on disk rewritten
    greedy = sorted(i for name, (_, index) in after.items() if "-t0-" in name for i in index)
    sampled = sorted(i for name, (_, index) in after.items() if "-t0.7-" in name for i in index)
    assert greedy == list(range(10)) and sampled == sorted(picks[3])        # each prompt once, none lost


def test_nucleus_sampling_draws_the_exact_nucleus_also_when_it_is_wider_than_the_head():
    from dynchat.train.chat_data import sample_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.tensor([4.0, 3.0, 2.5, 1.0, 0.5, 0.0, -1.0, -2.0]),   # nucleus within 4
                          torch.zeros(8)])                                          # flat: all 8 kept
    draws = torch.stack([sample_tokens(logits, 1.0, 0.9, gen, head=4) for _ in range(6000)])
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p * ((sorted_p.cumsum(-1) - sorted_p) <= 0.9))
    want = kept / kept.sum(-1, keepdim=True)
    for row in range(2):
        seen = torch.bincount(draws[:, row], minlength=8).float() / len(draws)
        assert (seen - want[row]).abs().max() < 0.025
        assert seen[want[row] == 0].sum() == 0                                  # nothing outside the nucleus

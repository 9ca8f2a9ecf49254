"""The fixed-shape forward CUDA graphs capture (engine/graphs.py), run eagerly on the CPU: it computes
what the dynamic forward computes (steps, chain verifies, tree verifies, EAGLE-3 features, across
attention buckets, after rollbacks), and decoding through it stays lossless."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_config, tiny_model

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.eagle_drafter import Eagle3Drafter, TreeShape
from dynchat.engine.graphs import graphs_wanted
from dynchat.engine.lean import LeanLM
from dynchat.engine.policies import Constant, make_policy

PROMPT = [1, 17, 5, 42, 9, 33, 8]
TOL = dict(rtol=1e-4, atol=1e-4)     # other sums over masked slots: last bits differ


def _pair(model):
    dynamic, static = LeanLM(model, linear="plain"), LeanLM(model, linear="plain")
    static.use_static_steps(True, capture=False)
    assert dynamic.static is None and static.static is not None
    return dynamic, static


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_static_steps_compute_what_the_dynamic_forward_does(arch):
    model = tiny_model(arch)
    dynamic, static = _pair(model)
    for lm in (dynamic, static):
        lm.capture([0, 1])                                     # EAGLE-3 features ride along
    g = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    calls = [dict(ids=torch.tensor(PROMPT)), dict(ids=torch.tensor([3])), dict(ids=torch.tensor([4, 5, 6, 7, 8])),
             dict(rollback=9), dict(ids=torch.tensor([2]), last_only=True),
             dict(ids=torch.tensor([11, 12, 13, 14]), positions=10 + torch.tensor([0, 1, 1, 2]), tree_mask=tree)]
    for call in calls:
        if "rollback" in call:
            for lm in (dynamic, static):
                lm.rollback(call["rollback"])
            continue
        torch.testing.assert_close(static.forward(**call), dynamic.forward(**call), **TOL)
        assert static.length == dynamic.length
        torch.testing.assert_close(static.features[:static.length], dynamic.features[:dynamic.length], **TOL)
    # past the first attention bucket (256 slots): the bucket doubles, the cache was allocated once
    model.config.max_position_embeddings = 1024
    dynamic, static = _pair(model)
    first = static.forward(torch.randint(0, 96, (250,), generator=g))
    torch.testing.assert_close(first, dynamic.forward(torch.randint(0, 96, (250,), generator=g.manual_seed(0))), **TOL)
    keys = static.cache.k.data_ptr()
    for _ in range(4):
        ids = torch.randint(0, 96, (3,), generator=g)
        torch.testing.assert_close(static.forward(ids), dynamic.forward(ids), **TOL)
    assert static.length == 262 and static.cache.k.data_ptr() == keys and static.cache.capacity == 1024


def test_decoding_through_static_steps_stays_lossless(monkeypatch):
    monkeypatch.setenv("DYNCHAT_LINEAR", "plain")
    target = tiny_model("llama", layers=7)
    from test_eagle3 import random_head

    ref, _ = run(Decoder(target), PROMPT, 50)
    for tree in (None, TreeShape(3, 2, 5)):
        decoder = Decoder(target, Eagle3Drafter(random_head(target), target, tree))
        decoder.target.use_static_steps(True, capture=False)
        for policy in (Constant(3), make_policy("dynamic", 4)):
            out, summary = run(decoder, PROMPT, 50, policy=policy)
            assert out == ref and summary.target_forwards < 51
    plain = Decoder(target)
    plain.target.use_static_steps(True, capture=False)
    assert run(plain, PROMPT, 50)[0] == ref


def test_graphs_are_for_cuda_only_and_can_be_turned_off(monkeypatch):
    assert not graphs_wanted(torch.device("cpu"))
    assert graphs_wanted(torch.device("cuda"))
    monkeypatch.setenv("DYNCHAT_CUDA_GRAPHS", "0")
    assert not graphs_wanted(torch.device("cuda"))
    lm = LeanLM(tiny_model("llama"), linear="plain")
    assert lm.static is None                                 # a CPU model keeps the dynamic forward
    assert tiny_config("llama").max_position_embeddings == 256

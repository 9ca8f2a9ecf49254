"""Host reads per round, bounded as an accelerator needs them (counted on the CPU with `HostReads`):
plain decoding reads once per token; a chain round twice at most (the accepted tokens, and the
draft's confidences once) whatever its length; reading once changes no output."""
from __future__ import annotations

import json

import pytest
from conftest import ROOT, HostReads

from dynchat.engine.decoder import run
from dynchat.engine.policies import make_policy
from dynchat.presets.config import get_preset
from dynchat.presets.loading import load_engine

# two bench prompts the demo target answers at length (96 tokens, the cap)
PROMPTS = [json.loads(line)["prompt"] for line in (ROOT / "data" / "bench_prompts.jsonl").read_text().splitlines()
           if 'There are two subtleties' in line or 'import urllib.request' in line]


@pytest.fixture(scope="module")
def engine():
    return load_engine(get_preset("demo"))


def _decode(engine, mode, policy, read_once, prompt, lookup=True):
    decoder = engine.decoder(mode, tree=None, lookup=lookup) if mode != "baseline" else engine.decoder("baseline")
    drafter = getattr(decoder.drafter, "model", decoder.drafter)        # inside lookup's wrapper
    if drafter is not None:
        drafter.read_once = read_once
    ids = engine.encode(prompt)
    with HostReads() as reads:
        out, summary = run(decoder, ids, 96, policy=make_policy(policy, 4) if policy else None)
    return out, summary, reads


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_decoding_reads_once_per_token(engine, prompt):
    out, summary, reads = _decode(engine, "baseline", None, False, prompt)
    assert len(PROMPTS) == 2 and summary.new_tokens > 60
    assert reads.total <= summary.new_tokens, reads.by_caller


@pytest.mark.parametrize("mode", ["assistant", "eagle3"])
@pytest.mark.parametrize("policy", ["constant", "dynamic", "throughput"])
def test_a_chain_round_reads_twice_at_most_and_reading_once_changes_nothing(engine, mode, policy):
    for prompt in PROMPTS:
        base, _, _ = _decode(engine, "baseline", None, False, prompt)
        out, summary, reads = _decode(engine, mode, policy, True, prompt)
        assert out == base                                          # lossless
        rounds = summary.target_forwards                            # the prefill and one per round
        assert summary.draft_tokens > 0
        assert reads.total <= 2 * rounds + 1, reads.by_caller      # + the prompt, read once for lookup
        if policy != "throughput":        # it plans its length where reads cost: the rest cut the same chains
            # (the model alone: whether lookup takes a round depends on measured costs)
            runs = [_decode(engine, mode, policy, once, prompt, lookup=False)[1] for once in (False, True)]
            assert len({(s.draft_tokens, s.accepted_tokens, s.target_forwards) for s in runs}) == 1


def test_a_tree_round_reads_the_host_at_most_three_times(engine):
    """The draft tree is built with tensor ops; the round reads its tokens, parents and depths once,
    and the target's choices once."""
    from dynchat.engine.eagle_drafter import TreeShape

    for prompt in PROMPTS:
        base, _, _ = _decode(engine, "baseline", None, False, prompt)
        decoder = engine.decoder("eagle3", tree=TreeShape(4, 5, 16), lookup=False)
        with HostReads() as reads:
            out, summary = run(decoder, engine.encode(prompt), 96, policy=make_policy("constant", 5))
        assert out == base and summary.accepted_tokens > 0
        assert reads.total <= 3 * summary.target_forwards, reads.by_caller

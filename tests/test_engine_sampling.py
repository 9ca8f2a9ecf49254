"""Speculative sampling preserves the target's distribution (chi-square over seeded draws)."""
from __future__ import annotations

import pytest
import torch
from conftest import ALPHA, chi2_pvalue, exact_marginals, small_vocab_pair

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.drafters import DraftModelDrafter
from dynchat.engine.policies import make_policy
from dynchat.engine.sampling import Sampler, SamplingParams


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9, top_k=6)])
def test_verify_first_token_follows_target(params):
    torch.manual_seed(0)
    V, k = 10, 3
    target_logits = torch.randn(k + 1, V) * 1.5
    draft_logits = torch.randn(k, V) * 1.5
    sampler = Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed=123), torch.device("cpu"))
    p, q = sampler.probs(target_logits), sampler.probs(draft_logits)
    firsts, accepted = [], 0
    for _ in range(12000):
        drafts = torch.multinomial(q, 1, generator=sampler.generator).squeeze(-1)
        judged = sampler.judge(drafts, q, target_logits)             # [accepted, the k+1 tokens]
        n = int(judged[0])
        tok = judged[1 + n]
        firsts.append(int(drafts[0]) if n > 0 else int(tok))
        accepted += n > 0
    assert 0.1 < accepted / 12000 < 0.95          # both branches exercised
    assert chi2_pvalue(firsts, p[0].numpy()) > ALPHA


def test_verify_rejects_a_biased_sampler():
    """The statistical check has power: sampling from the draft alone is detected."""
    torch.manual_seed(0)
    V = 10
    p = torch.softmax(torch.randn(V) * 1.5, -1)
    q = torch.softmax(torch.randn(V) * 1.5, -1)
    g = torch.Generator().manual_seed(1)
    draws = torch.multinomial(q, 12000, replacement=True, generator=g).tolist()
    assert chi2_pvalue(draws, p.numpy()) < ALPHA


@pytest.mark.slow                    # statistical: ~1,500 seeded generations
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.95, top_k=8)])
def test_speculative_sampling_end_to_end_matches_target(params):
    target, draft = small_vocab_pair()
    prompt = [1, 4, 7]
    expected = exact_marginals(target, prompt, params, depth=3)
    dec = Decoder(target, DraftModelDrafter(draft, 12))
    policy = make_policy("constant", 3)
    draws, acc, drafted = [], 0, 0
    for i in range(1500):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=1000 + i)
        ids, s = run(dec, prompt, 4, p, policy)   # prefill token, then one round drafting 2
        draws.append(ids)
        acc, drafted = acc + s.accepted_tokens, drafted + s.draft_tokens
    assert 0.15 < acc / drafted < 0.95
    for pos in (1, 2):                      # positions decided by drafts and rejection sampling
        assert chi2_pvalue([d[pos] for d in draws], expected[pos]) > ALPHA, f"position {pos + 1}"


def test_seeded_runs_are_reproducible():
    target, draft = small_vocab_pair()
    dec = Decoder(target, DraftModelDrafter(draft, 12))
    runs = [run(dec, [1, 4, 7], 30, SamplingParams(1.0, seed=s), make_policy("dynamic"))[0] for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    base = Decoder(target)
    assert run(base, [1, 4, 7], 30, SamplingParams(1.0, seed=5))[0] == run(base, [1, 4, 7], 30, SamplingParams(1.0, seed=5))[0]


def test_invalid_sampling_settings_are_refused():
    for kwargs, msg in [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top-p"),
                        ({"top_p": 1.5}, "top-p"), ({"top_k": -1}, "top-k")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kwargs)

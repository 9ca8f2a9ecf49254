"""Speculative sampling preserves the target's distribution (chi-square over seeded draws)."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from conftest import ALPHA, chi2_pvalue, exact_marginals, small_vocab_pair

from dynchat.engine import sampling
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


def test_a_sampled_token_follows_each_row_s_distribution_and_never_a_cut_token():
    """The sampler's draws (inverse CDF at one uniform a row) follow each row's probabilities, unnormalised
    ones too, rows independently; a token cut to 0 (top-k, top-p) is never drawn, whatever the row's size."""
    sampler = Sampler(SamplingParams(1.0, seed=7), torch.device("cpu"))
    rows = torch.tensor([[0.0, 0.2, 0.0, 1.2, 0.6, 0.0],          # sums to 2: unnormalised
                         [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]])
    draws = torch.stack([sampler.sample(rows) for _ in range(12000)])        # (12000, 2)
    for r in range(2):
        assert chi2_pvalue(draws[:, r].tolist(), (rows[r] / rows[r].sum()).numpy()) > ALPHA
        assert (rows[r][draws[:, r]] > 0).all()
    wide = torch.zeros(1, 49152)
    wide[0, [0, 49151]] = 1e-3                                     # only the first and last token possible
    picked = {int(sampler.sample(wide)) for _ in range(400)}
    assert picked == {0, 49151}


def test_the_native_draw_is_the_inverse_cdf_pytorch_s_search_gives():
    """sampling.c's draw takes, for each row and uniform u in (0, 1], the first token whose cumulative sum
    reaches u times the row's sum, as PyTorch's float64 cumulative sum and search do (the fallback's way):
    the same token on rows with cut (zero) tokens, unnormalised rows and tiny vocabularies; at u = 1 the
    last token with a probability, never a zero one after it."""
    from dynchat.engine.native import draw, library

    if library() is None:
        pytest.skip("no native library here")
    gen = torch.Generator().manual_seed(5)
    for V in (3, 10, 70, 49152):
        probs = torch.rand(64, V, generator=gen) * (torch.rand(64, V, generator=gen) < 0.5)
        probs[:, 0] += 1e-3 * (torch.arange(64) % 2)                # some rows' first token possible
        probs[:, -1] = 0.0                                          # the last never
        probs[probs.sum(-1) == 0, V // 2] = 1.0
        u = 1.0 - torch.rand(64, dtype=torch.float64, generator=gen)
        u[:4] = 1.0
        cdf = probs.double().cumsum(-1)
        expected = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:])).squeeze(-1)
        got = draw(probs, u)
        assert torch.equal(got, expected), V
        assert (probs[torch.arange(64), got] > 0).all()


def test_sampling_from_threads_that_come_and_go_holds_no_memory_per_thread():
    """A server's worker threads come and go: the native warp's per-thread buffers (a 49,152-token row and its
    nucleus's candidates, ~0.6 MB) are freed with their thread (they were not: 300 threads kept ~117 MB)."""
    import os
    import threading

    from dynchat.engine.native import library

    if library() is None or not os.path.exists("/proc/self/statm"):
        pytest.skip("no native library here, or no /proc to read the memory held from")

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(2)) * 3

    def work():
        Sampler(SamplingParams(1.0, top_p=0.99, seed=0), torch.device("cpu")).pick(logits)

    work()
    before = rss_mb()
    for _ in range(300):
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert rss_mb() - before < 40


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.0, top_p=0.9), SamplingParams(1.3, top_p=0.5),
                                    SamplingParams(0.8, top_p=0.95, top_k=40)])
def test_a_sampled_step_s_token_is_the_draw_from_the_warped_row(params):
    """pick (a plain sampled step: on a CPU warp and draw in one native call) gives the token that warping
    (probs) and then drawing (sample) give from the same generator state, and leaves the generator alike."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 49152, generator=gen) * torch.tensor([[6.0], [2.0], [0.5]])
    for seed in range(40):
        a, b = (Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed), torch.device("cpu"))
                for _ in range(2))
        assert torch.equal(a.pick(logits), b.sample(b.probs(logits))), seed
        assert torch.equal(a.generator.get_state(), b.generator.get_state())


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.0, top_p=0.9), SamplingParams(0.7, top_k=50),
                                    SamplingParams(0.8, top_p=0.95, top_k=40), SamplingParams(1.3, top_p=0.5)])
def test_the_warped_distribution_is_transformers_own(params, monkeypatch):
    """Temperature, top-k and top-p mean what Transformers' generate(do_sample=True) means by them: the same
    tokens kept and the same probabilities, on peaked and flat rows of a 49,152-token vocabulary (a flat
    row's nucleus holds thousands of tokens, a peaked one's a few), of 1,003 tokens (rows that end in a
    partial vector) and of 5; in each of the three ways a row is warped: sampling.c's (a CPU with the
    library, no top-k), PyTorch's ranking only the nucleus's candidates (other CPUs) and PyTorch's
    sorting whole rows (accelerators). sampling.c's exponential gives 0 to the tokens float32 holds only
    as subnormal numbers (below 2^-126 of the row's largest), where PyTorch's softmax keeps a subnormal:
    those aside, the same tokens."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(3)
    warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
    warpers += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    warpers += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
    for V in (49152, 1003, 5):
        logits = torch.randn(6, V, generator=gen) * torch.tensor([[8.0], [4.0], [2.0], [1.0], [0.3], [0.05]])
        theirs = torch.softmax(LogitsProcessorList(warpers)(None, logits.clone()), -1)
        normal = theirs >= torch.finfo(torch.float32).tiny
        ours = Sampler(params, torch.device("cpu")).probs(logits)
        assert torch.equal(ours[normal] > 0, theirs[normal] > 0) and (ours[~normal] <= theirs[~normal]).all(), V
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        with monkeypatch.context() as patched:
            patched.setattr(sampling, "warp", lambda *args: None)          # PyTorch's ways
            ranked = Sampler(params, torch.device("cpu"))
            whole = Sampler(params, torch.device("cpu"))           # an accelerator's way: every row sorted whole
            whole._nucleus = functools.partial(Sampler._nucleus, whole, whole=True)
            for way in (ranked, whole):
                assert torch.equal(way.probs(logits) > 0, theirs > 0)
                torch.testing.assert_close(way.probs(logits), theirs, rtol=1e-5, atol=1e-7)
        if V == 49152 and params.top_p < 1.0 and not params.top_k:
            kept = (ours > 0).sum(-1)
            assert kept.min() < 10 and kept.max() > 1000


def test_a_row_without_a_distribution_or_a_draft_that_is_no_token_is_refused():
    """A logits row with a NaN, or whose largest logit is not finite, has no distribution: sampling it says
    so (ValueError) instead of drawing token 0; a drafted token outside the vocabulary is an IndexError, as
    PyTorch's indexing gives it, not a read past the row (sampling.c: a crash)."""
    from dynchat.engine.native import library

    sampler = Sampler(SamplingParams(0.7, top_p=0.9, seed=0), torch.device("cpu"))
    logits = torch.randn(3, 1003, generator=torch.Generator().manual_seed(1))
    with pytest.raises(IndexError):
        sampler.judge(torch.tensor([1003, 5]), None, logits)
    with pytest.raises(IndexError):
        sampler.judge(torch.tensor([10**9, 5]), None, logits)
    if library() is None:
        pytest.skip("no native library here: PyTorch's warp has no such check")
    for bad in (float("nan"), float("inf"), float("-inf")):
        row = logits[:1].clone()
        row[0, 1001 if bad != bad else 0] = bad            # a NaN in the row's last partial vector
        if bad == float("-inf"):
            row[:] = bad
        with pytest.raises(ValueError, match="no distribution"):
            sampler.pick(row)
        with pytest.raises(ValueError, match="no distribution"):
            sampler.probs(row)


def test_a_top_p_below_any_token_s_share_keeps_the_most_likely_token():
    """top_p tinier than a near-uniform row's every probability: the row's most likely token alone stays
    (Transformers keeps at least one), not an empty row whose draw would name no token."""
    logits = torch.zeros(2, 49152)
    logits[0, 123] = 1e-3
    logits[1, 49151] = 1e-3
    sampler = Sampler(SamplingParams(1.0, top_p=1e-9, seed=1), torch.device("cpu"))
    probs = sampler.probs(logits)
    assert not probs.isnan().any() and probs[0, 123] == 1.0 and probs[1, 49151] == 1.0
    assert sampler.sample(probs).tolist() == [123, 49151]


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9),
                                    SamplingParams(0.8, top_p=0.95, top_k=8)])
def test_the_walked_verification_gives_the_all_rows_one_s_tokens(params):
    """On a CPU, judge warps the target's rows one at a time and stops at the first rejection (walk); it
    must give what warping every row at once gives (judge_rows, an accelerator's path, which the
    statistical tests check through judge only on a device): the same accepted count and tokens from
    the same seed, with and without draft distributions, and leave the generator in the same state; on a
    tiny vocabulary and on one whose rows fill vectors and a tail (sampling.c's walk without top-k, the
    Python walk with it)."""
    torch.manual_seed(0)
    cases, rejected_somewhere, all_accepted = 0, 0, 0
    for (V, scale), k in itertools.product(((10, 1.5), (1003, 4.0)), (1, 2, 4)):
        for case in range(30):
            target_logits = torch.randn(k + 1, V) * scale
            q = Sampler(params, torch.device("cpu")).probs(torch.randn(k, V) * scale) if case % 2 else None
            source = q if q is not None else Sampler(params, torch.device("cpu")).probs(target_logits)[:k]
            drafts = torch.multinomial(source, 1).squeeze(-1)
            for seed in range(4):
                a, b = (Sampler(SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed),
                                torch.device("cpu")) for _ in range(2))
                walked, rows = a.walk(drafts, q, target_logits), b.judge_rows(drafts, q, target_logits)
                n = int(rows[0])
                assert int(walked[0]) == n and torch.equal(walked[1:n + 2], rows[1:n + 2]), (k, case, seed)
                assert torch.equal(a.generator.get_state(), b.generator.get_state())
                cases += 1
                rejected_somewhere += n < k
                all_accepted += n == k
    assert rejected_somewhere > cases // 10 and all_accepted > cases // 10      # both ends exercised


def test_a_rejection_where_the_correction_has_no_mass_draws_from_the_target_s_row():
    """Where the draft's distribution equals the target's but for a rounding at the drafted token, a rejection
    (u = 1) leaves max(0, p - q) all 0: the target's token is drawn from p itself (never token 0 from an
    empty row), in sampling.c's walk as in PyTorch's correction."""
    from dynchat.engine.native import library
    from dynchat.engine.native import walk as native_walk

    if library() is None:
        pytest.skip("no native library here")
    params = SamplingParams(0.9, top_p=0.95)
    logits = torch.randn(2, 1003, generator=torch.Generator().manual_seed(4)) * 2
    p = Sampler(params, torch.device("cpu")).probs(logits[:1])
    tok = int(p[0].argmax())
    q = p.clone()
    q[0, tok] = torch.nextafter(p[0, tok], torch.tensor(2.0))
    for seed in range(20):
        walked = native_walk(logits, torch.tensor([tok]), q, torch.ones(1), params.temperature, params.top_p,
                             torch.Generator().manual_seed(seed))
        reference = Sampler(params, torch.device("cpu"))
        reference.generator.manual_seed(seed)
        drawn = reference.sample(Sampler._correction(p[0], q[0], torch.tensor([tok]))[None])
        assert walked == (0, int(drawn)) and p[0, walked[1]] > 0


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
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.95, top_k=8),
                                    SamplingParams(0.8, top_p=0.9)])
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


@pytest.mark.slow                    # statistical: ~1,500 seeded generations
def test_a_draft_with_its_own_vocabulary_samples_there_and_keeps_the_target_s_distribution():
    """A draft proposing from part of the vocabulary (SmolLM2's assistant: 4,096 of 49,152 tokens) samples
    over its own tokens, and its distributions are spread over the target's (0 elsewhere) for the
    verify: every drafted token is one of its own, each row sums to 1, and the output follows the target."""
    target, draft = small_vocab_pair()
    v = target.config.vocab_size
    draft.draft_vocab_ids = torch.tensor([0, 2, 3, 4, 6, 7, 9, 11])[: v - 4]
    drafter = DraftModelDrafter(draft, v)
    assert drafter._target_ids is not None                 # the narrow path
    params = SamplingParams(0.9, top_p=0.95)
    committed = torch.tensor([1, 4, 7])
    drafter.reset()
    proposal = drafter.propose(committed, 3, make_policy("constant", 3), Sampler(params, torch.device("cpu")))
    own = set(draft.draft_vocab_ids.tolist())
    assert set(proposal.tokens.tolist()) <= own and proposal.probs.shape == (3, v)
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(3)) and (proposal.probs[:, sorted(set(range(v)) - own)] == 0).all()
    expected = exact_marginals(target, [1, 4, 7], params, depth=3)
    dec, draws, acc = Decoder(target, drafter), [], 0
    for i in range(1500):
        ids, s = run(dec, [1, 4, 7], 4, SamplingParams(0.9, top_p=0.95, seed=3000 + i), make_policy("constant", 3))
        draws.append(ids)
        acc += s.accepted_tokens
    assert acc > 200, "drafts must get accepted for the test to mean anything"
    for pos in (1, 2):
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

"""Lookahead policies against a simulated drafter and target whose costs and acceptance are known."""
from __future__ import annotations

import random

import pytest

from dynchat.engine.policies import make_policy


def simulate(policy, rounds: int, alpha: float, draft_fixed: float, draft_per_token: float,
             verify_fixed: float = 0.011, verify_per_token: float = 0.0005, seed: int = 0, verify=None) -> list[int]:
    """Drafts per round. Each draft token is accepted with probability alpha (and reports confidence
    alpha, so it is calibrated); a round costs draft_fixed + draft_per_token * j to draft j tokens,
    as an EAGLE-3 head's catch-up makes it, and verify_fixed + verify_per_token * (j + 1) to verify
    (or verify(j), seconds, where given)."""
    rng = random.Random(seed)
    drafted_per_round = []
    for _ in range(rounds):
        cap = policy.max_lookahead()
        j, confidences = 0, []
        while j < cap:
            j += 1
            confidences.append(alpha)
            if not policy.keep_drafting(j, alpha):
                break
        accepted = 0
        while accepted < j and rng.random() < alpha:
            accepted += 1
        draft_s = draft_fixed + draft_per_token * j if j else 0.0
        verify_s = verify(j) if verify else verify_fixed + verify_per_token * (j + 1)
        policy.end_round(j, accepted, confidences, draft_s, verify_s)
        drafted_per_round.append(j)
    return drafted_per_round


def best_lookahead(alpha, draft_fixed, draft_per_token, verify_fixed=0.011, verify_per_token=0.0005, cap=20):
    def rate(j):
        expected = sum(alpha ** i for i in range(j + 1))
        return expected / ((draft_fixed + draft_per_token * j if j else 0.0) + verify_fixed + verify_per_token * (j + 1))
    return max(range(cap + 1), key=rate)


def test_throughput_drafts_near_the_best_lookahead_despite_a_fixed_draft_cost():
    # the demo's EAGLE-3 round on this CPU: ~2 ms catch-up, ~1.2 ms per head step, 11 ms verify
    best = best_lookahead(0.75, 0.002, 0.0012)
    assert best >= 3
    drafted = simulate(make_policy("throughput"), 300, 0.75, 0.002, 0.0012)
    late = [j for j in drafted[100:] if j]           # the rounds it drafted (every 16th is a plain probe)
    assert abs(sum(late) / len(late) - best) <= 1.0, (best, sum(late) / len(late))
    assert len(late) >= 0.9 * 200


def test_throughput_stops_drafting_where_it_cannot_pay():
    assert best_lookahead(0.3, 0.030, 0.010) == 0
    drafted = simulate(make_policy("throughput"), 200, 0.3, 0.030, 0.010)
    late = drafted[50:]
    assert sum(j > 0 for j in late) / len(late) <= 0.2      # only the occasional exploring round


# a float32 CPU verify (SmolLM2 on the Q4_1 blocks, 2 cores): each extra token +20% of a step
CONVEX_MS = {1: 11.0, 2: 13.2, 3: 15.4, 5: 19.8, 9: 30.0}


def convex_verify(j: int) -> float:
    from dynchat.engine.forward import VerifyCosts

    return VerifyCosts(CONVEX_MS).ms(j + 1) / 1000


def test_throughput_drafts_near_the_best_lookahead_on_a_convex_verify_curve():
    """A CPU's float32 verify costs +20% a token: the policy stays near the length that pays."""
    alpha, draft = 0.7, 0.0006

    def rate(j):
        return sum(alpha ** i for i in range(j + 1)) / ((draft * j) + convex_verify(j))

    best = max(range(21), key=rate)
    assert best == 2
    policy = make_policy("throughput", verify_ms=CONVEX_MS)
    late = [j for j in simulate(policy, 300, alpha, 0.0, draft, verify=convex_verify)[100:] if j]
    assert abs(sum(late) / len(late) - best) <= 1.0, (best, sum(late) / len(late))


def test_throughput_decodes_plainly_where_drafting_measures_slower():
    """A cost the model cannot see (here: drafted rounds' verifies 40% dearer, as a draft's catch-up
    or rollback would make them) shows in the measured tokens per second: the policy stops
    drafting, but for the exploring rounds. Without it, the same policy keeps drafting."""
    alpha, draft = 0.6, 0.0008

    def hidden(j: int) -> float:
        return convex_verify(j) * (1.4 if j else 1.0)

    honest = simulate(make_policy("throughput", verify_ms=CONVEX_MS), 300, alpha, 0.0, draft, verify=convex_verify)
    assert sum(j > 0 for j in honest[100:]) >= 0.85 * 200
    fooled = simulate(make_policy("throughput", verify_ms=CONVEX_MS), 300, alpha, 0.0, draft, verify=hidden)
    assert sum(j > 0 for j in fooled[100:]) <= 0.2 * 200


def test_throughput_explores_ever_more_rarely_where_drafting_keeps_not_paying():
    """Each exploring round of a draft that does not pay loses time (an assistant's also reads the
    conversation since its last round): once the acceptance is known, they grow rare."""
    drafted = simulate(make_policy("throughput", verify_ms=CONVEX_MS), 600, 0.3, 0.004, 0.004, verify=convex_verify)
    assert 0 < sum(j > 0 for j in drafted[:100]) <= 15          # exploring every 8th round at first
    assert sum(j > 0 for j in drafted[300:]) <= 3               # then every 64th, 128th, 256th


def test_throughput_drafts_longer_when_acceptance_is_higher():
    low = simulate(make_policy("throughput"), 200, 0.6, 0.002, 0.0012)[80:]
    high = simulate(make_policy("throughput"), 200, 0.9, 0.002, 0.0012)[80:]
    assert best_lookahead(0.9, 0.002, 0.0012) > best_lookahead(0.6, 0.002, 0.0012)
    assert sum(high) / len(high) > sum(low) / len(low) + 1


def test_constant_drafts_k_every_round():
    assert set(simulate(make_policy("constant", 3), 50, 0.6, 0.001, 0.001)) == {3}


def test_heuristic_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    from dynchat.engine.policies import Heuristic

    policy = Heuristic(k=5)
    policy.end_round(5, 5, [], 0.0, 0.0)
    assert policy.max_lookahead() == 7
    policy.end_round(7, 2, [], 0.0, 0.0)
    assert policy.max_lookahead() == 6
    for _ in range(10):
        policy.end_round(6, 0, [], 0.0, 0.0)
    assert policy.max_lookahead() == 1                  # never below one token
    assert all(k >= 1 for k in simulate(Heuristic(k=2), 200, 0.3, 0.001, 0.001))
    assert max(simulate(Heuristic(k=2), 100, 0.999, 0.001, 0.001)) > 20     # always accepted: keeps growing


def test_dynamic_stops_at_the_first_token_below_its_threshold():
    policy = make_policy("dynamic", 10)
    assert policy.max_lookahead() == 10 and policy.needs_confidence
    assert policy.keep_drafting(1, 0.9) and policy.keep_drafting(2, 0.4) and not policy.keep_drafting(3, 0.39)
    assert simulate(make_policy("dynamic", 10), 20, 0.3, 0.001, 0.001) == [1] * 20      # 0.3 < 0.4: one token
    assert simulate(make_policy("dynamic", 10), 20, 0.8, 0.001, 0.001) == [10] * 20


def test_roc_threshold_separates_accepted_from_rejected_confidences():
    from dynchat.engine.policies import roc_threshold

    assert roc_threshold([0.9, 0.8, 0.7, 0.3, 0.2, 0.1], [1, 1, 1, 0, 0, 0]) == 0.7
    assert roc_threshold([0.9, 0.8], [1, 1]) is None                 # no rejection seen: no threshold
    # missing an accepted token costs three false alarms: the threshold leans low
    assert roc_threshold([0.9, 0.6, 0.5, 0.4, 0.35, 0.3], [1, 0, 0, 0, 1, 0]) == 0.35


def test_adaptive_learns_a_threshold_from_what_was_accepted():
    from dynchat.engine.policies import Adaptive

    policy = Adaptive(max_tokens=8, threshold=0.4)
    rng = random.Random(0)
    for _ in range(200):        # drafts accepted when their confidence is above 0.7, not below
        confidences = [rng.random() for _ in range(4)]
        accepted = next((i for i, c in enumerate(confidences) if c < 0.7), 4)
        policy.end_round(4, accepted, confidences, 0.0, 0.0)
    assert 0.6 <= policy.threshold <= 0.75
    assert policy.keep_drafting(1, 0.8) and not policy.keep_drafting(1, 0.5)


def test_cost_samples_keep_the_least_squares_line_of_their_last_samples():
    """The policy's running sums give the line a fresh fit of the window gives, as samples come and go."""
    import numpy as np

    from dynchat.engine.policies import CostSamples

    rng = random.Random(3)
    samples = CostSamples(size=16)
    assert samples.line(3) is None
    seen = []
    for i in range(200):
        x = rng.choice([1, 2, 3, 5, 8]) if i > 40 else rng.choice([1, 2])     # sizes spread out only later
        y = 0.002 + 0.0003 * x + rng.gauss(0, 1e-5)
        samples.append((x, y))
        seen.append((x, y))
        window = seen[-16:]
        xs, ys = np.array([s[0] for s in window], float), np.array([s[1] for s in window])
        fit = samples.line(3)
        if xs.max() - xs.min() < 3:
            assert fit is None
            continue
        slope, fixed = np.polyfit(xs, ys, 1)
        assert fit == pytest.approx((max(fixed, 0.0), max(slope, 0.0)), rel=1e-6, abs=1e-12)
        assert samples.means() == pytest.approx((xs.mean(), ys.mean()))
        assert samples.mean_per_token() == pytest.approx((ys / xs).mean())
    assert list(samples) == seen[-16:]


def test_round_rates_forget_rounds_past_the_horizon_and_the_oldest_beyond_their_size():
    from dynchat.engine.policies import RoundRates

    rates = RoundRates(size=3)
    for at, (tokens, steps) in enumerate([(1, 1.0), (3, 1.5), (2, 1.0), (4, 2.0)]):
        rates.append(tokens, steps, at)
    assert len(rates) == 3 and rates.rate() == pytest.approx(9 / 4.5)       # the first fell out
    assert rates.forget_before(3).rate() == pytest.approx(4 / 2.0) and len(rates) == 1
    rates.forget_before(10)
    assert len(rates) == 0 and rates.rate() == 0.0


def test_throughput_drafts_again_after_a_long_plain_stretch_whatever_the_backlog():
    """A drafter kept off through a hard stretch of text catches up, when it next drafts, on every token
    it sat out (an EAGLE-3 head reads their features, a draft model runs over them: here 0.1 ms a
    token against a 1.6 ms step). That backlog is not what drafting costs while it drafts: once the
    text is easy again the policy drafts again. Counted as draft cost, each exploring round looked the
    dearer the longer drafting had been off, and the policy kept decoding plainly for good."""
    rng = random.Random(0)
    policy = make_policy("throughput", verify_ms={1: 1.6, 2: 1.83, 3: 2.05, 5: 2.5})
    sat_out, drafted_late, rounds = 0, [], 0
    for alpha, n in ((0.5, 300), (0.1, 1200), (0.5, 1200)):
        for _ in range(n):
            if rounds % 60 == 0:                    # a new reply every 60 rounds
                policy.start_reply()
            rounds += 1
            cap, j = policy.max_lookahead(), 0
            while j < cap:
                j += 1
                if not policy.keep_drafting(j, alpha):
                    break
            accepted = 0
            while accepted < j and rng.random() < alpha:
                accepted += 1
            draft_s = 0.07e-3 * j + 0.1e-3 * sat_out if j else 0.0
            sat_out = accepted + 1 if j else sat_out + 1
            verify_s = 1.6e-3 * (1 + 0.14 * j) * rng.uniform(0.9, 1.1)
            policy.end_round(j, accepted, [alpha] * j, draft_s, verify_s)
            if rounds > 2100:
                drafted_late.append(j > 0)
    assert sum(drafted_late) >= 0.8 * len(drafted_late), sum(drafted_late) / len(drafted_late)


def test_throughput_drafts_again_after_one_stalled_draft():
    """One draft that stalled (272 ms for its tokens, as one did in a bench run beside another job) made
    drafting look dear; while drafting is off no new draft cost comes in, so the policy stayed plain for
    good. Each exploring round measures the draft costs afresh."""
    rng = random.Random(0)
    policy = make_policy("throughput", verify_ms={1: 1.6, 2: 1.83, 3: 2.05, 5: 2.5})
    drafted_rounds, late = 0, []
    for rounds in range(1, 2001):
        if rounds % 60 == 1:
            policy.start_reply()
        cap, j = policy.max_lookahead(), 0
        while j < cap:
            j += 1
            if not policy.keep_drafting(j, 0.5):
                break
        accepted = 0
        while accepted < j and rng.random() < 0.5:
            accepted += 1
        draft_s = 0.1e-3 * j if j else 0.0
        if j:
            drafted_rounds += 1
            if drafted_rounds == 5:
                draft_s += 0.272
        policy.end_round(j, accepted, [0.5] * j, draft_s, 1.6e-3 * (1 + 0.14 * j) * rng.uniform(0.9, 1.1))
        if rounds > 1000:
            late.append(j > 0)
    assert sum(late) >= 0.8 * len(late), sum(late) / len(late)

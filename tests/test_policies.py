"""Lookahead policies against a simulated drafter and target whose costs and acceptance are known."""
from __future__ import annotations

import random

from dynchat.engine.policies import make_policy


def simulate(policy, rounds: int, alpha: float, draft_fixed: float, draft_per_token: float,
             verify_fixed: float = 0.011, verify_per_token: float = 0.0005, seed: int = 0) -> list[int]:
    """Drafts per round. Each draft token is accepted with probability alpha (and reports confidence
    alpha, so it is calibrated); a round costs draft_fixed + draft_per_token * j to draft j tokens,
    as an EAGLE-3 head's catch-up makes it, and verify_fixed + verify_per_token * (j + 1) to verify."""
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
        policy.end_round(j, accepted, confidences, draft_s, verify_fixed + verify_per_token * (j + 1))
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
    late = drafted[100:]
    assert abs(sum(late) / len(late) - best) <= 1.0, (best, sum(late) / len(late))


def test_throughput_stops_drafting_where_it_cannot_pay():
    assert best_lookahead(0.3, 0.030, 0.010) == 0
    drafted = simulate(make_policy("throughput"), 200, 0.3, 0.030, 0.010)
    late = drafted[50:]
    assert sum(j > 0 for j in late) / len(late) <= 0.2      # only the occasional exploring round


def test_throughput_drafts_longer_when_acceptance_is_higher():
    low = simulate(make_policy("throughput"), 200, 0.6, 0.002, 0.0012)[80:]
    high = simulate(make_policy("throughput"), 200, 0.9, 0.002, 0.0012)[80:]
    assert best_lookahead(0.9, 0.002, 0.0012) > best_lookahead(0.6, 0.002, 0.0012)
    assert sum(high) / len(high) > sum(low) / len(low) + 1

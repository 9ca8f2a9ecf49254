"""Lookup drafting: the reply index finds what a brute-force search finds, drafts are lossless
(greedy identical, sampling exact), and the app feeds it from the session log."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import ALPHA, ROOT, chi2_pvalue, exact_marginals, small_vocab_target

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.lookup import (
    SEP,
    LookupConfig,
    LookupDrafter,
    ReplyIndex,
    WithLookup,
    follow,
    scan_match,
)
from dynchat.engine.policies import Constant, Throughput, make_policy
from dynchat.engine.sampling import Sampler, SamplingParams


def brute_longest(replies: list[list[int]], tail: list[int], max_match: int) -> tuple[int, set[tuple[int, int]]]:
    """Longest m with tail[-m:] inside some reply, and the (reply, position after) of each occurrence."""
    best, where = 0, set()
    for m in range(1, min(max_match, len(tail)) + 1):
        pat = tail[-m:]
        found = {(r, i + m) for r, rep in enumerate(replies) for i in range(len(rep) - m + 1) if rep[i:i + m] == pat}
        if not found:
            break
        best, where = m, found
    return best, where


def native_built() -> bool:
    from dynchat.engine.native import library

    return library() is not None


@pytest.mark.parametrize("gather, native", [(4096, False), (0, False), (6, False), (4096, True)])
def test_index_finds_the_longest_match_and_every_occurrence(monkeypatch, gather, native):
    """Each way a level of the search narrows its range (numpy: a gathered range, bisection; the
    native search) finds what brute force finds."""
    import dynchat.engine.lookup as lookup

    if native and not native_built():
        pytest.skip("no native library here")
    if not native:
        monkeypatch.setattr(lookup, "_native", lambda: None)
    monkeypatch.setattr(lookup, "GATHER_AT_MOST", gather)
    rng = np.random.default_rng(0)
    cfg = LookupConfig(max_match=8, max_occurrences=10_000)
    for trial in range(30):
        replies = [rng.integers(0, 5, rng.integers(1, 40)).tolist() for _ in range(rng.integers(1, 12))]
        index = ReplyIndex(replies, cfg=cfg)
        tail = rng.integers(0, 5, 10).tolist()
        starts, match, corpus = index._indexed(np.asarray(tail, dtype=np.int32))
        m, where = brute_longest(replies, tail, cfg.max_match)
        assert match == m, (trial, replies, tail)
        offsets = np.cumsum([0] + [len(r) + 1 for r in replies])
        expected = {int(offsets[r] + p) for r, p in where}
        assert set(starts.tolist()) == expected


def test_the_native_search_drafts_exactly_what_the_numpy_code_drafts(monkeypatch):
    """lookup.c replaces the numpy search between forwards; same tokens, same estimates to the bit, for
    the conversation, the index and the recent replies, where matches are long and ties common."""
    import dynchat.engine.lookup as lookup

    if not native_built():
        pytest.skip("no native library here")
    rng = np.random.default_rng(3)
    replies = [rng.integers(0, 6, rng.integers(1, 80)).tolist() for _ in range(300)]
    recent = [rng.integers(0, 6, rng.integers(1, 30)).tolist() for _ in range(5)]
    conversations = [torch.tensor(rng.integers(0, 6, rng.integers(2, 200)), dtype=torch.long) for _ in range(60)]

    def drafts(how: str) -> list:       # one native call a round, native steps in Python, numpy
        with monkeypatch.context() as m:
            if how == "numpy":
                m.setattr(lookup, "_native", lambda: None)
            index = ReplyIndex(replies, recent_tokens=10_000)
            index.add_many(recent)                       # scanned, not in the suffix array
            out = []
            for cfg in (LookupConfig(), LookupConfig(max_occurrences=7, min_confidence=0.0, max_match=5)):
                index.cfg = cfg
                drafter = LookupDrafter(index, cfg)
                if how == "steps":
                    drafter._native_cfg = None
                for seq in conversations:
                    drafter.reset()
                    for end in range(1, seq.numel() + 1, 7):
                        cand = drafter.candidate(seq[:end])
                        starts, match, _ = index._indexed(seq[:end].numpy().astype(np.int32))
                        out.append((cand.tokens, cand.probs, sorted(starts.tolist()), match))
            return out

    native, steps, numpy_ = drafts("one-call"), drafts("steps"), drafts("numpy")
    assert len(native) == len(numpy_) > 1000
    assert native == steps == numpy_
    assert sum(len(d[0]) for d in native) > 1000       # drafts were made, not only empty ones


def test_recent_replies_are_found_before_a_rebuild_and_after():
    index = ReplyIndex([[5, 6, 7, 8]], recent_tokens=10)
    index.add([1, 2, 3, 4, 9, 9])                      # scanned, not yet in the suffix array
    cand, match = index.candidate(np.array([0, 1, 2], dtype=np.int32))
    assert match == 2 and cand.tokens[:2] == [3, 4]
    index.add([7, 1, 2, 3, 4, 5, 6])                   # past recent_tokens: rebuilt (in the background)
    index.settle()
    assert index._recent == []
    cand, _ = index.candidate(np.array([0, 1, 2], dtype=np.int32))
    assert cand.tokens[:2] == [3, 4]


def _held_builds(index: ReplyIndex) -> tuple[threading.Event, threading.Event]:
    """Make the index's builds wait: (set when one starts, set to let them finish)."""
    started, release = threading.Event(), threading.Event()
    build = index._build

    def held(replies):
        started.set()
        release.wait()
        return build(replies)

    index._build = held
    return started, release


def test_a_rebuild_runs_beside_the_chat_whose_reply_started_it():
    """A build of millions of tokens takes seconds: remembering a reply must not wait for it, the
    replies stay findable meanwhile, and one added during the build is neither lost nor folded early."""
    index = ReplyIndex([[5, 6, 7, 8]], recent_tokens=10)
    started, release = _held_builds(index)
    adder = threading.Thread(target=index.add, args=([1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9],))   # past recent_tokens
    adder.start()
    adder.join(10)
    returned = not adder.is_alive()
    if not returned:
        release.set()
    assert started.is_set() and returned                 # a rebuild started, and add() did not wait for it
    index.add([20, 21, 22, 23])                         # arrives during the build
    for tail, expect in (([0, 1, 2], [3, 4]), ([0, 20, 21], [22, 23])):
        assert index.candidate(np.array(tail, dtype=np.int32))[0].tokens[:2] == expect
    release.set()
    index.settle()
    assert [r.tolist() for r in index._recent] == [[20, 21, 22, 23]]      # the newer one still scanned
    starts, match, _ = index._indexed(np.array([1, 2, 3], dtype=np.int32))
    assert match == 3 and starts.size == 1                                 # the other one now indexed
    for tail, expect in (([0, 1, 2], [3, 4]), ([0, 20, 21], [22, 23])):
        assert index.candidate(np.array(tail, dtype=np.int32))[0].tokens[:2] == expect


def test_index_is_bounded_oldest_replies_first():
    index = ReplyIndex(max_tokens=100, recent_tokens=0)
    for i in range(50):
        index.add([i] * 10)
    index.settle()
    assert index.tokens <= 100 and len(index) == 10
    assert index.candidate(np.array([3, 3, 3], dtype=np.int32))[0].tokens == []     # forgotten
    assert index.candidate(np.array([49, 49], dtype=np.int32))[0].tokens[:1] == [49]


def test_replies_dropped_during_a_background_rebuild_are_forgotten_once_it_settles():
    """A rebuild indexes the replies of when it started; those dropped past max_tokens while it ran must
    not stay findable in the index it leaves (the next rebuild starts at once)."""
    index = ReplyIndex([[5, 6, 7, 8, 9]], max_tokens=30, recent_tokens=5)
    started, release = _held_builds(index)
    index.add([1, 2, 3, 4, 5, 6])                           # past recent_tokens: a rebuild starts
    assert started.wait(10)
    for i in range(5):
        index.add([40 + i] * 6)                             # meanwhile [5 .. 9] and [1 .. 6] are dropped
    release.set()
    index.settle()
    assert index.tokens <= 30
    assert index.candidate(np.array([0, 1, 2], dtype=np.int32))[0].tokens == []    # forgotten
    assert index.candidate(np.array([44, 44], dtype=np.int32))[0].tokens[:1] == [44]


def test_follow_takes_the_most_frequent_continuation_with_its_frequency():
    rows = np.array([[1, 2, 3], [1, 2, 4], [1, 5, SEP], [1, 2, 3]])
    cand = follow(rows, match=4, cfg=LookupConfig(prior=0.0, min_confidence=0.0))
    assert cand.tokens == [1, 2, 3]
    assert cand.probs == pytest.approx([1.0, 0.75, 2 / 3])


def test_scan_match_ignores_the_tail_itself():
    seq = np.array([3, 4, 5, 9, 3, 4], dtype=np.int64)
    starts, m = scan_match(seq, seq.size - 1, LookupConfig(), seq.size - 1)
    assert m == 2 and starts.tolist() == [2]


def test_lookup_drafts_in_well_under_a_millisecond_on_a_large_index():
    rng = np.random.default_rng(1)
    replies = [rng.integers(0, 2000, 120).tolist() for _ in range(5000)]     # 600k tokens
    index = ReplyIndex(replies)
    drafter = LookupDrafter(index)
    committed = torch.tensor(replies[7][:60] + rng.integers(0, 2000, 400).tolist() + replies[3][:30])
    drafter.candidate(committed)
    import time
    t0 = time.perf_counter()
    for _ in range(50):
        drafter.reset()
        cand = drafter.candidate(committed)
    per_call = (time.perf_counter() - t0) / 50
    assert cand.tokens[:5] == replies[3][30:35]
    assert per_call < 0.003          # generous for a loaded CI machine; ~0.05-0.2 ms here


@pytest.fixture(scope="module")
def demo_engine():
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    return load_engine(get_preset("demo", ROOT / "models.yaml"))


PROMPTS = ["What does the function json.dumps do?", "What is the collections module for?",
           "What does the class threading.Lock do?"]


@pytest.mark.parametrize("mode", ["lookup", "assistant", "eagle3"])
def test_greedy_output_identical_with_lookup_drafts(demo_engine, mode):
    e = demo_engine
    for prompt in PROMPTS:
        ids = e.encode(prompt)
        base, _ = run(e.decoder("baseline"), ids, 64)
        e.remember([base[:20], base[10:]])          # earlier replies that overlap this one
        decoders = [e.decoder(mode)] if mode == "lookup" else [e.decoder(mode, branches=b) for b in (False, True)]
        for name in ("throughput", "constant", "dynamic"):
            for dec in decoders:
                out, s = run(dec, ids, 64, policy=make_policy(name))
                assert out == base, (prompt, mode, name)
                if mode == "lookup":
                    assert s.draft_rounds > 0 and s.target_forwards < len(out)


def test_lookup_rounds_inside_model_modes(demo_engine):
    e = demo_engine
    ids = e.encode(PROMPTS[0])
    base, _ = run(e.decoder("baseline"), ids, 64)
    e.remember([base])
    dec = e.decoder("eagle3")
    assert isinstance(dec.drafter, WithLookup)
    before = dec.drafter.lookup_rounds
    out, s = run(dec, ids, 64, policy=make_policy("throughput"))
    assert out == base and dec.drafter.lookup_rounds > before


def test_transformers_modules_take_lookup_rounds_without_a_second_branch(demo_engine):
    """Transformers' forward verifies no trees: an assistant round on it keeps lookup's candidate
    out of the verify (it once crashed `dynchat bench` there) and still gives plain decoding's tokens."""
    e = demo_engine
    ids = e.encode(PROMPTS[1])
    base, _ = run(e.decoder("baseline"), ids, 48)
    e.remember([base])
    dec = e.decoder("assistant", "transformers")
    assert isinstance(dec.drafter, WithLookup) and not dec.drafter.branches
    assert e.decoder("assistant", branches=True).drafter.branches
    out, _ = run(dec, ids, 48, policy=make_policy("dynamic"))
    assert out == base


def test_on_a_cpu_lookup_s_candidate_replaces_the_model_s_draft_instead_of_riding_beside_it(demo_engine, monkeypatch):
    """On a CPU, where each verified token costs ~10% of a step, a model's round verifies one candidate
    (lookup's or the model's chain) unless the preset sets `lookup_branches: true`; both give plain
    decoding's tokens."""
    e = demo_engine
    assert e.device.type == "cpu"
    ids = e.encode(PROMPTS[1])
    base, _ = run(e.decoder("baseline"), ids, 48)
    e.remember([base])
    one = e.decoder("eagle3", tree=None)
    assert isinstance(one.drafter, WithLookup) and not one.drafter.branches
    assert one is e.decoder("eagle3", tree=None, branches=False)
    monkeypatch.setitem(e.preset.generation, "lookup_branches", True)
    two = e.decoder("eagle3", tree=None)
    assert two.drafter.branches and two is e.decoder("eagle3", tree=None, branches=True)
    for dec in (one, two):
        out, _ = run(dec, ids, 48, policy=make_policy("throughput"))
        assert out == base


@pytest.mark.slow                    # statistical: ~1,500 seeded generations
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_p=0.95, top_k=8)])
def test_lookup_sampling_end_to_end_matches_target(params):
    """Deterministic drafts are one-hot proposals: positions decided by them follow the target exactly."""
    target = small_vocab_target()
    start = [1, 4, 7]
    prompt = start + run(Decoder(target), start, 24)[0] + start     # the target's own path, then its start again
    expected = exact_marginals(target, prompt, params, depth=3)
    dec = Decoder(target, LookupDrafter(cfg=LookupConfig(min_match=1)))
    draws, acc, drafted = [], 0, 0
    for i in range(1500):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=2000 + i)
        ids, s = run(dec, prompt, 3, p, make_policy("constant", 3))
        draws.append(ids)
        acc, drafted = acc + s.accepted_tokens, drafted + s.draft_tokens
    assert drafted > 300 and 0.05 < acc / drafted < 0.95       # drafts were verified, some rejected
    for pos in (1, 2):
        assert chi2_pvalue([d[pos] for d in draws], expected[pos]) > ALPHA, f"position {pos + 1}"


def test_one_hot_verify_first_token_follows_target():
    torch.manual_seed(0)
    V = 10
    logits = torch.randn(3, V) * 1.5
    sampler = Sampler(SamplingParams(1.0, seed=7), torch.device("cpu"))
    p = sampler.probs(logits)
    drafts = torch.tensor([int(p[0].argmax()), 3])
    firsts = []
    for _ in range(12000):
        judged = sampler.judge(drafts, None, logits)             # [accepted, the k+1 tokens]
        n = int(judged[0])
        tok = judged[1 + n]
        firsts.append(int(drafts[0]) if n else int(tok))
    assert chi2_pvalue(firsts, p[0].numpy()) > ALPHA


def test_throughput_policy_never_gates_a_free_draft_by_its_cost_model():
    policy = Throughput()
    policy.seed_costs({1: 20.0, 2: 25.0, 5: 33.0, 9: 45.0})
    for _ in range(30):                  # low acceptance, a draft that costs 20 microseconds
        policy.max_lookahead()
        policy.end_round(3, 0, [0.3, 0.2, 0.1], 0.00002, 0.03)
    assert sum(policy.max_lookahead() > 0 for _ in range(10)) >= 9     # but for a plain probe round
    model = Throughput()
    model.seed_costs({1: 20.0, 2: 25.0, 5: 33.0, 9: 45.0})
    for _ in range(30):                  # the same acceptance from a draft model costing 5 ms a token
        model.max_lookahead()
        model.end_round(3, 0, [0.3, 0.2, 0.1], 0.015, 0.03)
    assert sum(model.max_lookahead() == 0 for _ in range(10)) >= 7


def _lookup_rounds(policy, rounds: int, tried_s: float, plain_s: float = 0.0060, slower=lambda r: 1.0) -> list[int]:
    """Rounds of a lookup drafter that finds a 1-token draft every 4th round (accepted half the
    time) and nothing otherwise; a round it tries costs tried_s, a plain one plain_s, times
    slower(r) (the machine's speed and the context's length move)."""
    caps = []
    for r in range(rounds):
        cap = policy.max_lookahead()
        caps.append(cap)
        f = slower(r)
        if cap == 0:
            policy.end_round(0, 0, [], 0.0, f * plain_s)
        elif r % 4 == 0:
            accepted = r % 8 == 0
            policy.end_round(1, int(accepted), [0.6], f * 0.0001, f * 1.5 * tried_s)
        else:
            policy.end_round(0, 0, [], f * 0.0003, f * (tried_s - 0.0003))      # a miss: its search, then a step
    return caps


def test_throughput_turns_lookup_off_where_its_rounds_measure_slower_than_plain_ones():
    """A lookup miss costs its search, and a short draft a verify 1.5x a step (a CPU without integer
    dot-product instructions): where the rounds lookup tries make fewer tokens per second than the
    plain ones, the policy decodes plainly but for exploring rounds; where they make more, it keeps
    drafting."""
    curve = {1: 6.0, 2: 9.0, 5: 16.0, 9: 24.0}
    slow = Throughput()
    slow.seed_costs(curve)
    caps = _lookup_rounds(slow, 600, tried_s=0.0068)
    assert sum(c > 0 for c in caps[400:]) <= 20
    fast = Throughput()
    fast.seed_costs(curve)
    caps = _lookup_rounds(fast, 600, tried_s=0.0055)
    assert sum(c > 0 for c in caps[400:]) >= 180


def test_throughput_judges_lookups_rounds_at_the_machine_speed_of_their_time():
    """Our machines' speed swings by a third within minutes and a reply's steps slow as its context
    grows, while the plain rounds the gate compares with are 1 in 32, spread over hundreds of rounds.
    Counted in seconds, a lookup that pays ~9% looked slower as the machine slowed, and was turned
    off; counted in one-token steps of their time, it keeps drafting. One that loses still stops."""
    curve = {1: 6.0, 2: 9.0, 5: 16.0, 9: 24.0}

    def slowing(r: int) -> float:          # steady for 1,000 rounds, then 1.5x slower over 500
        return 1.0 + max(0, r - 1000) / 1000

    pays = Throughput()
    pays.seed_costs(curve)
    caps = _lookup_rounds(pays, 1500, tried_s=0.0055, slower=slowing)
    assert sum(c > 0 for c in caps[1200:]) >= 0.9 * 300
    loses = Throughput()
    loses.seed_costs(curve)
    caps = _lookup_rounds(loses, 1500, tried_s=0.0068, slower=lambda r: 1.5 - max(0, r - 1000) / 1000)  # faster
    assert sum(c > 0 for c in caps[1200:]) <= 0.1 * 300


def test_a_new_reply_tries_again_a_lookup_the_last_replies_turned_off():
    """A chat's next message may ask for another kind of text (a summary after small talk). Where
    lookup measured slower, the policy kept across the chat's turns lets the new reply's first
    rounds try again, and keeps drafting where they pay."""
    policy = Throughput()
    policy.seed_costs({1: 6.0, 2: 9.0, 5: 16.0, 9: 24.0})
    caps = _lookup_rounds(policy, 600, tried_s=0.0068)           # lookup loses here: turned off
    assert sum(c > 0 for c in caps[400:]) <= 20
    policy.start_reply()
    caps = _lookup_rounds(policy, 100, tried_s=0.0050)           # the next message: it pays
    assert sum(c > 0 for c in caps[20:]) >= 0.75 * 80
    policy.start_reply()                                         # where it pays, a new reply changes nothing
    assert sum(policy.max_lookahead() > 0 for _ in range(20)) >= 18


def test_every_reply_tells_the_policy_it_starts(demo_engine):
    """The decoding loop calls start_reply once per reply (after the prompt's prefill)."""
    e = demo_engine
    started = []

    class Counting(Throughput):
        def start_reply(self):
            started.append(True)
            super().start_reply()

    policy = Counting()
    for prompt in PROMPTS[:2]:
        run(e.decoder("lookup"), e.encode(prompt), 8, SamplingParams(), policy)
    assert len(started) == 2


def test_index_is_safe_under_concurrent_chats():
    rng = np.random.default_rng(2)
    index = ReplyIndex([rng.integers(0, 50, 100).tolist() for _ in range(200)], recent_tokens=2000)
    errors = []

    def reader():
        try:
            for _ in range(300):
                index.candidate(rng.integers(0, 50, 24).astype(np.int32))
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(100):                   # writers force rebuilds while readers search
        index.add(rng.integers(0, 50, 100).tolist())
    for t in threads:
        t.join()
    assert not errors


def test_lookup_drafts_only_as_far_as_the_verify_cost_pays():
    from dynchat.engine.forward import VerifyCosts
    from dynchat.engine.lookup import Candidate, best_prefix

    cand = Candidate([1, 2, 3, 4, 5, 6], [0.9, 0.9, 0.5, 0.3, 0.2, 0.1])
    cpu = VerifyCosts({1: 21.0, 2: 25.4, 5: 33.4, 9: 44.0})       # measured on SmolLM2, float32, 2 cores
    assert best_prefix(cand, cpu).tokens == [1, 2, 3]
    assert best_prefix(cand, VerifyCosts({1: 5.0, 9: 5.0})).tokens == [1, 2, 3, 4, 5, 6]   # flat: all of it
    assert best_prefix(Candidate([7], [0.1]), cpu).tokens == []                             # a plain step pays more
    assert cpu.ms(3) == pytest.approx(25.4 + 8.0 / 3) and cpu.ms(13) == pytest.approx(44.0 + 4 * 10.6 / 4)


def test_nothing_is_drafted_past_an_end_of_reply_token():
    """A reply that copies the end of its prompt finds the chat template's end-of-turn and the next turn's
    markers after it there: lookup drafts up to the end-of-reply token (the reply may stop there) and
    never past it, where every verified row would be wasted."""
    from dynchat.engine.forward import VerifyCosts

    eos = 2
    prompt = [9, 5, 6, 7, 8, eos, 30, 31, 32, 33, 34, 35]       # ... text end-of-turn assistant-header ...
    committed = torch.tensor(prompt + [5, 6, 7, 8])            # the reply has copied the text
    flat = VerifyCosts({1: 5.0, 9: 5.0, 17: 5.0})               # a verify costs what a step costs: cut by nothing else
    assert LookupDrafter(costs=flat).draft(committed, 16).tokens[:3] == [eos, 30, 31]
    assert LookupDrafter(costs=flat, stop_ids={eos}).draft(committed, 16).tokens == [eos]
    assert LookupDrafter(costs=flat, stop_ids={eos}).draft(torch.tensor(prompt + [5, 6]), 16).tokens == [7, 8, eos]


def test_the_prefix_search_stopping_early_keeps_the_best_prefix():
    """best_prefix stops once no longer prefix can win; on random candidates and cost curves it keeps
    what weighing every prefix keeps, with the estimate applied as given."""
    import random

    from dynchat.engine.forward import VerifyCosts
    from dynchat.engine.lookup import Candidate, best_prefix

    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 16)
        sure = rng.random() / 2             # runs of sure tokens after an unsure one make a longer prefix win
        cand = Candidate(list(range(n)), [1.0 if rng.random() < sure else rng.random() ** rng.choice([0.2, 1, 3])
                                          for _ in range(n)])
        step = [rng.uniform(2, 20)]                  # a verify of more tokens never costs less
        for _ in range(3):
            step.append(step[-1] * rng.uniform(1, 1.4))
        costs = VerifyCosts(dict(zip((1, 2, 5, 9), step)))
        scale = rng.uniform(0.5, 1.5)

        def estimate(p):
            return min(1.0, p * scale)

        probs = [estimate(p) for p in cand.probs]
        rates, chain, expected = [1.0 / costs.ms(1)], 1.0, 1.0
        for j, p in enumerate(probs, start=1):
            chain *= p
            expected += chain
            rates.append(expected / costs.ms(j + 1))
        best = max(range(n + 1), key=lambda j: (rates[j], -j))       # the first of equal rates
        got = best_prefix(cand, costs, estimate)
        assert got.tokens == cand.tokens[:best] and got.probs == pytest.approx(probs[:best])


def test_lookup_stops_drafting_what_its_rounds_prove_wrong_and_keeps_what_they_prove_right():
    """Counts can promise what the target does not do: the estimates are calibrated on the rounds, so
    at a verify that costs 1.3x a step a draft whose tokens keep being rejected stops being proposed."""
    from dynchat.engine.forward import VerifyCosts
    from dynchat.engine.lookup import Candidate

    costs = VerifyCosts({1: 10.0, 2: 13.0, 5: 25.0}, learn=False)
    for right, drafts_after in ((False, False), (True, True)):
        lookup = LookupDrafter(costs=costs)
        lookup.candidate = lambda committed: Candidate([7, 8, 9], [0.85, 0.85, 0.85])
        assert lookup.draft(torch.tensor([1, 2]), 8).tokens          # before any round: trusted as estimated
        for _ in range(40):          # each round a reply of its own: the pooled calibration is under test
            lookup.prefill(torch.tensor([1, 2]))
            cand = lookup.draft(torch.tensor([1, 2]), 8)
            lookup.learn(len(cand.tokens) if right else 0)
        assert bool(lookup.draft(torch.tensor([1, 2]), 8).tokens) == drafts_after
        assert (lookup.calibration(0.85) > 0.9) if right else (lookup.calibration(0.85) < 0.3)


def test_a_reply_whose_drafts_keep_missing_stops_drafting_and_the_next_reply_starts_afresh():
    """The calibration pools every reply (here: 1,000 rounds that kept 40% of such drafts), so a few
    misses barely move it; a rewrite whose prompt offers matches it does not follow would pay for a
    longer verify every round. The reply's own record scales the estimates: after a few misses it
    stops drafting, the next reply drafts again, and a reply whose drafts land drafts more."""
    from dynchat.engine.forward import VerifyCosts
    from dynchat.engine.lookup import Candidate, LookupConfig
    from dynchat.engine.policies import Calibration

    costs = VerifyCosts({1: 10.0, 2: 13.0, 5: 25.0}, learn=False)     # a 1-token draft pays above 0.3
    ids = torch.tensor([1, 2])
    for evidence in (3.0, 0.0):
        pooled = Calibration()
        for i in range(1000):
            pooled.observe([0.45], int(i % 5 < 2))
        lookup = LookupDrafter(costs=costs, calibration=pooled, cfg=LookupConfig(reply_evidence=evidence))
        lookup.candidate = lambda committed: Candidate([7], [0.45])
        drafted = []
        for _reply in range(2):
            lookup.prefill(ids)
            drafted.append(0)
            for _ in range(10):
                if lookup.draft(ids, 8).tokens:
                    drafted[-1] += 1
                    lookup.learn(0)
        assert drafted == ([3, 3] if evidence else [10, 10]), (evidence, drafted)
    lookup.prefill(ids)
    lookup.candidate = lambda committed: Candidate([7], [0.25])       # calibrated below paying
    assert not lookup.draft(ids, 8).tokens
    lookup.cfg = LookupConfig(reply_evidence=3.0)
    for _ in range(4):
        lookup._estimates = [0.45]
        lookup.learn(1)                                                # this reply's drafts were right
    assert lookup.reply_factor() > 1.4 and lookup.draft(ids, 8).tokens


def test_lookup_is_calibrated_before_the_first_reply_on_replies_its_index_does_not_hold():
    """Counts over earlier replies of noise promise continuations that the next reply does not follow:
    walked over held-out replies as greedy verification would judge them (no forward), the
    calibration learns that before any chat, and such drafts are not proposed; replies that do repeat
    the index are learned to be right."""
    from dynchat.engine.forward import VerifyCosts
    from dynchat.engine.lookup import calibrate
    from dynchat.engine.policies import Calibration

    rng = np.random.default_rng(0)
    noise = ReplyIndex([rng.integers(0, 40, 60).tolist() for _ in range(300)])
    costs = VerifyCosts({1: 10.0, 2: 13.0, 5: 25.0}, learn=False)
    cold, noisy = Calibration(), Calibration()
    rounds = calibrate(noisy, noise, [rng.integers(0, 40, 60).tolist() for _ in range(20)])
    assert rounds > 500 and noisy.seen.sum() > 500
    assert noisy.mean() < 0.15                                       # 1 in 40 is right, whatever the counts say
    tails = [torch.tensor(rng.integers(0, 40, 30)) for _ in range(100)]
    drafts = {name: sum(bool(LookupDrafter(noise, costs=costs, calibration=c).draft(t, 8).tokens) for t in tails)
              for name, c in (("cold", cold), ("calibrated", noisy))}
    assert drafts["cold"] >= 10 and drafts["calibrated"] == 0, drafts
    repeated = [rng.integers(100, 140, 60).tolist() for _ in range(10)]
    sure = Calibration()
    calibrate(sure, ReplyIndex(repeated * 3), repeated[:4])          # the target says again what it said
    assert sure.mean() > 0.9


def test_the_verify_cost_curve_follows_what_the_loop_measures():
    from dynchat.engine.forward import VerifyCosts

    costs = VerifyCosts({1: 10.0, 2: 15.0, 5: 30.0})       # timed at load, in a slow spell for longer verifies
    for _ in range(200):
        costs.observe(1, 0.008)                             # the loop: a step 8 ms, 2 tokens 1.25x, 5 tokens 2x
        costs.observe(2, 0.010)
        costs.observe(5, 0.016)
    assert costs.ms(1) == pytest.approx(8.0, rel=0.02)
    assert costs.ms(2) / costs.ms(1) == pytest.approx(1.25, rel=0.02)
    assert costs.ms(5) / costs.ms(1) == pytest.approx(2.0, rel=0.02)
    assert costs.ms(3) / costs.ms(1) == pytest.approx(1.25 + 0.75 / 3, rel=0.02)    # between, interpolated
    for _ in range(200):                                    # the machine slows down by a third; a step is timed
        costs.observe(1, 0.012)                             # often, a 5-token verify rarely: its ratio holds
    assert costs.ms(5) / costs.ms(1) == pytest.approx(2.0, rel=0.02)
    pinned = VerifyCosts({1: 10.0, 2: 15.0}, learn=False)
    pinned.observe(2, 0.001)
    assert pinned.curve == {1: 10.0, 2: 15.0}               # DYNCHAT_VERIFY_MS: choices repeat from run to run


def test_a_longer_verify_is_never_priced_below_a_shorter_one():
    """Sizes are learned apart, rare ones from few noisy rounds: where a larger size's ratio falls below a
    smaller one's, the curve holds level instead of dipping, and never extrapolates downward (a 16-token
    verify was once priced at a third of a step: a long draft looks free at such a price)."""
    from dynchat.engine.forward import VerifyCosts

    costs = VerifyCosts({1: 5.0, 2: 6.0, 5: 9.0, 9: 12.0})
    for _ in range(100):
        costs.observe(9, 0.008)            # a few 9-token verifies in a fast spell: below the 5-token ratio
        costs.observe(11, 0.0065)          # ... and an 11-token one below that
    priced = [costs.ms(n) for n in range(1, 33)]
    assert all(b >= a for a, b in zip(priced, priced[1:])), priced
    assert costs.ms(16) >= costs.ms(5) == pytest.approx(9.0)
    assert costs.curve[9] == pytest.approx(8.0, rel=0.01)     # what was measured is kept as measured



def test_the_verify_cost_curve_times_a_step_and_short_verifies_as_the_loop_runs_them(monkeypatch):
    """A forward after a much larger one runs slower for a while (on a 2-core Xeon a step after a 17-token
    verify took ~1.3x its time in the loop): the curve must not read that into its step or a chain's
    short verifies, whatever the order of the sizes it is given."""
    from dynchat.engine import forward as fw

    clock = [0.0]

    class LM:          # a step costs 3 ms and each further token 1 ms, plus 2 ms for three forwards after one
        vocab_size, device, recent = 100, torch.device("cpu"), []      # four times as long or more

        def forward(self, ids, last_only=False):
            n = ids.numel()
            if n < 100:                       # not the prefill
                clock[0] += (3 + (n - 1) + (2 if any(m >= 4 * n for m in self.recent[-3:]) else 0)) / 1000
                self.recent.append(n)

        def rollback(self, keep):
            pass

        def reset(self):
            pass

    monkeypatch.setattr(fw.time, "perf_counter", lambda: clock[0])
    for sizes in ((1, 2, 5, 9, 17), (17, 2, 1, 9, 5)):
        curve = fw.verify_cost_curve(LM(), sizes=sizes, repeats=3)
        assert curve == pytest.approx({1: 3.0, 2: 4.0, 5: 7.0, 9: 11.0, 17: 19.0})

class _Chain:
    """A model drafter stand-in: always drafts 5 6 7, and records how far it is rolled back."""
    name, read_once = "stub", False

    def __init__(self):
        self.rolled = []

    def propose(self, committed, max_tokens, policy, sampler):
        from dynchat.engine.drafters import Proposal

        return Proposal(torch.tensor([5, 6, 7]), None, [0.9, 0.9, 0.9])

    def rollback(self, n_accepted, path=None):
        self.rolled.append(n_accepted)


def test_lookups_candidate_rides_along_as_a_branch_from_where_it_leaves_the_models_chain(monkeypatch):
    from dynchat.engine.forward import VerifyCosts
    from dynchat.engine.lookup import Candidate

    model = _Chain()
    both = WithLookup(model, LookupDrafter(costs=VerifyCosts({1: 1.0, 2: 1.01, 5: 1.05, 9: 1.1})))
    both.model_mean = 10.0                     # the model's rounds expect more than lookup's: the model drafts
    monkeypatch.setattr(both.lookup, "candidate", lambda committed: Candidate([5, 6, 9, 9], [0.9] * 4))
    greedy = Sampler(SamplingParams(), torch.device("cpu"))
    p = both.propose(torch.tensor([1, 2, 3]), 8, Constant(3), greedy)
    assert p.tokens.tolist() == [5, 6, 7, 9, 9] and p.chain == 3
    assert p.parents == [-1, 0, 1, 1, 3] and p.depths == [1, 2, 3, 3, 4]     # 9 9 leaves the chain after 5 6
    both.rollback(3, [0, 1, 3])              # the target took 5 6 9: lookup's branch
    assert model.rolled == [2]               # the model keeps what it drafted of the kept path
    cal = both.lookup.calibration            # lookup learned: its path's first three tokens right, the fourth not
    assert cal.seen.sum() == 4 and cal.accepted.sum() == 3
    sampled = Sampler(SamplingParams(1.0, seed=0), torch.device("cpu"))
    assert both.propose(torch.tensor([1, 2, 3]), 8, Constant(3), sampled).parents is None   # sampling: one candidate


@pytest.mark.parametrize("mode", ["assistant", "eagle3"])
def test_two_branch_rounds_keep_greedy_output_identical(mode):
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    e = load_engine(get_preset("demo", ROOT / "models.yaml"))      # its own index: only what this test remembers
    dec = e.decoder(mode, branches=True)
    before = dec.drafter.branch_rounds
    for prompt in PROMPTS:
        ids = e.encode(prompt)
        base, _ = run(e.decoder("baseline"), ids, 64)
        e.remember([base[:12], base[30:40]])      # lookup knows some of the reply, the model the rest
        for name in ("throughput", "constant"):
            dec.drafter.model_mean = 1e6          # lookup never drafts alone: it rides along where it pays
            out, _ = run(dec, ids, 64, policy=make_policy(name))
            assert out == base, (prompt, name)
    assert dec.drafter.branch_rounds > before


def test_a_lookup_search_that_finds_nothing_is_counted_in_the_round_it_cost():
    """In rounds the policy keeps plain, lookup beside a model still searches; a miss drafts nothing
    but costs its time, which the round reports (and the policy's measured rates include)."""
    import time

    from dynchat.engine.events import RoundEvent
    from dynchat.engine.lookup import Candidate
    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine

    e = load_engine(get_preset("demo", ROOT / "models.yaml"))
    dec = e.decoder("eagle3")

    def slow_miss(committed):
        time.sleep(0.004)
        return Candidate([], [])

    dec.drafter.lookup.candidate = slow_miss
    seen = []

    class Plain(Constant):            # never lets the model draft; records what each round cost
        def end_round(self, drafted, accepted, confidences, draft_s, verify_s, verified=None, committed=None):
            seen.append(draft_s)

    events = [ev for ev in dec.generate(e.encode(PROMPTS[0]), 12, policy=Plain(0)) if isinstance(ev, RoundEvent)]
    assert len(seen) == len(events) - 1 >= 10                     # every round after the prefill
    assert min(seen) >= 0.004 and all(ev.drafted == 0 and ev.draft_s >= 0.004 for ev in events[1:])


def _plain_rounds_with_lookup_beside(policy, rounds: int, free_s: float, bare_s: float = 0.0060) -> list[bool]:
    """Rounds of a model drafter that never pays (5 ms a token at acceptance 0.3): the policy keeps
    them plain, and lookup beside the model may draft there (a 1-token draft every 4th round, right
    half the time); a round with lookup's search and verify costs free_s, a bare one bare_s."""
    allowed = []
    for r in range(rounds):
        if policy.max_lookahead() > 0:
            policy.end_round(3, 0, [0.3, 0.2, 0.1], 0.015, 0.012)
            continue
        ok = policy.allows_free_draft()
        allowed.append(ok)
        if ok and r % 4 == 0:
            policy.end_round(1, int(r % 8 == 0), [], 0.0003, 1.5 * free_s)
        else:
            policy.end_round(0, 0, [], 0.0003 if ok else 0.0, free_s - 0.0003 if ok else bare_s)
    return allowed


def test_throughput_turns_lookup_beside_a_model_off_where_its_rounds_measure_slower():
    """In the rounds the policy keeps plain (the model's drafts do not pay), lookup's free drafts are
    verified only while those rounds make at least the tokens per second of bare ones."""
    curve = {1: 6.0, 2: 9.0, 5: 16.0, 9: 24.0}
    slow = Throughput()
    slow.seed_costs(curve)
    allowed = _plain_rounds_with_lookup_beside(slow, 800, free_s=0.0068)
    assert sum(allowed[-300:]) <= 60                  # but for exploring rounds
    fast = Throughput()
    fast.seed_costs(curve)
    allowed = _plain_rounds_with_lookup_beside(fast, 800, free_s=0.0054)
    assert sum(allowed[-300:]) >= 280                 # but for the bare probe rounds


@pytest.mark.slow
def test_the_script_counting_who_drafts_beside_a_model_runs_and_its_second_pass_never_takes_lookup(tmp_path):
    """scripts/model-beside-lookup.py (docs/benchmarks.md reads its figures) on the demo preset: as the app
    runs it, then with the model drafting every round, where lookup must never be verified."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"kind": "how-to", "prompt": "How do I read a file in Python?"}\n'
                       '{"kind": "coding", "prompt": "Write a function that adds two numbers."}\n')
    out = subprocess.run([sys.executable, str(root / "scripts" / "model-beside-lookup.py"), "--preset", "demo",
                          "--mode", "eagle3", "--prompts", str(prompts), "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=600, cwd=root).stdout
    app, model_only = out.split("the model one token every round")
    assert "as the app runs it" in app and app.count("prompt ") == 2, out
    rounds = [line for line in model_only.splitlines() if line.strip().startswith("prompt ")]
    assert len(rounds) == 2 and all("lookup" not in line.split(":", 1)[1] for line in rounds), out
    assert "the model's first token right where" in model_only, out

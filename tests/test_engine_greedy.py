"""Lossless greedy: speculative output equals plain greedy output token for token."""
from __future__ import annotations

import threading

import pytest
import torch
from conftest import ARCHS, noisy_copy, tiny_model

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.drafters import DraftModelDrafter
from dynchat.engine.policies import POLICIES, Dynamic, make_policy
from dynchat.engine.sampling import Sampler, SamplingParams

PROMPT = [1, 17, 5, 42, 9, 33, 8]


def hf_greedy(model, prompt, n, eos=None):
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=0,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def vocab(model):
    return model.get_output_embeddings().weight.shape[0]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    target = tiny_model(request.param)
    return request.param, target, noisy_copy(target, 0.03)


def test_greedy_equals_generate_for_every_policy(pair):
    arch, target, draft = pair
    n = 60   # past gemma2's sliding window of 16
    ref = hf_greedy(target, PROMPT, n)
    base, s = run(Decoder(target), PROMPT, n)
    assert base == ref, f"{arch}: our plain decoding differs from model.generate"
    assert s.new_tokens == n and s.target_forwards == n and s.draft_tokens == 0
    accepted_any = False
    for name in POLICIES:
        dec = Decoder(target, DraftModelDrafter(draft, vocab(target)))
        ids, s = run(dec, PROMPT, n, SamplingParams(), make_policy(name, 4))
        assert ids == ref, f"{arch}/{name}: speculative output differs from plain greedy"
        assert s.new_tokens == n
        assert 0 <= s.accepted_tokens <= s.draft_tokens
        accepted_any |= s.accepted_tokens > 0
    assert accepted_any, f"{arch}: the noisy draft never agreed; the test would not exercise acceptance"


def test_random_draft_and_perfect_draft(pair):
    arch, target, _ = pair
    ref = hf_greedy(target, PROMPT, 30)
    other = tiny_model(arch, seed=7, layers=1)
    ids, s = run(Decoder(target, DraftModelDrafter(other, vocab(target))), PROMPT, 30, SamplingParams(),
                 make_policy("constant", 3))
    assert ids == ref
    # the target drafting for itself on its own (exact) matmul route: every draft is what it verifies
    ids, s = run(Decoder(target, DraftModelDrafter(target, vocab(target), exact=True)), PROMPT, 30, SamplingParams(),
                 make_policy("constant", 4))
    assert ids == ref
    assert s.acceptance_rate == 1.0
    assert s.target_forwards <= 1 + -(-29 // 5)    # prefill, then 5 tokens per round
    # vLLM's definition: 1 + accepted / draft rounds; the prefill forward verifies no draft
    assert s.draft_rounds == s.target_forwards - 1
    assert s.accepted_tokens == s.new_tokens - s.target_forwards     # each forward adds accepted + 1
    assert s.mean_accepted_length == pytest.approx(1 + s.accepted_tokens / s.draft_rounds)
    assert s.mean_accepted_length > 4.5       # full rounds give 5 tokens; only the last is cut by the budget


@pytest.mark.parametrize("budget", [1, 2, 5, 7, 11])
def test_max_new_tokens_reached_mid_round(budget):
    target = tiny_model("llama")
    ref = hf_greedy(target, PROMPT, budget)
    ids, s = run(Decoder(target, DraftModelDrafter(target, vocab(target))), PROMPT, budget, SamplingParams(),
                 make_policy("constant", 4))
    assert ids == ref and len(ids) == budget
    assert s.finish_reason == "length"


def test_eos_inside_a_draft_stops_exactly():
    target = tiny_model("llama")
    free = hf_greedy(target, PROMPT, 40)
    eos = free[9]                                  # a token the model will emit at step 10
    ref = hf_greedy(target, PROMPT, 40, eos=eos)
    assert ref[-1] == eos and len(ref) <= 10
    for draft in (target, noisy_copy(target, 0.03)):
        dec = Decoder(target, DraftModelDrafter(draft, vocab(target)), eos_token_ids=[eos])
        ids, s = run(dec, PROMPT, 40, SamplingParams(), make_policy("constant", 6))
        assert ids == ref
        assert s.finish_reason == "eos" and s.new_tokens == len(ref)


def test_context_length_is_respected():
    target = tiny_model("llama")              # 256 positions
    prompt = PROMPT * 35                      # 245 tokens
    ids, s = run(Decoder(target, DraftModelDrafter(target, vocab(target))), prompt, 100, SamplingParams(),
                 make_policy("constant", 4))
    assert len(prompt) + len(ids) == 256 and s.finish_reason == "context"
    assert ids == hf_greedy(target, prompt, 11)


def test_prompt_longer_than_context_is_refused():
    from dynchat.engine.decoder import PromptTooLong

    with pytest.raises(PromptTooLong, match="context length is 256"):
        run(Decoder(tiny_model("llama")), PROMPT * 40, 10)


def test_stop_flag_ends_generation_promptly():
    target = tiny_model("llama")
    stop = threading.Event()
    dec = Decoder(target, DraftModelDrafter(target, vocab(target)))
    events = []
    for ev in dec.generate(PROMPT, 200, SamplingParams(), make_policy("constant", 3), stop):
        events.append(ev)
        if len(events) == 2:
            stop.set()
    summary = events[-1]
    assert summary.finish_reason == "stopped"
    assert len(events) == 3          # the two rounds seen, then the summary: no round after the stop
    assert summary.new_tokens == sum(len(e.token_ids) for e in events[:-1])


def test_events_describe_each_round():
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.03)
    dec = Decoder(target, DraftModelDrafter(draft, vocab(target)))
    events = list(dec.generate(PROMPT, 40, SamplingParams(), make_policy("constant", 3)))
    rounds, summary = events[:-1], events[-1]
    assert rounds[0].drafted == 0 and rounds[0].token_ids   # prefill
    for ev in rounds[1:]:
        assert ev.drafted <= 3 and ev.accepted <= ev.drafted
        assert ev.from_draft == [True] * ev.accepted + [False] * (len(ev.token_ids) - ev.accepted)
    assert summary.accepted_tokens == sum(e.accepted for e in rounds)
    assert summary.draft_tokens == sum(e.drafted for e in rounds)
    assert summary.acceptance_rate == pytest.approx(summary.accepted_tokens / summary.draft_tokens)
    pp = summary.per_position_acceptance()
    assert len(pp) == 3 and all(0 <= x <= 1 for x in pp) and pp == sorted(pp, reverse=True)


@pytest.mark.parametrize("start_after", [0, 9])
def test_a_draft_that_starts_late_reads_the_prompt_once_and_stays_lossless(start_after):
    """An assistant that waits `start_after` tokens runs nothing for a reply that ends before then;
    after, its first round catches up on prompt and reply in one forward (draft_s, not a round's cost)."""
    target = tiny_model("llama")
    drafter = DraftModelDrafter(noisy_copy(target, 0.03), vocab(target), start_after=start_after)
    fed = []
    forward = drafter.lm.forward
    drafter.lm.forward = lambda ids, **kw: fed.append(ids.numel()) or forward(ids, **kw)
    ref = hf_greedy(target, PROMPT, 30)
    short, s = run(Decoder(target, drafter), PROMPT, 8, SamplingParams(), make_policy("constant", 3))
    assert short == ref[:8]
    assert (fed == [] and s.draft_tokens == 0) if start_after else (fed and s.draft_tokens > 0)
    fed.clear()
    events = list(Decoder(target, drafter).generate(PROMPT, 30, SamplingParams(), make_policy("constant", 3)))
    rounds, summary = events[:-1], events[-1]
    assert [t for e in rounds for t in e.token_ids] == ref and summary.draft_tokens > 0
    first = next(i for i, e in enumerate(rounds) if e.drafted)
    assert sum(len(e.token_ids) for e in rounds[:first]) >= start_after
    if start_after:       # one catch-up over the prompt and the reply so far, then steps of one or two tokens
        assert fed[0] >= len(PROMPT) + start_after - 1 and max(fed[1:]) <= 2


def test_warm_up_runs_an_assistant_that_starts_late():
    """The engine's warm-up generates 4 tokens per mode: a draft that waits 12 must still run in it,
    or the first real reply pays its first-use costs; its start is kept afterwards."""
    import dataclasses

    from dynchat.presets.config import get_preset
    from dynchat.presets.loading import load_engine
    from dynchat.presets.runtime import ASSISTANT_START_AFTER

    demo = get_preset("demo")
    engine = load_engine(dataclasses.replace(demo, generation={**demo.generation,
                                                               "assistant_start_after": ASSISTANT_START_AFTER}))
    drafter = engine.decoder("assistant").drafter.model
    assert drafter.start_after == ASSISTANT_START_AFTER
    fed, forward = [], drafter.lm.forward
    drafter.lm.forward = lambda ids, **kw: fed.append(ids.numel()) or forward(ids, **kw)
    engine.warm_up()
    del drafter.lm.forward
    assert fed and drafter.start_after == ASSISTANT_START_AFTER


def test_a_draft_with_its_own_vocabulary_drafts_what_the_target_wide_choice_would():
    """A draft that proposes from part of the vocabulary (SmolLM2's: 4,096 of 49,152 tokens) chooses its greedy
    drafts among its own logits and names them by target id: the same tokens, with the same confidences, as
    the choice among its logits spread over the target's vocabulary; and decoding stays lossless."""
    target = tiny_model("llama")
    draft = noisy_copy(target, 0.03)
    v = vocab(target)
    draft.draft_vocab_ids = torch.randperm(v, generator=torch.Generator().manual_seed(3))[: v // 2]   # unsorted
    narrow = DraftModelDrafter(draft, v)
    wide = DraftModelDrafter(draft, v)
    wide._target_ids = None                       # the choice over the target's width, as before
    assert narrow._target_ids is not None and narrow.lm.vocab_size == v // 2
    sampler = Sampler(SamplingParams(), torch.device("cpu"))
    committed = torch.tensor(PROMPT + [3, 11])
    for read_once in (False, True):               # True: an accelerator's way, confidences read once a round
        proposals = []
        for drafter in (narrow, wide):
            drafter.read_once = read_once
            drafter.reset()
            drafter.prefill(committed)
            proposals.append(drafter.propose(committed, 5, Dynamic(5, threshold=0.0), sampler))  # reads confidences
        a, b = proposals
        assert a.tokens.tolist() == b.tokens.tolist() and len(a.tokens) == 5
        assert all(t in set(draft.draft_vocab_ids.tolist()) for t in a.tokens.tolist())
        assert a.confidences == pytest.approx(b.confidences, rel=1e-5)
    base, _ = run(Decoder(target), PROMPT, 40)
    out, s = run(Decoder(target, DraftModelDrafter(draft, v)), PROMPT, 40, policy=make_policy("constant", 3))
    assert out == base and s.draft_tokens > 0

"""A follow-up turn prefills only what is new: the target cache still holds the last generation's
sequence. On the native routes positions after the first prefill are computed alike however they
are batched, so a kept cache equals a fresh prefill bit for bit (a first prompt of PREFILL_ROWS
tokens or more is prefilled by one batched matmul: there the replies are compared); anything that
touched the cache since (another reset, a generation closed half way) means a full prefill."""
from __future__ import annotations

import pytest
import torch

from dynchat.engine import lean
from dynchat.engine.decoder import Decoder, run
from dynchat.engine.forward import make_lm, verify_cost_curve
from dynchat.presets.config import get_preset
from dynchat.presets.loading import load_engine

FIRST = "What does the function json.dumps do?"
FOLLOW_UP = " Can you give me an example with a nested dictionary, please?"


@pytest.fixture(scope="module")
def engine():
    mp = pytest.MonkeyPatch()
    mp.setenv("DYNCHAT_LINEAR", "native")
    yield load_engine(get_preset("demo"))
    mp.undo()


def _fed(decoder):
    """Spy: the number of tokens of each target forward."""
    sizes, forward = [], decoder.target.forward

    def spy(ids, *a, **k):
        sizes.append(ids.numel())
        return forward(ids, *a, **k)
    decoder.target.forward = spy
    return sizes


def _turns(engine):
    first = engine.encode(FIRST)
    assert len(first) < lean.PREFILL_ROWS          # prefilled by the native kernels, as steps are
    return first, engine.tokenizer(FOLLOW_UP, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("mode", ["baseline", "eagle3"])
def test_a_follow_up_prefills_only_the_new_tokens_and_decodes_the_same(engine, mode):
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no native kernels on this machine")
    first, more = _turns(engine)
    decoder = engine.decoder(mode) if mode == "baseline" else engine.decoder(mode, tree=None)
    assert decoder.target.reuses_prefix
    reply, _ = run(decoder, first, 40)
    second = first + reply + more
    sizes = _fed(decoder)
    out, _ = run(decoder, second, 40)
    del decoder.target.forward
    assert sizes[0] in (len(more), len(more) + 1)     # the new tokens (and the reply's last, unless a verify held it)
    want, _ = run(Decoder(engine.target, eos_token_ids=engine.eos_token_ids), second, 40)
    assert out == want
    # the kept positions are bit for bit what the native kernels compute from scratch (fed in pieces
    # shorter than PREFILL_ROWS, so no batched prefill)
    fresh = make_lm(engine.target)
    n = len(second) - 1
    for s in range(0, n, 16):
        fresh.forward(torch.tensor(second[s:min(n, s + 16)]))
    assert torch.equal(decoder.target.k[:, :, :n], fresh.k[:, :, :n])


def test_anything_else_touching_the_cache_means_a_full_prefill(engine):
    first, more = _turns(engine)
    decoder = engine.decoder("baseline")
    reply, _ = run(decoder, first, 40)
    verify_cost_curve(decoder.target, sizes=(1, 2), repeats=1)           # overwrites the cache
    sizes = _fed(decoder)
    out, _ = run(decoder, first + reply + more, 40)
    shared = len(engine.shared_prefix)                                 # what every chat shares is kept apart
    assert sizes[0] == len(first + reply + more) - shared
    stream = decoder.generate(first + reply + more, 40)
    next(stream)
    stream.close()                                                     # a reply stopped half way
    out2, _ = run(decoder, first + reply + more, 40)
    del decoder.target.forward
    assert sizes[-len(out2)] == len(first + reply + more) - shared and out2 == out


def test_the_modes_of_an_engine_share_one_target_cache_and_its_history(engine):
    """One KV cache per model: a reply drafted by EAGLE-3 leaves its history for the next turn of
    any mode (the app's baseline comparison, or a reply in another mode)."""
    first, more = _turns(engine)
    eagle, plain = engine.decoder("eagle3", tree=None), engine.decoder("baseline")
    assert eagle.target is plain.target is engine.decoder("lookup").target
    reply, _ = run(eagle, first, 40)
    sizes = _fed(plain)
    out, _ = run(plain, first + reply + more, 40)
    del plain.target.forward
    assert sizes[0] <= len(more) + 1
    assert out == run(Decoder(engine.target, eos_token_ids=engine.eos_token_ids), first + reply + more, 40)[0]


def test_a_comparison_run_prefills_what_the_reply_prefilled(engine):
    """The app's baseline runs on the reply's own prompt, which the shared cache now holds whole:
    capped at the reply's reuse, it prefills the same tokens (a fair comparison)."""
    first, more = _turns(engine)
    eagle, plain = engine.decoder("eagle3", tree=None), engine.decoder("baseline")
    reply, _ = run(eagle, first, 40)
    prompt = first + reply + more
    _, summary = run(eagle, prompt, 40)
    assert 0 < summary.reused_tokens <= len(prompt) - len(more)
    sizes = _fed(plain)
    _, base = run(plain, prompt, 40, max_reuse=summary.reused_tokens)
    del plain.target.forward
    assert base.reused_tokens == summary.reused_tokens and sizes[0] == len(prompt) - summary.reused_tokens


def test_a_long_first_prompt_still_gives_the_replies_of_a_fresh_prefill(engine):
    """A first prompt long enough for the batched prefill: the follow-up's history then differs from a
    fresh prefill's in rounding only; the greedy replies agree."""
    first = engine.encode(FIRST + " " + " ".join(["Please explain it to me carefully, step by step."] * 6))
    assert len(first) >= lean.PREFILL_ROWS
    more = engine.tokenizer(FOLLOW_UP, add_special_tokens=False)["input_ids"]
    decoder = engine.decoder("baseline")
    reply, _ = run(decoder, first, 40)
    out, summary = run(decoder, first + reply + more, 40)
    assert summary.reused_tokens >= len(first + reply) - 1
    assert out == run(Decoder(engine.target, eos_token_ids=engine.eos_token_ids), first + reply + more, 40)[0]


def test_each_conversation_keeps_its_own_cache_between_its_turns(engine, monkeypatch):
    """Chats take turns on one engine: each follow-up still prefills only its new tokens, whatever ran
    in between, and decodes what a fresh prefill decodes; past KEPT_SESSIONS conversations the least
    recently used one starts over with a full prefill."""
    monkeypatch.setattr(lean, "KEPT_SESSIONS", 2)
    first, more = _turns(engine)
    other = engine.encode("How do I read a file line by line?")
    third = engine.encode("What is a list comprehension?")
    decoder = engine.decoder("baseline")
    reply_a, _ = run(decoder, first, 40, session="a")
    reply_b, _ = run(decoder, other, 40, session="b")          # another chat between a's turns
    sizes = _fed(decoder)
    out, _ = run(decoder, first + reply_a + more, 40, session="a")
    assert sizes[0] in (len(more), len(more) + 1)
    assert out == run(Decoder(engine.target, eos_token_ids=engine.eos_token_ids), first + reply_a + more, 40)[0]
    run(decoder, third, 8, session="c")                        # a third chat: "b" was used least recently
    sizes.clear()
    run(decoder, other + reply_b + more, 8, session="b")
    del decoder.target.forward
    assert sizes[0] == len(other + reply_b + more) - len(engine.shared_prefix)   # dropped: prefilled again
    assert len(decoder.target._kept) + 1 <= 2                  # never more caches than kept sessions


def test_the_assistant_keeps_its_cache_per_conversation_too(engine):
    """The draft model's cache is kept per chat like the target's: a follow-up's first draft round
    catches up on the new tokens only, another chat in between changes nothing, the output is plain
    decoding's; a comparison capped at no reuse (the bench) makes the draft read everything again."""
    from dynchat.engine.policies import make_policy

    first = engine.encode("The os module provides", raw=True)         # replies long enough to draft
    more = engine.tokenizer(" The json module provides", add_special_tokens=False)["input_ids"]
    decoder = engine.decoder("assistant", lookup=False)
    drafter = decoder.drafter
    fed, forward = [], drafter.lm.forward
    drafter.lm.forward = lambda ids, **kw: fed.append(ids.numel()) or forward(ids, **kw)
    policy = make_policy("constant", 3)
    reply, _ = run(decoder, first, 40, policy=policy, session="a")
    run(decoder, engine.encode("The sys module", raw=True), 40, policy=policy, session="b")
    fed.clear()
    second = first + reply + more
    out, summary = run(decoder, second, 40, policy=policy, session="a")
    # the new message, the reply's last few tokens (a draft reads a token the round after it is committed)
    # and those of the new reply before it starts; not the history
    assert summary.draft_tokens > 0 and max(fed) <= len(more) + drafter.start_after + 4 < len(first + reply)
    assert out == run(engine.decoder("baseline"), second, 40)[0]
    fed.clear()
    run(decoder, second, 40, policy=policy, session="a", max_reuse=0)
    del drafter.lm.forward
    assert fed[0] >= len(second) - 1


def test_a_draft_model_joining_a_long_chat_reads_a_window_and_keeps_it(engine):
    """A chat that ran in another mode, then the assistant: its draft model reads only the catch-up
    window (not the conversation), the next turn reads only the new tokens (the windowed cache is
    kept), and both replies are plain decoding's."""
    from dynchat.engine.policies import make_policy

    decoder = engine.decoder("assistant", lookup=False)
    drafter = decoder.drafter
    fed, forward, window = [], drafter.lm.forward, drafter.catch_up_window
    drafter.lm.forward = lambda ids, **kw: fed.append(ids.numel()) or forward(ids, **kw)
    new = engine.tokenizer(" The sys module", add_special_tokens=False)["input_ids"]
    follow_up = len(new) + drafter.start_after + 4      # what a kept cache reads at a follow-up's first draft
    drafter.catch_up_window = follow_up + 8             # ... and a window read again would be more
    try:
        policy = make_policy("constant", 3)
        first = engine.encode("The os module provides", raw=True)
        reply, _ = run(engine.decoder("baseline"), first, 40, session="w")       # the draft model never ran
        more = engine.tokenizer(" The json module provides", add_special_tokens=False)["input_ids"]
        second = first + reply + more
        out, summary = run(decoder, second, 40, policy=policy, session="w")
        assert summary.draft_tokens > 0 and max(fed) <= follow_up + 8 < len(second) - drafter.start_after
        assert out == run(engine.decoder("baseline"), second, 40)[0]
        fed.clear()
        third = second + out + new
        out3, summary = run(decoder, third, 40, policy=policy, session="w")
        assert summary.draft_tokens > 0 and fed[0] <= follow_up
        assert out3 == run(engine.decoder("baseline"), third, 40)[0]
    finally:
        del drafter.lm.forward
        drafter.catch_up_window = window


@pytest.mark.parametrize("mode", ["baseline", "eagle3"])
def test_a_new_chat_prefills_only_what_follows_the_start_all_chats_share(engine, mode):
    """The chat template's start (its system prompt) is every chat's: a new conversation takes its
    cache rows (keys, values and the EAGLE-3 features), computed once from the prefix alone, so it
    prefills its message only, and holds exactly what a full prefill of its prompt computes (the native
    rows are computed alike however they are batched). A prompt that does not begin so, and a run
    capped at no reuse (a comparison with one that reused nothing), prefill everything."""
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no native kernels on this machine")
    shared = engine.shared_prefix
    first, other = engine.encode(FIRST), engine.encode("How do I read a file line by line?")
    assert len(shared) >= 2 and first[:len(shared)] == other[:len(shared)] == list(shared)
    decoder = engine.decoder(mode) if mode == "baseline" else engine.decoder(mode, tree=None)
    run(decoder, first, 20, session="first chat")
    sizes = _fed(decoder)
    out, summary = run(decoder, other, 40, session="a new chat")
    assert summary.reused_tokens == len(shared) and sizes[0] == len(other) - len(shared)
    target, n = decoder.target, len(other)
    adopted = [t[..., :n, :].clone() for t in (target.k, target.v)] + [target.features[:n].clone()] \
        if target.features is not None else [t[..., :n, :].clone() for t in (target.k, target.v)]
    sizes.clear()
    again, fresh = run(decoder, other, 40, max_reuse=0, session="compared with nothing reused")
    assert fresh.reused_tokens == 0 and sizes[0] == len(other)
    full = [t[..., :n, :] for t in (target.k, target.v)] + ([target.features[:n]] if target.features is not None else [])
    assert all(torch.equal(a, b) for a, b in zip(adopted, full))
    assert mode == "baseline" or target.features is not None        # EAGLE-3's features came along
    assert out == again == run(engine.decoder("baseline"), other, 40, max_reuse=0)[0]
    sizes.clear()
    raw = engine.encode("How do I read a file", raw=True)            # no chat template: nothing shared
    run(decoder, raw, 8, session="a plain text prompt")
    del decoder.target.forward
    assert sizes[0] == len(raw)


def test_the_eagle3_head_keeps_its_cache_per_conversation_too(engine):
    """The head's own cache is kept per chat like the target's: a follow-up's first draft reads only the
    positions the head has not seen (not the history), a new chat takes the shared start's positions
    from the last chat, and either drafts exactly what a head reading everything afresh drafts."""
    from dynchat.engine.native import library
    from dynchat.engine.policies import Constant

    if library() is None:
        pytest.skip("no native kernels on this machine")
    decoder = engine.decoder("eagle3", tree=None, lookup=False)
    head = decoder.drafter
    fed, drafts, forward, propose = [], [], head._forward, head.propose
    head._forward = lambda hidden, tokens, *a: fed.append(tokens.numel()) or forward(hidden, tokens, *a)

    def recorded(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafts.append(proposal.tokens.tolist())
        return proposal
    head.propose = recorded

    def chat(prompt, session, max_reuse=None):
        fed.clear()
        drafts.clear()
        out, _ = run(decoder, prompt, 40, policy=Constant(3), session=session, max_reuse=max_reuse)
        return out, list(drafts), fed[0] if fed else 0       # the positions its first draft read

    first, other = engine.encode(FIRST), engine.encode("How do I read a file line by line?")
    chat(first, "a")
    shared = len(engine.shared_prefix)
    _, new_drafts, read = chat(other, "b")                           # a new chat
    assert read == len(other) + 1 - 2 - (shared - 1)                # the shared start not read again
    assert chat(other, "d", max_reuse=0)[1] == new_drafts            # what reading it afresh drafts
    start = engine.encode("The os module provides", raw=True)       # replies long enough to draft
    more = engine.tokenizer(" The json module provides", add_special_tokens=False)["input_ids"]
    reply, _, _ = chat(start, "c")
    chat(other, "b")                                                 # another chat in between
    second = start + reply + more
    kept, kept_drafts, kept_read = chat(second, "c")
    fresh, fresh_drafts, fresh_read = chat(second, "c", max_reuse=0)  # a comparison with nothing reused
    del head._forward, head.propose
    assert kept_read <= len(more) + 2 < len(start + reply) and fresh_read == len(second) + 1 - 2
    assert kept_drafts == fresh_drafts and kept == fresh == run(engine.decoder("baseline"), second, 40)[0]


def test_a_new_chat_s_draft_model_skips_the_shared_start_too(engine):
    """The assistant's draft model (same tokenizer) keeps the shared start's rows as the target does: a
    new chat's first draft round reads what follows them only, and the reply is plain decoding's."""
    from dynchat.engine.policies import make_policy

    decoder = engine.decoder("assistant", lookup=False)
    drafter, shared = decoder.drafter, len(engine.shared_prefix)
    fed, forward = [], drafter.lm.forward
    drafter.lm.forward = lambda ids, **kw: fed.append(ids.numel()) or forward(ids, **kw)
    policy = make_policy("constant", 3)
    first, other = engine.encode(FIRST), engine.encode("How do I read a file line by line?")
    run(decoder, first, 40, policy=policy, session="a")
    fed.clear()
    out, summary = run(decoder, other, 40, policy=policy, session="b")
    del drafter.lm.forward
    assert summary.draft_tokens > 0
    assert fed[0] == len(other) + drafter.start_after - shared     # the prompt after the shared start, the reply so far
    assert out == run(engine.decoder("baseline"), other, 40, max_reuse=0)[0]


def test_the_shared_rows_are_the_same_whatever_prompt_came_first(engine):
    """The shared start's rows are computed from it alone: a long first prompt (prefilled by one
    batched matmul on a float route) leaves the same rows as a short one (the native rows), so a new
    chat's reply never depends on what ran first since the engine loaded."""
    decoder = engine.decoder("baseline")
    lm = decoder.target
    long_first = engine.encode(FIRST + " " + " ".join(["Please explain it to me carefully, step by step."] * 6))
    assert len(long_first) >= lean.PREFILL_ROWS and not lm.int8_activations
    kept = []
    for first, session in ((long_first, "long first"), (engine.encode(FIRST), "short first")):
        lm._shared = None                     # as after loading
        run(decoder, first, 4, session=session)
        kept.append([t.clone() for t in lm._shared if t is not None])
    assert all(torch.equal(a, b) for a, b in zip(*kept))


@pytest.mark.parametrize("mode", ["baseline", "eagle3"])
def test_a_long_prompt_is_prefilled_on_every_core_and_the_reply_decoded_on_the_app_s(engine, mode, monkeypatch):
    """An app on a small machine decodes on one thread fewer than its cores (the browser renders every
    round) but prefills a long prompt, while the page waits, on all of them (Decoder.prompt_threads):
    the reply is the same, and the thread count is back for the rounds and after; a short prompt
    stays on the app's threads."""
    long_prompt = engine.encode(FIRST + " Please explain every argument it takes, what each one changes in the "
                                "output, and show a short example for each of them." * 3)
    assert len(long_prompt) >= Decoder.PROMPT_THREADS_ROWS + 24      # more than a shared system prompt
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decoder = engine.decoder(mode)
        decoder.target.reset()
        alone, _ = run(decoder, long_prompt, 24)
        monkeypatch.setattr(Decoder, "prompt_threads", 2)
        threads, forward = [], decoder.target.forward

        def spy(x, *a, **k):
            threads.append(torch.get_num_threads())
            return forward(x, *a, **k)
        monkeypatch.setattr(decoder.target, "forward", spy)
        decoder.target.reset()
        wide, _ = run(decoder, long_prompt, 24)
        assert wide == alone
        assert threads[0] == 2 and len(threads) > 2 and set(threads[1:]) == {1}
        assert torch.get_num_threads() == 1
        threads.clear()
        decoder.target.reset()
        run(decoder, engine.encode(FIRST), 8)
        assert set(threads) == {1}
    finally:
        torch.set_num_threads(before)

"""Assistant with a different tokenizer (universal assisted generation): lossless, aligned, unmodified."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import ALPHA, DEMO_TOKENIZER, ROOT, chi2_pvalue
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.drafters import DraftModelDrafter
from dynchat.engine.other_tokenizer import OtherTokenizerDrafter
from dynchat.engine.policies import make_policy
from dynchat.engine.sampling import Sampler, SamplingParams

TEXTS = ["Hi", "What does the function json.dumps do?", "naïve café — 日本語 🙂 ünïcödé", "x"]


@pytest.fixture(scope="module")
def target_tok():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory, target_tok):
    """A genuinely different byte-level BPE (600 tokens, trained on this repo's own text)."""
    from dynchat.train.data import train_tokenizer

    texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "dynchat").rglob("*.py"))]
    out = tmp_path_factory.mktemp("small-tok")
    return train_tokenizer([{"text": t} for t in texts], 600, out)


def permuted(tok, seed: int = 0):
    """The same tokenizer with its non-special ids shuffled, and the id map new -> old."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    js = json.loads(tok.backend_tokenizer.to_str())
    special = {t["id"] for t in js["added_tokens"]}
    ids = sorted(i for i in js["model"]["vocab"].values() if i not in special)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    mapping = {i: ids[perm[n]] for n, i in enumerate(ids)}
    js["model"]["vocab"] = {s: mapping.get(i, i) for s, i in js["model"]["vocab"].items()}
    new = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(js)), eos_token=tok.eos_token,
                                  bos_token=tok.bos_token, pad_token=tok.pad_token)
    new_to_old = torch.arange(len(tok))
    for old, n in mapping.items():
        new_to_old[n] = old
    return new, new_to_old


def tiny(vocab: int, seed: int, eos: int, std: float = 0.5):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, eos_token_id=eos, bos_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


def prompt_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


@pytest.mark.parametrize("eos_happy", [False, True], ids=["plain", "draft-emits-eos"])
def test_greedy_equals_plain_decoding_across_tokenizers(target_tok, small_tok, eos_happy):
    target = tiny(len(target_tok), 0, target_tok.eos_token_id)
    draft = tiny(len(small_tok), 1, small_tok.eos_token_id)
    if eos_happy:        # the draft proposes its EOS often: EOS inside drafts gets exercised
        with torch.no_grad():
            draft.lm_head.weight[small_tok.eos_token_id] *= 4
    drafter = OtherTokenizerDrafter(draft, small_tok, target_tok, [target_tok.eos_token_id], len(target_tok))
    for text in TEXTS:
        ids = prompt_ids(target_tok, text)
        ref, _ = run(Decoder(target), ids, 50)
        for policy in ("constant", "heuristic", "dynamic"):
            out, s = run(Decoder(target, drafter), ids, 50, policy=make_policy(policy, 4))
            assert out == ref, (text, policy)
            assert s.draft_tokens >= s.accepted_tokens


def test_raw_prompt_of_one_token(target_tok, small_tok):
    target = tiny(len(target_tok), 0, target_tok.eos_token_id)
    draft = tiny(len(small_tok), 1, small_tok.eos_token_id)
    drafter = OtherTokenizerDrafter(draft, small_tok, target_tok, [target_tok.eos_token_id], len(target_tok))
    ids = target_tok("é", add_special_tokens=False)["input_ids"][:1]     # half a character
    ref, _ = run(Decoder(target), ids, 30)
    assert run(Decoder(target, drafter), ids, 30, policy=make_policy("constant", 3))[0] == ref


@pytest.fixture(scope="module")
def demo_pair():
    from transformers import AutoModelForCausalLM

    def load(name):
        return AutoModelForCausalLM.from_pretrained(ROOT / "data" / "models" / name, dtype=torch.float32).eval()

    return load("demo-target"), load("demo-draft")


def test_same_draft_through_a_shuffled_vocabulary_is_accepted_as_often(target_tok, demo_pair):
    """The demo draft with its token ids shuffled: only the text connects it to the target, and it
    should still be accepted nearly as often as with the shared tokenizer (alignment works)."""
    target, draft = demo_pair
    ptok, new_to_old = permuted(target_tok)
    shuffled = LlamaForCausalLM(draft.config).eval()
    shuffled.load_state_dict(draft.state_dict())
    with torch.no_grad():
        shuffled.model.embed_tokens.weight.copy_(draft.model.embed_tokens.weight[new_to_old])
        if not draft.config.tie_word_embeddings:
            shuffled.lm_head.weight.copy_(draft.lm_head.weight[new_to_old])
    uag = OtherTokenizerDrafter(shuffled, ptok, target_tok, [target_tok.eos_token_id], len(target_tok))
    same = DraftModelDrafter(draft, len(target_tok))
    rates = []
    for text in ("What does the function json.dumps do?", "What is the collections module for?"):
        ids = prompt_ids(target_tok, text)
        ref, _ = run(Decoder(target), ids, 80)
        out, s_uag = run(Decoder(target, uag), ids, 80, policy=make_policy("constant", 3))
        _, s_same = run(Decoder(target, same), ids, 80, policy=make_policy("constant", 3))
        assert out == ref
        rates.append((s_uag.acceptance_rate, s_same.acceptance_rate))
    uag_rate, same_rate = np.mean(rates, axis=0)
    assert same_rate > 0.5 and uag_rate > 0.85 * same_rate, rates


def test_assistant_model_and_tokenizers_are_not_modified(target_tok, small_tok):
    target = tiny(len(target_tok), 0, target_tok.eos_token_id)
    draft = tiny(len(small_tok), 1, small_tok.eos_token_id)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    config_before, gen_before = draft.config.to_dict(), draft.generation_config.to_dict()
    vocab_before = small_tok.get_vocab()
    drafter = OtherTokenizerDrafter(draft, small_tok, target_tok, [target_tok.eos_token_id], len(target_tok))
    ids = prompt_ids(target_tok, "Hello there")
    run(Decoder(target, drafter), ids, 30, policy=make_policy("dynamic"))
    run(Decoder(target, drafter), ids, 30, SamplingParams(1.0, seed=0), make_policy("constant", 3))
    after = draft.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert draft.config.to_dict() == config_before and draft.generation_config.to_dict() == gen_before
    assert small_tok.get_vocab() == vocab_before


def test_sampling_drafts_only_shared_tokens(target_tok, small_tok):
    draft = tiny(len(small_tok), 1, small_tok.eos_token_id)
    drafter = OtherTokenizerDrafter(draft, small_tok, target_tok, [target_tok.eos_token_id], len(target_tok))
    assert 100 < drafter.shared_vocabulary < len(small_tok)      # some tokens exist in one vocabulary only
    shared_target = set(drafter.shared_target_ids.tolist())
    committed = torch.tensor(prompt_ids(target_tok, "naïve café"))
    drafter.reset()
    sampler = Sampler(SamplingParams(1.0, seed=3), torch.device("cpu"))
    proposal = drafter.propose(committed, 4, make_policy("constant", 4), sampler)
    assert proposal.probs.shape == (proposal.tokens.numel(), len(target_tok))
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(proposal.tokens.numel()))
    outside = torch.ones(len(target_tok), dtype=torch.bool)
    outside[list(shared_target)] = False
    assert float(proposal.probs[:, outside].sum()) == 0.0
    assert set(proposal.tokens.tolist()) <= shared_target


@torch.no_grad()
def topk_marginals(model, prompt, params: SamplingParams, depth: int) -> list[np.ndarray]:
    """Exact marginals of positions 1..depth under a top-k warped target (enumerates only tokens with mass)."""
    sampler = Sampler(params, torch.device("cpu"))
    marg, prefixes, weights = [], [()], np.array([1.0])
    for _ in range(depth):
        batch = torch.tensor([prompt + list(p) for p in prefixes])
        probs = sampler.probs(model(input_ids=batch).logits[:, -1]).double().numpy()
        marg.append((weights[:, None] * probs).sum(0))
        nxt, w = [], []
        for i, pre in enumerate(prefixes):
            for v in np.nonzero(probs[i])[0]:
                nxt.append(pre + (int(v),))
                w.append(weights[i] * probs[i, v])
        prefixes, weights = nxt, np.array(w)
    return marg


@pytest.mark.slow                    # statistical: ~1,500 seeded generations
def test_sampling_preserves_the_target_distribution(target_tok):
    """Draft = a noisy copy of the target behind a shuffled vocabulary; top-k 5 keeps enumeration exact."""
    target = tiny(len(target_tok), 0, target_tok.eos_token_id, std=0.3)
    ptok, new_to_old = permuted(target_tok)
    draft = LlamaForCausalLM(target.config).eval()
    draft.load_state_dict(target.state_dict())
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
        draft.model.embed_tokens.weight.copy_(draft.model.embed_tokens.weight[new_to_old].clone())
        draft.lm_head.weight.copy_(draft.lm_head.weight[new_to_old].clone())
    prompt = prompt_ids(target_tok, "Hello")
    params = SamplingParams(1.0, top_k=5)
    expected = topk_marginals(target, prompt, params, depth=3)
    dec = Decoder(target, OtherTokenizerDrafter(draft, ptok, target_tok, [target_tok.eos_token_id], len(target_tok)))
    draws, accepted = [], 0
    for i in range(1500):
        ids, s = run(dec, prompt, 3, SamplingParams(1.0, top_k=5, seed=500 + i), make_policy("constant", 2))
        draws.append(ids)
        accepted += s.accepted_tokens
    assert accepted > 300, "drafts must get accepted for the test to mean anything"
    for pos in (1, 2):
        assert chi2_pvalue([d[pos] for d in draws], expected[pos]) > ALPHA, f"position {pos + 1}"


def test_committed_text_is_tokenised_a_tail_at_a_time(target_tok):
    """Round after round of a long reply, the draft tokens of the committed text are what tokenising
    it whole gives, while the tokenizer sees only a bounded tail per round (not the whole reply)."""
    from dynchat.engine.other_tokenizer import TextMirror

    draft_tok = AutoTokenizer.from_pretrained(ROOT / "data" / "models" / "demo-draft-bpe3k")
    from dynchat.train.chat_data import PARAGRAPHS

    text = "\n\n".join(PARAGRAPHS + PARAGRAPHS[::-1]) + " `code` -- naïve café 日本語 🙂"
    ids = target_tok(text, add_special_tokens=False)["input_ids"]
    mirror = TextMirror(target_tok, draft_tok)
    rng = np.random.default_rng(0)
    n, rounds, per_round = 0, 0, []
    while n < len(ids):
        n = min(len(ids), n + int(rng.integers(1, 5)))
        before = mirror.tokenized_chars
        got = mirror.update(ids[:n])
        if got is None:                       # the text ends inside a character: nothing to draft from yet
            assert target_tok.decode(ids[:n]).endswith("\ufffd")
            continue
        assert got == draft_tok(target_tok.decode(ids[:n]), add_special_tokens=True)["input_ids"]
        per_round.append(mirror.tokenized_chars - before)
        rounds += 1
    assert rounds > 100 and len(text) > 2000
    assert max(per_round[20:]) < 200                  # a tail, however long the reply has grown
    mirror.update(ids[:10])                           # a shorter sequence (a new chat) starts over
    assert mirror.draft_ids == draft_tok(target_tok.decode(ids[:10]), add_special_tokens=True)["input_ids"]

"""Our lean Llama-family forward matches the Transformers modules it replaces."""
from __future__ import annotations

import pytest
import torch
from conftest import noisy_copy, tiny_config, tiny_model

from dynchat.engine.decoder import Decoder, run
from dynchat.engine.drafters import DraftModelDrafter
from dynchat.engine.forward import make_lm
from dynchat.engine.lean import LeanLM, supports
from dynchat.engine.model import CachedLM
from dynchat.engine.policies import make_policy
from dynchat.engine.sampling import SamplingParams

LEAN_ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("linear", ["plain", "onednn"])
@pytest.mark.parametrize("arch", LEAN_ARCHS)
def test_logits_match_through_prefill_verify_and_rollback(arch, linear):
    model = tiny_model(arch)
    assert supports(model) and isinstance(make_lm(model), LeanLM)
    lean, ref = LeanLM(model, linear=linear), CachedLM(model)
    assert lean.route == linear
    tol = dict(rtol=1e-5, atol=1e-5) if linear == "plain" else dict(rtol=2e-4, atol=2e-4)   # oneDNN sums in another order
    steps = [torch.tensor([1, 5, 9, 3, 7, 11, 13]), torch.tensor([4, 5, 6, 7]), torch.tensor([8])]
    for ids in steps:
        torch.testing.assert_close(lean.forward(ids), ref.forward(ids), **tol)
    lean.rollback(9)
    ref.rollback(9)
    torch.testing.assert_close(lean.forward(torch.tensor([2, 3])), ref.forward(torch.tensor([2, 3])), **tol)


def test_sliding_window_and_cache_growth():
    from transformers import MistralForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("mistral")
    cfg.sliding_window = 8
    cfg.max_position_embeddings = 600
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    prompt = [1 + i % 90 for i in range(300)]  # grows the cache past its first allocation (256)
    x = torch.tensor([prompt])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=40, do_sample=False, pad_token_id=0,
                         eos_token_id=None)[0, len(prompt):].tolist()
    ids, _ = run(Decoder(model, DraftModelDrafter(noisy_copy(model, 0.03), 96)), prompt, 40, SamplingParams(),
                 make_policy("constant", 4))
    assert ids == ref


def test_transformers_backend_can_be_forced(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv("DYNCHAT_BACKEND", "transformers")
    assert isinstance(make_lm(model), CachedLM)
    assert isinstance(make_lm(model, "lean"), LeanLM)
    assert isinstance(make_lm(tiny_model("gpt2")), CachedLM)
    with pytest.raises(ValueError, match="does not support 'gpt2'"):
        make_lm(tiny_model("gpt2"), "lean")


def test_route_and_fused_weights_are_shared_per_model():
    model = tiny_model("llama")
    q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    a = LeanLM(model, linear="onednn")
    b = LeanLM(model)                    # auto: keeps the model's route
    assert a.prep is b.prep and b.route == "onednn"
    # the modules now read views of the fused tensor: same values, no second copy
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, q) and w.data_ptr() == a.prep.layers[0]["qkv"].data_ptr()


def test_greedy_speculative_equals_baseline_on_each_route():
    from dynchat.engine.native import library

    for linear in ("plain", "onednn") + (("native",) if library() is not None else ()):
        target = tiny_model("llama")
        draft = noisy_copy(target, 0.03)
        with pytest.MonkeyPatch.context() as env:      # the route the decoders' forwards choose at load
            env.setenv("DYNCHAT_LINEAR", linear)
            baseline, speculative = Decoder(target), Decoder(target, DraftModelDrafter(draft, 96))
        assert baseline.target.route == speculative.target.route == linear
        base, _ = run(baseline, list(range(1, 20)), 50)
        spec, s = run(speculative, list(range(1, 20)), 50, SamplingParams(), make_policy("dynamic"))
        assert spec == base and s.accepted_tokens > 0


def test_attention_folds_query_groups_and_flags_causal_prefill_without_changing_results():
    """The GPU-minded attention paths (grouped query heads folded into rows so a masked verify stays
    on fused kernels; a prefill's causal mask given as a flag) compute what the plain masked call does."""
    from dynchat.engine.layer import attend

    g = torch.Generator().manual_seed(0)
    n, heads, kv, hd, length = 5, 6, 2, 16, 12
    q = torch.randn(n, heads, hd, generator=g)
    k, v = torch.randn(1, kv, length, hd, generator=g), torch.randn(1, kv, length, hd, generator=g)
    mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    mask[2, 3] = False                                                   # any mask, e.g. a tree's
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1),
        attn_mask=mask)
    assert torch.allclose(attend(q, k, v, mask, fold=True), want, atol=1e-6)
    assert torch.allclose(attend(q, k, v, mask, fold=False), want, atol=1e-6)
    square = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.allclose(attend(q, k[:, :, :n], v[:, :, :n], causal=True),
                          attend(q, k[:, :, :n], v[:, :, :n], square), atol=1e-6)


def test_the_native_greedy_choice_is_torchs_argmax_on_ties_nan_and_infinities():
    """Greedy decoding picks through argmax.c where it is built: the same index as torch.argmax (first
    of equal maxima, first NaN), and the same accepted count as comparing the drafts with it."""
    from dynchat.engine.native import argmax, greedy_judge, library

    if library() is None:
        pytest.skip("native kernels not built here")
    torch.manual_seed(0)
    x = torch.randn(6, 49157)
    x[1, 5] = x[1, 40000] = float("nan")
    x[2] = float("-inf")
    x[3, 100] = x[3, 49155] = 50.0                    # a tie: the first wins
    x[4, 49156] = 60.0                                # the maximum in the row's last, partial vector
    x[5] = torch.randint(0, 3, (49157,)).float()      # many ties
    assert torch.equal(argmax(x), x.argmax(-1))
    row = x.argmax(-1)
    for drafts, accepted in ((row[:5], 5), (torch.cat([row[:2], row[2:5] + 1]), 2), (row[:0], 0)):
        k = drafts.numel()
        judged = greedy_judge(drafts, x[:k + 1].contiguous())
        assert judged[0].item() == accepted and torch.equal(judged[1:], row[:k + 1])


def test_the_native_forward_refuses_a_token_outside_the_vocabulary_and_keeps_its_cache():
    """The one-call native forward checks its ids before reading the embedding (as F.embedding does):
    an id outside the vocabulary raises IndexError, nothing is written, and decoding goes on."""
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    model = tiny_model("llama")
    lean = LeanLM(model, linear="native")
    assert lean.native is not None
    lean.forward(torch.tensor([1, 5, 9]))
    vocab = model.get_input_embeddings().weight.shape[0]
    for bad in (vocab, -1):
        with pytest.raises(IndexError, match="vocabulary"):
            lean.forward(torch.tensor([3, bad]))
        assert lean.length == 3
    again = LeanLM(model, linear="native")
    again.forward(torch.tensor([1, 5, 9]))
    torch.testing.assert_close(lean.forward(torch.tensor([4])), again.forward(torch.tensor([4])))

"""Weight-only int8 / int4 (models.yaml `quantization`): the quantized model is the target, so every
mode's greedy output equals plain decoding on the same weights, and the weights are named where a
user reads the metrics and in the log."""
from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
import torch

from dynchat.app.chat import ChatService
from dynchat.app.store import Store, StoreError
from dynchat.app.turns import Settings
from dynchat.bench.quality import compare, held_out_texts
from dynchat.engine.decoder import run
from dynchat.engine.eagle_drafter import TreeShape
from dynchat.engine.forward import make_lm
from dynchat.engine.policies import Constant, make_policy
from dynchat.engine.sampling import SamplingParams
from dynchat.presets.config import ConfigError, get_preset, load_presets
from dynchat.presets.loading import load_engine

PROMPTS = ["What does the function json.dumps do?", "Explain the os.path module.", "How do I sort a list?"]


@pytest.fixture(scope="module", params=["int8", "int8-pytorch-kernel", "int4"])
def engine(request):
    """int8 runs dynchat's native kernel where it builds; "int8-pytorch-kernel" is the route a machine
    without a C compiler or AVX2 takes (PyTorch's kernel)."""
    from dynchat.engine import native

    if request.param == "int8-pytorch-kernel":
        saved = os.environ.get("DYNCHAT_NATIVE")
        os.environ["DYNCHAT_NATIVE"] = "0"
        native.library.cache_clear()
        native.int8_gemm.cache_clear()
        try:
            e = load_engine(get_preset("demo"), quantization="int8")
            kernels = {w.native for w in _quant_weights(e)}      # weights are packed at the first forward made
        finally:
            os.environ.pop("DYNCHAT_NATIVE") if saved is None else os.environ.__setitem__("DYNCHAT_NATIVE", saved)
            native.library.cache_clear()
            native.int8_gemm.cache_clear()
        assert kernels == {False} and make_lm(e.target).native is None

        return e
    e = load_engine(get_preset("demo"), quantization=request.param)
    if request.param == "int8" and native.int8_gemm() is not None:
        assert {w.native for w in _quant_weights(e)} == {True}     # every int8 matmul of the demo on the kernel
        assert make_lm(e.target).native is not None                 # and its layers on the native decoder layer
    return e


def _quant_weights(engine):
    from dynchat.engine.linear import QuantWeight

    lm = make_lm(engine.target)
    return [w for layer in lm.weights for w in layer.values() if isinstance(w, QuantWeight)]


def greedy(engine, mode, ids, policy=None, tree=None):
    new, _ = run(engine.decoder(mode, tree=tree), ids, 40, SamplingParams(), policy)
    return new


def test_every_mode_equals_plain_decoding_on_the_quantized_weights(engine):
    assert engine.weights == engine.quantization
    assert engine.weights in ("int8", "int4")
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        plain = greedy(engine, "baseline", ids)
        assert len(plain) > 3
        assert greedy(engine, "assistant", ids, make_policy("dynamic")) == plain
        assert greedy(engine, "eagle3", ids, Constant(4), tree=None) == plain
        assert greedy(engine, "eagle3", ids, tree=TreeShape(4, 4, 12)) == plain


def test_a_verify_gives_the_same_logits_as_single_steps_bit_for_bit(engine):
    lm = make_lm(engine.target)
    assert lm.route == engine.quantization
    assert _quant_weights(engine)
    short = torch.tensor(engine.encode(PROMPTS[0]))
    for ids in (short, short.repeat(12)):       # a long context's keys are attended in two halves
        lm.reset()
        lm.forward(ids[:-4])
        together = lm.forward(ids[-4:])
        lm.rollback(len(ids) - 4)
        one_by_one = torch.cat([lm.forward(ids[i:i + 1]) for i in range(len(ids) - 4, len(ids))])
        assert torch.equal(together, one_by_one), len(ids)


def test_quantized_weights_keep_the_float_model_s_predictions(engine):
    """Next-token agreement with the float32 target over a prompt's positions (the quality cost)."""
    float_engine = load_engine(get_preset("demo"))
    table = compare({"float32": float_engine, engine.quantization: engine}, held_out_texts(["json", "heapq"]),
                    [engine.encode(p) for p in PROMPTS], context=256, max_new_tokens=24)
    mine, ref = table.loc[engine.quantization], table.loc["float32"]
    assert ref["next_token_agreement"] == 1.0 and ref["greedy_replies_identical"] == len(PROMPTS)
    assert mine["next_token_agreement"] >= (0.95 if engine.quantization == "int8" else 0.85)
    assert mine["perplexity"] <= ref["perplexity"] * (1.05 if engine.quantization == "int8" else 1.25)
    print(table.to_string())


def test_transformers_forward_refuses_quantized_weights(engine):
    with pytest.raises(ValueError, match="float weights"):
        make_lm(engine.target, backend="transformers")


def test_an_unknown_quantization_is_one_clear_line(tmp_path):
    (tmp_path / "models.yaml").write_text("presets:\n  a:\n    target: nobody/model\n    quantization: int3\n")
    with pytest.raises(ConfigError, match="quantization 'int3' is not one of none, int8, int4"):
        load_presets(tmp_path / "models.yaml")


def test_the_metrics_and_the_log_name_the_weights(tiny_preset, tmp_path):
    base = tiny_preset.parent
    (tmp_path / "models.yaml").write_text(
        "presets:\n  tiny-int4:\n"
        f"    target: {base / 'target'}\n    assistant: {base / 'draft'}\n    device: cpu\n    quantization: int4\n")
    service = ChatService(Store(tmp_path / "log.db"), tmp_path / "models.yaml", engine_process=False)
    *_, last = service.turn("s", [], "hello", Settings("tiny-int4", mode="assistant", max_new_tokens=8))
    assert last.status == "ok" and last.metrics["weights"] == "int4"
    assert list(service.store.session_turns("s")["weights"]) == ["int4"]


def test_a_log_from_another_schema_is_refused_in_one_line_and_kept(tmp_path):
    path = tmp_path / "old.db"
    Store(path).start_turn("s", "hi", preset="p", target="t", mode="baseline", max_new_tokens=4,
                           temperature=0.0, top_p=1.0)
    with sqlite3.connect(path) as conn:           # the log as an older version wrote it
        conn.execute("ALTER TABLE turns DROP COLUMN weights")
    with pytest.raises(StoreError, match="written by another version of dynchat .*lacks weights"):
        Store(path)
    with sqlite3.connect(path) as conn:           # nothing in it changed
        assert conn.execute("SELECT status FROM turns").fetchall() == [("running",)]


def test_quantizing_a_model_the_lean_forward_cannot_run_is_one_clear_line(tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from dynchat.presets.config import Preset
    from dynchat.presets.loading import ModelLoadError

    tok = AutoTokenizer.from_pretrained(get_preset("demo").target)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok))).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="int8 weights need a Llama-family model; the target is 'gpt2'"):
        load_engine(Preset(name="gpt2", target=str(tmp_path), device="cpu", quantization="int8"))


def test_native_int8_kernel_is_exact_per_row_and_independent_of_the_other_rows():
    """The AVX2 kernel: float32 accuracy against a float64 reference, and a row's result the same
    bits whether it is multiplied alone or with 4 / 8 / 16 others (what makes a verify exact)."""
    from dynchat.engine.linear import QuantWeight, quant_linear, quantize_weight
    from dynchat.engine.native import int8_gemm

    gemm = int8_gemm()
    if gemm is None:
        pytest.skip("no AVX2 CPU or no C compiler here: the int8 route uses PyTorch's kernel (tested above)")
    torch.manual_seed(0)
    w = torch.randn(200, 576)
    q = quantize_weight(8, w)
    assert isinstance(q, QuantWeight) and q.native and q.scales.dtype == torch.float32
    x = torch.randn(17, 576)
    ref = (x.double() @ q.data.double().T) * q.scales.double()
    y = quant_linear(x, q)
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    for m in (1, 2, 5, 9):
        assert torch.equal(quant_linear(x[:m], q), y[:m])
    assert torch.equal(torch.cat([quant_linear(x[i:i + 1], q) for i in range(17)]), y)
    odd = quantize_weight(8, torch.randn(64, 584))          # K % 16 != 0: PyTorch's kernel takes it
    assert isinstance(odd, QuantWeight) and not odd.native


def test_native_decoder_layer_computes_the_pytorch_layer():
    """int8 on the native decoder layer (norms, RoPE, grouped-query attention over the cache, SiLU MLP in C)
    against the same int8 weights through the PyTorch-op layer: the same logits up to float32 rounding,
    for a prefill, a single step and a 4-token verify, after a short prompt and after a long one (whose
    keys the native layer attends in two halves, merged)."""
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    engine = load_engine(get_preset("demo"), quantization="int8")
    native_lm, ops_lm = make_lm(engine.target), make_lm(engine.target)
    assert native_lm.native is not None
    ops_lm.native = None
    short = torch.tensor(engine.encode(PROMPTS[1]))
    for ids in (short, short.repeat(15)):
        for lm in (native_lm, ops_lm):
            lm.reset()
        for chunk in (ids[:-5], ids[-5:-4], ids[-4:]):
            a, b = native_lm.forward(chunk), ops_lm.forward(chunk)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())), len(ids)
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_long_prompt_prefills_in_one_batched_matmul_and_every_mode_still_equals_plain(engine):
    """A prompt of PREFILL_ROWS tokens or more is prefilled through BLAS matmuls on the native routes;
    steps and verifies after it stay on the native kernels, and every mode agrees with plain decoding."""
    from dynchat.engine import lean

    ids = engine.encode("Explain, step by step and with an example for each, what the modules json, os.path, "
                        "collections, itertools and functools of the standard library are for.")
    assert len(ids) >= lean.PREFILL_ROWS
    plain = greedy(engine, "baseline", ids)
    assert len(plain) > 3
    assert greedy(engine, "eagle3", ids, Constant(3)) == plain
    assert greedy(engine, "assistant", ids, make_policy("dynamic")) == plain


def _gguf_rounded(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w as GGUF's own quantizer and dequantizer leave it (a model loaded from such a file)."""
    from gguf import quants

    q = {"q4_1": quants.Q4_1, "q8_0": quants.Q8_0}[kind]
    blocks = q.quantize_blocks(w.detach().float().reshape(-1, 32).numpy())
    return torch.from_numpy(q.dequantize_blocks(blocks).astype("float32")).reshape(w.shape)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_gguf_blocks_rebuild_the_float_weights_and_multiply_to_the_same_bits(kind):
    """Weights dequantized from GGUF blocks are found to be such blocks and multiplied from them:
    exactly the float32 weights, the same bits as the float32 kernel, each row alone or with others."""
    from dynchat.engine.linear import QuantWeight, dequantized, gguf_weight, native_linear
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    torch.manual_seed(0)
    w = _gguf_rounded(torch.randn(203, 576) * 0.05, kind)
    q = gguf_weight(w)
    assert isinstance(q, QuantWeight) and q.format == kind
    assert q.data.numel() * q.data.element_size() == w.numel() // (2 if kind == "q4_1" else 1)
    assert torch.equal(dequantized(q), w) and torch.equal(dequantized(q.__class__(**{**vars(q), "dense": None})), w)
    x = torch.randn(17, 576)
    y = native_linear(x, q)
    assert torch.equal(y, native_linear(x, w))          # the float32 kernel on the float weights
    assert torch.allclose(y, x @ w.T, atol=1e-5)
    for m in (1, 2, 5, 9):
        assert torch.equal(native_linear(x[:m], q), y[:m])
    assert gguf_weight(torch.randn(64, 576)) is None     # weights that are no such blocks stay float


def _demo_engine_on_q4_1():
    engine = load_engine(get_preset("demo"))
    with torch.no_grad():
        for module in engine.target.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_gguf_rounded(module.weight, "q4_1"))
    return engine


def test_a_model_dequantized_from_q4_1_runs_on_its_blocks_with_the_float_model_s_logits(monkeypatch):
    """With float32 activations (DYNCHAT_INT_DOT=0) the native route of a target whose weights came
    from Q4_1 blocks (as SmolLM2's published file) multiplies the blocks: a sixth of the bytes, the
    same logits bit for bit as its float32 weights."""
    from unittest import mock

    from dynchat.engine import lean, linear
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    monkeypatch.setenv("DYNCHAT_INT_DOT", "0")
    engine = _demo_engine_on_q4_1()
    blocks = lean.LeanLM(engine.target, linear="native")
    assert {w.format for layer in blocks.weights for w in layer.values()} == {"q4_1"}
    assert blocks.native is not None
    lean._PREPARED.pop(engine.target)
    with mock.patch.object(linear, "gguf_weight", lambda w: None):
        floats = lean.LeanLM(engine.target, linear="native")
    assert blocks.weight_bytes() < floats.weight_bytes()
    ids = torch.tensor(engine.encode(PROMPTS[1]))
    for lm in (blocks, floats):
        lm.reset()
    for chunk in (ids[:-5], ids[-5:-4], ids[-4:]):
        assert torch.equal(blocks.forward(chunk), floats.forward(chunk))


def test_the_avx2_build_of_the_block_kernels_gives_the_same_bits(tmp_path):
    """Where this CPU has AVX-512 the library takes its 16-wide paths; an AVX2-only build (as on other
    machines) is compiled here too: both multiply Q4_1 and Q8_0 blocks to the float32 kernel's bits."""
    import ctypes

    from dynchat.engine import native
    from dynchat.engine.linear import gguf_weight

    if native.library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    native._build(tmp_path / "avx2.so", ("-mno-avx512f",))
    lib = ctypes.CDLL(str(tmp_path / "avx2.so"))
    torch.manual_seed(1)
    x = torch.randn(7, 576)
    for kind in ("q4_1", "q8_0"):
        w = _gguf_rounded(torch.randn(67, 576) * 0.05, kind)
        q = gguf_weight(w)
        got, want = torch.empty(7, 67), torch.empty(7, 67)
        lib.f32_gemm(*(ctypes.c_void_p(t.data_ptr()) for t in (x, w, want)), 7, 67, 576)
        args = [q.data, q.scales] + ([q.mins] if q.mins is not None else [])
        fn = lib.q41_gemm if kind == "q4_1" else lib.q80_gemm
        fn(ctypes.c_void_p(x.data_ptr()), *(ctypes.c_void_p(t.data_ptr()) for t in args), ctypes.c_void_p(got.data_ptr()),
           7, 67, 576)
        assert torch.equal(got, want), kind
        assert torch.allclose(want, x @ w.T, atol=1e-5)
        for r in (0, 6):           # one row alone (its own tile shape) gives what it gave among seven
            alone = torch.empty(1, 67)
            lib.f32_gemm(*(ctypes.c_void_p(t.data_ptr()) for t in (x[r:r + 1], w, alone)), 1, 67, 576)
            assert torch.equal(alone[0], want[r]), (kind, r)


def test_the_float32_kernel_gives_a_row_alone_what_it_gives_among_others():
    """A step (one row) reads one weight row at a time, a verify four at a time: the same sums in the
    same order, so k tokens verified together equal k single steps bit for bit (what lossless greedy
    decoding on float32 matrices rests on)."""
    import ctypes

    from dynchat.engine import native

    lib = native.library()
    if lib is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    torch.manual_seed(2)
    for n_out, k in ((67, 576), (1536, 576), (576, 1536)):
        w = torch.randn(n_out, k) * 0.05
        x = torch.randn(9, k)
        together = torch.empty(9, n_out)
        lib.f32_gemm(*(ctypes.c_void_p(t.data_ptr()) for t in (x, w, together)), 9, n_out, k)
        for r in range(9):
            alone = torch.empty(1, n_out)
            lib.f32_gemm(*(ctypes.c_void_p(t.data_ptr()) for t in (x[r:r + 1].contiguous(), w, alone)), 1, n_out, k)
            assert torch.equal(alone[0], together[r]), (n_out, k, r)
        assert torch.allclose(together, x @ w.T, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_every_output_is_written_and_alike_however_many_threads_share_the_rows(threads):
    """The threads share a matmul's weight rows out as they come free (spans.c: each takes its own
    share from the front, then the back half of another's): every output is written, whatever the
    thread count and however few weight blocks there are per thread, and to the bits one thread gives
    (float32 matrices; the block and integer routes share the same scheduler)."""
    import ctypes

    from dynchat.engine import native

    lib = native.library()
    if lib is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    torch.manual_seed(5)
    before = torch.get_num_threads()
    try:
        for n_out, k, rows in ((4, 64, 1), (67, 576, 1), (1536, 576, 5), (576, 1536, 9)):
            w, x = torch.randn(n_out, k) * 0.05, torch.randn(rows, k)
            out = {}
            for t in (1, threads):
                torch.set_num_threads(t)
                out[t] = torch.full((rows, n_out), float("nan"))
                lib.f32_gemm(*(ctypes.c_void_p(v.data_ptr()) for v in (x, w, out[t])), rows, n_out, k)
            assert torch.equal(out[threads], out[1]), (n_out, k, rows)
            assert torch.allclose(out[threads], x @ w.T, atol=1e-4)        # no output left unwritten (NaN)
    finally:
        torch.set_num_threads(before)


def _int_dot_reference(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """What the integer-dot route computes, in float64: x rounded to int8 per block of 32 (scale
    max|x| / 127), times the blocks' weights (Q4_1: d * q + m, Q8_0: d * q)."""
    from dynchat.engine.linear import q41_blocks, q80_blocks

    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    xq = (xb * torch.where(amax > 0, 127 / amax, 0)[..., None]).round().double()
    dx = (amax / 127).double()
    if kind == "q8_0":
        q, d = q80_blocks(w)
        return (torch.einsum("rbk,nbk->rnb", xq, q.view(w.shape[0], -1, 32).double()) * d.double()[None]
                * dx[:, None]).sum(-1)
    nibbles, d, m = q41_blocks(w)
    q = torch.cat([nibbles.view(-1, 16) & 15, nibbles.view(-1, 16) >> 4], 1).view(w.shape[0], -1, 32).double()
    dots = torch.einsum("rbk,nbk->rnb", xq, q)
    return (dots * d.double()[None] * dx[:, None] + m.double()[None] * (dx * xq.sum(-1))[:, None]).sum(-1)


def _verifies_as_it_steps_and_every_mode_equals_plain(engine, lm, ids: torch.Tensor) -> None:
    """A 5-token verify gives exactly the logits of 5 single steps; greedy EAGLE-3 and assistant
    decoding give plain decoding's tokens."""
    lm.reset()
    lm.forward(ids[:-5])
    verified = lm.forward(ids[-5:])
    lm.reset()
    lm.forward(ids[:-5])
    assert torch.equal(verified, torch.cat([lm.forward(ids[i:i + 1]) for i in range(len(ids) - 5, len(ids))]))
    plain = greedy(engine, "baseline", ids.tolist())
    assert greedy(engine, "eagle3", ids.tolist(), Constant(3)) == plain
    assert greedy(engine, "assistant", ids.tolist(), make_policy("dynamic")) == plain


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_gguf_blocks_in_integer_dot_products_round_only_the_activations(tmp_path, kind, monkeypatch):
    """With DYNCHAT_INT_DOT=1 GGUF blocks (widths a multiple of 16) are multiplied by activations rounded to int8
    per block (integer dot products, as llama.cpp): the reference formula to float32 precision, close
    to the float product, each row alone or with others the same bits, and the same bits from the
    AVX-512, AVX-512 without VNNI, AVX2 + VNNI and plain AVX2 builds."""
    import ctypes

    from dynchat.engine import native
    from dynchat.engine.linear import gguf_weight, native_linear

    if native.library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    monkeypatch.setenv("DYNCHAT_INT_DOT", "1")
    torch.manual_seed(2)
    w = _gguf_rounded(torch.randn(96, 576) * 0.05, kind)
    q = gguf_weight(w)
    assert q.format == f"{kind} x int8 activations"
    assert q.packed.numel() == 96 * 576 * (20 if kind == "q4_1" else 34) // 32
    x = torch.randn(17, 576)
    y = native_linear(x, q)
    want = _int_dot_reference(x, w, kind)
    assert torch.allclose(y.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    exact = x @ w.T
    assert (y - exact).abs().max() < 0.02 * exact.abs().max()
    for m in (1, 2, 5, 9):
        assert torch.equal(native_linear(x[:m], q), y[:m])
    builds = {"avx512": ("-mno-avx512vnni",), "avx2-vnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni")}
    for name, flags in builds.items():
        native._build(tmp_path / f"{name}.so", flags)
        fn = getattr(ctypes.CDLL(str(tmp_path / f"{name}.so")), f"{kind.replace('_', '')}x16_gemm")
        got = torch.empty(17, 96)
        fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(q.packed.data_ptr()), ctypes.c_void_p(got.data_ptr()),
           17, 96, 576)
        assert torch.equal(got, y), name


def test_an_avx2_build_computes_the_whole_forward_to_the_same_bits(monkeypatch, tmp_path):
    """The native forward on GGUF blocks (Q4_1 layers and a Q8_0 output head, as SmolLM2's published
    file) with int8 activations: norms, attention, SiLU and the block kernels of an AVX2-only build, as
    on machines without AVX-512, give the logits of this CPU's build bit for bit, so greedy output does
    not depend on which x86 CPU serves it (float32 matrices are summed in each build's own width)."""
    import ctypes

    from dynchat.engine import lean, native

    if native.library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    native._build(tmp_path / "avx2.so", ("-mno-avx512f", "-mno-avxvnni"))
    avx2 = native.declared(ctypes.CDLL(str(tmp_path / "avx2.so")))
    monkeypatch.setenv("DYNCHAT_INT_DOT", "1")
    engine = _demo_engine_on_q4_1()
    with torch.no_grad():
        head = engine.target.get_output_embeddings()
        head.weight.copy_(_gguf_rounded(head.weight, "q8_0"))
    lm = lean.LeanLM(engine.target, linear="native")
    assert lm.native is not None and lm._native_head is not None
    ids = torch.tensor(engine.encode(PROMPTS[1]))

    def logits():
        lm.reset()
        return [lm.forward(chunk) for chunk in (ids[:-6], ids[-6:-5], ids[-5:])]

    here = logits()
    monkeypatch.setattr(native, "library", lambda: avx2)
    for got, want in zip(logits(), here):
        assert torch.equal(got, want)


def test_the_16_lane_silu_gives_the_8_lane_bits(tmp_path):
    """SiLU's AVX-512 lanes run exp8's operations: each of a million activations, from -100 to 100,
    comes out as the 8-lane code computes it (the rounding of int8 activations would hide a
    difference from the whole-forward comparison)."""
    import shutil
    import subprocess

    from dynchat.engine import native

    if native.library() is None or "avx512f" not in native._cpu_flags():
        pytest.skip("no AVX-512 CPU or no C compiler here")
    src = tmp_path / "silu.c"
    src.write_text(f'''#include "{Path(native.__file__).with_name("decoder_layer.c")}"
#include <stdio.h>
int main(void) {{
    int n = 1 << 20;
    float *g = malloc(8 * (size_t)n), *a = malloc(8 * (size_t)n);
    for (int i = 0; i < n; i++) {{ g[i] = -100.0f + 200.0f * i / n; g[n + i] = 1.0f + (float)i / n; }}
    silu_mul_row(g, g + n, a, n);               /* 16 lanes, then 8 */
    for (int i = 0; i < n; i += 8) silu_mul_row(g + i, g + n + i, a + n + i, n - i < 8 ? n - i : 8);
    long differ = 0;
    for (int i = 0; i < n; i++) differ += memcmp(a + i, a + n + i, 4) != 0;
    printf("%ld\\n", differ);
    return 0;
}}
''')
    compiler = shutil.which("cc") or shutil.which("gcc")
    exe = tmp_path / "silu"
    subprocess.run([compiler, *[f for f in native.FLAGS if f not in ("-shared", "-fPIC")], str(src),
                    str(Path(native.__file__).with_name("gemm.c")), str(Path(native.__file__).with_name("int_dot.c")),
                    str(Path(native.__file__).with_name("argmax.c")), str(Path(native.__file__).with_name("spans.c")),
                    "-o", str(exe), "-lm"], check=True)
    assert subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.strip() == "0"



ATTENTION_PROGRAM = r'''#include "DECODER_LAYER_C"
#include <stdio.h>
/* attend_rows over SmolLM2's shapes (3 key/value heads of 3 query heads, 64 dims), float16 and float32
   caches, 1 to 9 rows after 0 to 300 cached keys, chains and a tree's slots: every output's bits */
static unsigned state = 1;
static float uniform(void) { state = state * 1664525u + 1013904223u; return (float)(state >> 8) / (1 << 24) - 0.5f; }
int main(void) {
    int nkv = 3, group = 3, hd = 64, Q = nkv * group * hd, QKV = Q + 2 * nkv * hd, cap = 320;
    float *k32 = malloc(4 * (size_t)nkv * cap * hd), *v32 = malloc(4 * (size_t)nkv * cap * hd);
    uint16_t *k16 = malloc(2 * (size_t)nkv * cap * hd), *v16 = malloc(2 * (size_t)nkv * cap * hd);
    for (long i = 0; i < (long)nkv * cap * hd; i++) {
        k32[i] = 4 * uniform(); v32[i] = uniform();
        k16[i] = _cvtss_sh(k32[i], 0); v16[i] = _cvtss_sh(v32[i], 0);
    }
    float *qkv = malloc(4 * (size_t)9 * QKV), *att = malloc(4 * (size_t)9 * Q);
    int n_keys[9], *slots = malloc(sizeof(int) * 9 * cap);
    int rows[] = {1, 2, 5, 9}, starts[] = {0, 3, 7, 8, 15, 16, 31, 63, 64, 100, 250, 300};
    for (int half = 0; half < 2; half++)
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 12; b++)
                for (int tree = 0; tree < 2; tree++) {
                    int n = rows[a], start = starts[b];
                    for (long i = 0; i < (long)n * QKV; i++) qkv[i] = uniform();
                    for (int r = 0; r < n; r++) {
                        n_keys[r] = start + (tree ? 1 + r / 2 : r + 1);  /* a tree's rows: the prefix, some ancestors */
                        for (int t = 0; t < n_keys[r]; t++)
                            slots[r * cap + t] = tree && t >= start ? start + (t - start) * 2 % (n + 1) : t;
                    }
                    attend_rows(qkv, QKV, att, Q, n, nkv, group, hd, 0.125f, half ? (void *)k16 : k32,
                                half ? (void *)v16 : v32, half, cap, tree ? slots : NULL, n_keys, tree ? cap : start + n);
                    fwrite(att, 4, (size_t)n * Q, stdout);
                }
    return 0;
}
'''


def test_the_16_lane_attention_gives_the_8_lane_bits(tmp_path):
    """Attention's AVX-512 paths (8 keys' scores at once, a head's 64 value lanes in four 16-lane
    registers, 16-lane softmax) add every product in the 8-lane code's order: over SmolLM2's shapes,
    float16 and float32 caches, 1-9 rows after 0-300 keys, chains and trees, the outputs of an
    AVX-512 build and an AVX2-only build agree bit for bit (the whole-forward comparison above runs
    the demo model's 32-dim heads, which take the 8-lane value loop)."""
    import shutil
    import subprocess

    from dynchat.engine import native

    if native.library() is None or "avx512f" not in native._cpu_flags():
        pytest.skip("no AVX-512 CPU or no C compiler here")
    here = Path(native.__file__).parent
    src = tmp_path / "attention.c"
    src.write_text(ATTENTION_PROGRAM.replace("DECODER_LAYER_C", str(here / "decoder_layer.c")))
    compiler = shutil.which("cc") or shutil.which("gcc")
    outputs = []
    for extra in ((), ("-mno-avx512f",)):
        exe = tmp_path / f"attention{len(extra)}"
        subprocess.run([compiler, *[f for f in native.FLAGS if f not in ("-shared", "-fPIC")], *extra, str(src),
                        *(str(here / f) for f in ("gemm.c", "int_dot.c", "argmax.c", "spans.c")), "-o", str(exe), "-lm"],
                       check=True)
        outputs.append(subprocess.run([str(exe)], capture_output=True, check=True).stdout)
    values = torch.frombuffer(bytearray(outputs[0]), dtype=torch.float32)
    assert values.numel() == 2 * 2 * 12 * (1 + 2 + 5 + 9) * 576 and bool(values.isfinite().all())
    assert outputs[0] == outputs[1]

def test_a_q4_1_model_in_integer_dot_products_verifies_as_it_steps_and_stays_faithful(monkeypatch):
    """The whole model on integer dot products: a k-token verify gives exactly the logits of single
    steps (the lossless guarantee), greedy speculative output equals plain decoding, and the
    next-token choice stays that of the float activations on almost every position."""
    from dynchat.engine import lean
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    monkeypatch.setenv("DYNCHAT_INT_DOT", "1")
    engine = _demo_engine_on_q4_1()
    lm = lean.LeanLM(engine.target, linear="native")
    formats = {w.format for layer in lm.weights for w in layer.values()}
    assert "q4_1 x int8 activations" in formats
    ids = torch.tensor(engine.encode(PROMPTS[1]))
    _verifies_as_it_steps_and_every_mode_equals_plain(engine, lm, ids)

    def logits_by_steps(model):
        model.reset()
        return torch.cat([model.forward(ids[i:i + 4]) for i in range(0, len(ids), 4)])

    with_int_dot = logits_by_steps(lm)
    lean._PREPARED.pop(engine.target)
    monkeypatch.setenv("DYNCHAT_INT_DOT", "0")
    floats = logits_by_steps(lean.LeanLM(engine.target, linear="native"))
    lean._PREPARED.pop(engine.target)
    assert (with_int_dot.argmax(-1) == floats.argmax(-1)).float().mean() >= 0.9
    # a long prompt goes through the same integer kernels as later steps, so a cache reused from an
    # earlier turn gives what a fresh prefill gives
    monkeypatch.setenv("DYNCHAT_INT_DOT", "1")
    lm = lean.LeanLM(engine.target, linear="native")
    for size in (lean.PREFILL_ROWS, 300):       # 300: more rows than the native attention takes at a time (256)
        long_ids = torch.cat([ids] * (size // len(ids) + 2))
        lm.reset()
        whole = lm.forward(long_ids)
        lm.reset()
        parts = torch.cat([lm.forward(long_ids[:-37]), lm.forward(long_ids[-37:-3]), lm.forward(long_ids[-3:])])
        assert torch.equal(whole, parts), size
    # keys and values are cached in float16 there, as llama.cpp caches them: a verify at a long context
    # still gives single steps' logits, and the choices stay those of a float32 cache
    assert lm.k.dtype == lm.v.dtype == torch.float16
    long_ids = torch.cat([ids] * 8)
    _verifies_as_it_steps_and_every_mode_equals_plain(engine, lm, long_ids)

    def logits_of(model):
        model.reset()
        return torch.cat([model.forward(long_ids[:-9])[-1:], model.forward(long_ids[-9:-4]),
                          *[model.forward(long_ids[i:i + 1]) for i in range(len(long_ids) - 4, len(long_ids))]])

    half = logits_of(lm)
    lm.cache = lm._new_cache()
    lm.cache.kv_dtype = torch.float32
    full = logits_of(lm)
    assert lm.k.dtype == torch.float32
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9
    assert torch.allclose(half, full, atol=0.02 * float(full.abs().max()))


def test_int8_weights_in_integer_dot_products_verify_as_they_step(monkeypatch):
    """DYNCHAT_INT_DOT=1 on the int8 preset: per-row int8 weights packed as Q8_0 blocks sharing the
    row's scale, multiplied by activations rounded to int8 per block (the reference formula to float32
    precision); the whole model then verifies exactly as it steps, every mode equals plain decoding,
    and the next-token choice stays that of float32 activations on almost every position."""
    from dynchat.engine import lean
    from dynchat.engine.linear import dequantized, int8_blocks_weight, native_linear
    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    monkeypatch.setenv("DYNCHAT_INT_DOT", "1")
    torch.manual_seed(3)
    w = torch.randn(96, 576) * 0.05
    q = int8_blocks_weight(w)
    assert q.format == "int8 x int8 activations" and q.packed.numel() == 96 * 576 * 34 // 32
    rebuilt = dequantized(q)
    assert (rebuilt - w).abs().max() <= w.abs().amax(1).max() / 127 * 0.51 + 1e-6    # int8's own grid
    x = torch.randn(9, 576)
    y = native_linear(x, q)
    xb = x.view(9, -1, 32)
    amax = xb.abs().amax(-1)
    xq = (xb * torch.where(amax > 0, 127 / amax, 0)[..., None]).round().double()
    want = torch.einsum("rbk,nbk->rnb", xq * (amax / 127).double()[..., None],
                        rebuilt.double().view(96, -1, 32)).sum(-1)
    assert torch.allclose(y.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())
    for m in (1, 2, 5):
        assert torch.equal(native_linear(x[:m], q), y[:m])

    engine = load_engine(get_preset("demo"), quantization="int8")
    lm = make_lm(engine.target)
    assert lm.int8_activations and {w.format for layer in lm.weights for w in layer.values()} == {"int8 x int8 activations"}
    ids = torch.tensor(engine.encode(PROMPTS[1]))
    _verifies_as_it_steps_and_every_mode_equals_plain(engine, lm, ids)
    assert engine.weights == "int8 x int8 activations"
    lm.reset()
    with_int_dot = torch.cat([lm.forward(ids[i:i + 4]) for i in range(0, len(ids), 4)])
    lean._PREPARED.pop(engine.target)
    monkeypatch.setenv("DYNCHAT_INT_DOT", "0")
    floats = load_engine(get_preset("demo"), quantization="int8")
    lm = make_lm(floats.target)
    lm.reset()
    by_floats = torch.cat([lm.forward(ids[i:i + 4]) for i in range(0, len(ids), 4)])
    assert (with_int_dot.argmax(-1) == by_floats.argmax(-1)).float().mean() >= 0.9



def test_a_presets_int_dot_decides_its_models_activations_whatever_the_environment(monkeypatch):
    """`int_dot: true` in a preset gives its models int8 activations (the int4 preset runs the published
    blocks as llama.cpp does) while a preset without it, loaded in the same process, keeps float32 ones;
    `int_dot: false` holds against DYNCHAT_INT_DOT=1. Greedy modes still equal plain decoding."""
    import dataclasses

    from dynchat.engine.native import library

    if library() is None:
        pytest.skip("no AVX2 CPU or no C compiler here")
    demo = get_preset("demo")
    monkeypatch.setenv("DYNCHAT_INT_DOT", "0")
    def weights(preset):
        engine = load_engine(preset, quantization="int8")
        engine.decoder("baseline")          # the target's weights are prepared with its first decoder
        return engine, engine.weights

    integer, described = weights(dataclasses.replace(demo, int_dot=True))
    assert described == "int8 x int8 activations" and weights(demo)[1] == "int8"
    monkeypatch.setenv("DYNCHAT_INT_DOT", "1")
    assert weights(dataclasses.replace(demo, int_dot=False))[1] == "int8"
    ids = integer.encode(PROMPTS[1])
    base, _ = run(integer.decoder("baseline"), ids, 32)
    for mode in ("lookup", "assistant", "eagle3"):
        assert run(integer.decoder(mode), ids, 32)[0] == base, mode

def test_the_quality_command_reports_every_weight_format_against_float32(tmp_path):
    """`python -m dynchat quality`: one row per format, int8 weights also with int8 activations."""
    import json

    from dynchat.cli import main

    out = tmp_path / "quality.json"
    assert main(["quality", "--preset", "demo", "--weights", "int8", "--limit", "1", "--max-new-tokens", "8",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["weights"]
    assert list(rows) == ["float32", "int8 activations", "int8", "int8 x int8 activations"]
    assert rows["float32"]["next_token_agreement"] == 1.0
    for name, row in rows.items():
        assert abs(row["perplexity"] / rows["float32"]["perplexity"] - 1) < 0.02, name
        assert row["next_token_agreement"] > 0.9, name


def test_the_native_kernels_build_wherever_a_compiler_and_avx2_are_there(tmp_path):
    """A source that no longer compiles must fail here, not turn every native test into a skip while the
    app quietly falls back to PyTorch's kernels (a macro used before its definition did exactly that)."""
    import shutil

    from dynchat.engine import native

    if not native._cpu_has_avx2() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no AVX2 CPU or no C compiler here: the fallback is what runs")
    native._build(tmp_path / "dynchat.so")            # raises with the compiler's message
    assert native.library() is not None

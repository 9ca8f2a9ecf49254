"""How a linear layer runs here: its matmul route (weights stored and multiplied as float32, packed,
native, bf16, int8 or int4), weight quantization, and choosing the fastest route on this machine.
The one place the lean forward and the EAGLE-3 drafter get their matmuls from."""
from __future__ import annotations

import contextlib
import contextvars
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import QUANTIZATIONS


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def native_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """float32 weights multiplied by engine/native's kernel (rows independent of each other); a width
    it does not take (K % 16) by F.linear. GGUF blocks (gguf_weight) go to their own kernels."""
    if isinstance(w, QuantWeight):
        return quant_linear(x, w, b)
    if w.shape[1] % 16 or x.dtype != torch.float32:
        return F.linear(x, w, b)
    from .native import f32_gemm

    shape = x.shape
    y = f32_gemm()(x.reshape(-1, shape[-1]).contiguous(), w).reshape(*shape[:-1], w.shape[0])
    return y if b is None else y + b


def bf16_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """bfloat16 weights, float32 activations: half the bytes streamed. For drafters only (not exact)."""
    return F.linear(x.to(w.dtype), w, None if b is None else b.to(w.dtype)).to(x.dtype)


def flush_caches(_buf: list = []) -> None:  # noqa: B006 - one scratch buffer for the process
    """Evict the CPU caches, as a target forward does between two draft steps (for fair timing)."""
    with torch.inference_mode():
        if not _buf:
            _buf.append(torch.empty(8 * 1024 * 1024))
        _buf[0].fill_(1.0)


def fuse(modules: list[torch.nn.Linear]) -> torch.Tensor:
    """Concatenate the weights and make each module's weight a view of the result (no second copy)."""
    fused = torch.cat([m.weight.detach() for m in modules]).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


# -- weight-only quantization ----------------------------------------------------------------------
# int8 (per output channel) and int4 (groups of 32, asymmetric): weights quantized by torchao. int8
# is multiplied by dynchat's own AVX2 kernel (engine/native: float32 activations, built once with
# the machine's C compiler) where it can be, else by PyTorch's CPU kernel with bfloat16
# activations; int4 by PyTorch's. torchao's linear for these tensors casts the int8 weight to float
# on every call and takes a scalar int4 path for float32 activations (measured here: 2-10x slower
# than float32), so the hot path calls the kernels itself. Every kernel gives each row the same
# result whatever the number of rows, so a k-token verify and k single-token steps agree bit for
# bit: greedy output is identical across modes.
INT4_GROUP = 32


@dataclass(frozen=True)
class QuantWeight:
    bits: int                   # 8 or 4
    data: torch.Tensor          # int8 (N, K), or int4 packed for the CPU kernel
    scales: torch.Tensor        # int8: (N,) float32 (native kernel) or bfloat16; int4: packed scales and zero points
    out_features: int
    native: bool = False        # multiplied by engine.native: int8_gemm, q80_gemm or q41_gemm
    block: int = 0              # 32: GGUF blocks (Q8_0, Q4_1: scales hold d per row and block); 0: per row
    mins: torch.Tensor | None = None    # Q4_1: m per row and block
    dense: torch.Tensor | None = None   # the float weights these blocks rebuild exactly, where they do
    packed: torch.Tensor | None = None  # the same blocks for integer dot products (q41_packed, q80_packed)

    @property
    def format(self) -> str:
        """How the weights are stored and multiplied: q4_1, q8_0 (by int8 activations where packed), int8, int4."""
        name = {(4, 32): "q4_1", (8, 32): "q8_0"}.get((self.bits, self.block), f"int{self.bits}")
        return f"{name} x int8 activations" if self.packed is not None else name

    def streamed(self) -> list[torch.Tensor]:
        """The tensors a forward reads for this weight."""
        if self.packed is not None:
            return [self.packed]
        return [t for t in (self.data, self.scales, self.mins) if t is not None]


def dequantized(w: QuantWeight) -> torch.Tensor:
    """The float32 weights a natively multiplied QuantWeight stands for (a batched prefill's matmul)."""
    if w.dense is not None:
        return w.dense
    if w.block:
        q = w.data
        if w.bits == 4:       # a block's 16 bytes hold its first 16 weights low, the next 16 high
            q = torch.cat([q.view(-1, 16) & 15, q.view(-1, 16) >> 4], 1).reshape(w.out_features, -1)
        blocks = q.float().view(w.out_features, -1, w.block) * w.scales[..., None]
        return (blocks if w.mins is None else blocks + w.mins[..., None]).flatten(1)
    return w.data.float() * w.scales.float()[:, None]


_INTEGER_ACTIVATIONS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("integer_activations", default=None)


@contextlib.contextmanager
def integer_activations(on: bool | None):
    """Weights prepared meanwhile take int8 activations in integer dot products (True) or keep float32
    ones (False); None changes nothing (an enclosing choice, else DYNCHAT_INT_DOT). A preset's `int_dot`
    reaches its models' weights so."""
    if on is None:
        yield
        return
    token = _INTEGER_ACTIVATIONS.set(on)
    try:
        yield
    finally:
        _INTEGER_ACTIVATIONS.reset(token)


def int_dot() -> bool:
    """Whether Q4_1 and Q8_0 weights are multiplied by activations rounded to int8 per block of 32, in
    integer dot products (engine/native/int_dot.c; what llama.cpp does; DYNCHAT_INT_DOT=1, or a preset's
    `int_dot: true`): a verified token then costs a fraction of a step. Off by default: the rounding
    flips near-ties of SmolLM2 ("What is the capital of France?" then starts "L'Étoile" instead of
    "The capital of France is Paris."), and float32 activations give the float32 weights' own logits."""
    from .native import library

    on = _INTEGER_ACTIVATIONS.get()
    if on is None:
        on = os.environ.get("DYNCHAT_INT_DOT", "0") == "1"
    return on and library() is not None


def q41_packed(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor | None:
    """Q4_1 blocks (q41_blocks' layout) interleaved for int_dot.c: per 16 weight rows and block of 32,
    256 bytes of nibbles (chunk c: each row's q[4c..4c+3] low, q[16+4c..16+4c+3] high), then the 16 d
    and 16 m as float16: (N / 16, K / 32, 320) bytes. None where N % 16 or d, m are no float16 values."""
    n, half = nibbles.shape
    if n % 16 or not (torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)):
        return None
    groups, blocks = n // 16, half // 16
    nib = nibbles.view(groups, 16, blocks, 16)
    lo, hi = (nib & 15).view(groups, 16, blocks, 4, 4), (nib >> 4).view(groups, 16, blocks, 4, 4)
    quads = (lo | (hi << 4)).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 256)

    def per_group(t):
        return t.half().view(groups, 16, blocks).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([quads, per_group(d), per_group(m)], -1).contiguous()


def q80_packed(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor | None:
    """Q8_0 blocks (q80_blocks' layout) interleaved for int_dot.c: per 16 weight rows and block of 32,
    8 chunks of each row's q[4c..4c+3], then the 16 d as float16: (N / 16, K / 32, 544) bytes.
    None where N % 16 or d holds no float16 values."""
    n, k = q.shape
    if n % 16 or not torch.equal(d.half().float(), d):
        return None
    groups, blocks = n // 16, k // Q41_BLOCK
    quads = q.view(groups, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 512).view(torch.uint8)
    scales = d.half().view(groups, 16, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat([quads, scales], -1).contiguous()


def q41_weight(nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dense: torch.Tensor | None = None) -> QuantWeight:
    """Q4_1 blocks multiplied natively: packed for integer dot products where int_dot() holds."""
    packed = q41_packed(nibbles, d, m) if int_dot() else None
    return QuantWeight(4, nibbles, d, nibbles.shape[0], native=True, block=Q41_BLOCK, mins=m, dense=dense,
                       packed=packed)


def int8_blocks_weight(w: torch.Tensor) -> QuantWeight:
    """Per-row int8 (symmetric, scale max|w| / 127 rounded up to a float16 value) packed as Q8_0
    blocks that share their row's scale, for integer dot products (int_dot()): the int8 preset then
    multiplies int8 by int8 as llama.cpp's Q8_0 does. dequantized() gives the same weights."""
    w = w.detach().float()
    scale = (w.abs().amax(1).clamp_min(1e-12) / 127).half()
    scale = torch.where(scale.float() * 127 < w.abs().amax(1), torch.nextafter(scale, torch.tensor(65504.0).half()),
                        scale).float()
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
    blocks = scale[:, None].expand(-1, w.shape[1] // Q41_BLOCK).contiguous()
    return QuantWeight(8, q, scale.contiguous(), w.shape[0], native=True, packed=q80_packed(q, blocks))


def gguf_weight(w: torch.Tensor) -> QuantWeight | None:
    """w as the GGUF blocks it was dequantized from (Q4_1, else Q8_0), multiplied natively from a
    seventh (Q4_1) or a quarter (Q8_0) of the bytes: in integer dot products (int_dot()), else as the
    same float32 weights rebuilt in registers (the float32 kernel's logits bit for bit). None where w
    is not exactly such blocks, the native kernels are not there, or DYNCHAT_GGUF_BLOCKS=0 (float32
    weights on the float32 kernel, to compare speeds)."""
    from .native import library

    if os.environ.get("DYNCHAT_GGUF_BLOCKS", "1") == "0" or library() is None \
            or w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 \
            or w.shape[1] % Q41_BLOCK:
        return None
    found = q41_blocks(w)
    if found is not None:
        return q41_weight(*found, dense=w.detach())
    found = q80_blocks(w)
    if found is not None:
        q, d = found
        return QuantWeight(8, q, d, w.shape[0], native=True, block=Q41_BLOCK, dense=w.detach(),
                           packed=q80_packed(q, d) if int_dot() else None)
    return None


def q80_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w (N, K) as GGUF's Q8_0 blocks, int8 q (N, K) and d (N, K / 32) float32 with w = d * q per
    block of 32, when every weight is rebuilt bit for bit (d a float16 value), else None."""
    n, k = w.shape
    blocks = w.detach().float().reshape(n, k // Q41_BLOCK, Q41_BLOCK)
    d = (blocks.abs().amax(-1) / 127).half().float()
    q = (blocks / torch.where(d > 0, d, torch.ones_like(d))[..., None]).round()
    if q.abs().max() > 127 or not torch.equal(q * d[..., None], blocks):
        return None
    return q.to(torch.int8).reshape(n, k).contiguous(), d.contiguous()


Q41_BLOCK = 32       # GGUF's block of weights sharing a scale (Q4_1, Q8_0)


def q41_blocks(w: torch.Tensor, exact: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w (N, K) as GGUF's Q4_1 blocks: the nibbles (N, K / 2) uint8 (byte j of a block holds q[j] low and
    q[j + 16] high), d and m (N, K / 32) float32, with w = d * q + m per block of 32, q in 0..15.

    exact: only if every weight is rebuilt bit for bit as GGUF dequantizes (d and m float16 values,
    a multiply then an add in float32), i.e. w was dequantized from Q4_1 blocks (SmolLM2's published
    file), else None; not exact: the blocks GGUF's quantizer would fit (min and max of each block)."""
    n, k = w.shape
    if k % Q41_BLOCK:
        return None
    blocks = w.detach().float().reshape(-1, Q41_BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = lo.half().float()
    if exact and not torch.equal(m, lo):
        return None
    d16 = ((hi - m) / 15).half()

    def fit(rows, d):
        """q for blocks[rows] at scales d, and whether each block is rebuilt bit for bit"""
        b, mm = blocks[rows], m[rows, None]
        q = torch.where(d[:, None] > 0, ((b - mm) / torch.where(d > 0, d, 1.0)[:, None]).round(), 0).clamp(0, 15)
        return q, ((q * d[:, None]) + mm == b).all(-1)

    best_d = d16.float()
    best_q, ok = fit(slice(None), best_d)
    # the float16 d GGUF stored is the rounding of (max - min) / 15, or a neighbour of it for a few blocks
    for step in (1, -1) if exact else ():
        rows = (~ok).nonzero()[:, 0]
        if not rows.numel():
            break
        d = (d16[rows].view(torch.int16) + step).view(torch.float16).float()
        q, fits = fit(rows, d)
        rows, d, q = rows[fits], d[fits], q[fits]
        best_d[rows], best_q[rows], ok[rows] = d, q, True
    if exact and not bool(ok.all()):
        return None
    best_d, m = best_d.reshape(n, k // Q41_BLOCK), m.reshape(n, k // Q41_BLOCK)
    best_q = best_q.reshape(n, k // Q41_BLOCK, Q41_BLOCK)
    q = best_q.to(torch.uint8)
    nibbles = (q[..., :Q41_BLOCK // 2] | (q[..., Q41_BLOCK // 2:] << 4)).reshape(n, k // 2).contiguous()
    return nibbles, best_d.contiguous(), m.contiguous()


def quantization_of(model) -> str:
    """The weight-only quantization the loader gave a model or head (models.yaml `quantization`)."""
    return getattr(model, "dynchat_quantization", "none")


def quantize_weight(bits: int, w: torch.Tensor) -> QuantWeight | torch.Tensor:
    """w as the quantized route multiplies it; a shape the kernel cannot take stays float.

    int4: GGUF's Q4_1 blocks multiplied natively where the kernels are built (a weight that came
    from such blocks, as SmolLM2's published file, gets exactly its own blocks back), else torchao's
    packing, whose bfloat16 scales round the grid.
    """
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    w = w.detach()
    if w.device.type != "cpu":
        raise ValueError(f"int{bits} weights run on CPU only (this model is on {w.device.type})")
    if bits == 8:
        if w.shape[1] % 8:          # PyTorch 2.13's int8 kernel crashes on such widths with 4+ rows
            return w
        if int_dot() and w.shape[0] % 16 == 0 and w.shape[1] % Q41_BLOCK == 0:
            return int8_blocks_weight(w)
        q = Int8Tensor.from_hp(w.float(), PerRow())
        from .native import int8_gemm

        if int8_gemm() is not None and w.shape[1] % 16 == 0:
            return QuantWeight(8, q.qdata.contiguous(), q.scale.flatten().float().contiguous(), w.shape[0], native=True)
        return QuantWeight(8, q.qdata.contiguous(), q.scale.flatten().to(torch.bfloat16), w.shape[0])
    from .native import library

    if library() is not None and w.shape[1] % Q41_BLOCK == 0:    # GGUF's Q4_1: exact where w came from it
        return q41_weight(*(q41_blocks(w) or q41_blocks(w, exact=False)))
    if w.shape[1] % INT4_GROUP or w.shape[0] % 16:     # what the int4 packing takes
        return w
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor

    q = Int4OpaqueTensor.from_hp(w.float(), [1, INT4_GROUP])
    return QuantWeight(4, q.qdata, q.scale_and_zero.to(torch.bfloat16), w.shape[0])


def native_pointers(w, float32_ok: bool) -> tuple[list, int] | None:
    """What engine/native's decoder layers read of a matmul weight: the pointers (data, scales, mins)
    and its flag (0; 1 / 2: Q4_1 / Q8_0 blocks packed for integer dot products), or None where the
    native kernels cannot take it. float32_ok: a float32 weight goes to the float32 kernel."""
    if isinstance(w, QuantWeight) and w.packed is not None:
        return [w.packed.data_ptr(), None, None], 1 if w.bits == 4 else 2
    if isinstance(w, QuantWeight) and w.native and (w.mins is not None or not w.block):   # Q4_1 or per-row int8
        return [w.data.data_ptr(), w.scales.data_ptr(), None if w.mins is None else w.mins.data_ptr()], 0
    if float32_ok and isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.is_contiguous() \
            and w.shape[1] % 16 == 0:
        return [w.data_ptr(), None, None], 0
    return None


def quant_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for a QuantWeight, or F.linear for a weight left in float."""
    if not isinstance(w, QuantWeight):
        return F.linear(x, w, b)
    shape = x.shape
    if w.native:
        from . import native

        x2 = x.reshape(-1, shape[-1]).float().contiguous()
        if w.packed is not None:
            y = (native.q41x16_gemm() if w.bits == 4 else native.q80x16_gemm())(x2, w.packed, w.out_features)
        elif w.mins is not None:
            y = native.q41_gemm()(x2, w.data, w.scales, w.mins)
        elif w.block:
            y = native.q80_gemm()(x2, w.data, w.scales)
        else:
            y = native.int8_gemm()(x2, w.data, w.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], w.out_features)
        return y if b is None else y + b
    x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    if w.bits == 8:
        y = torch._weight_int8pack_mm(x2, w.data, w.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), w.data, INT4_GROUP, w.scales)
        y = y[:, :w.out_features]
    y = y.to(x.dtype).reshape(*shape[:-1], w.out_features)
    return y if b is None else y + b


# -- matmul routes -------------------------------------------------------------------------------
# plain: F.linear. onednn: weights prepacked for oneDNN (CPU float32). native: dynchat's own kernels
# and decoder layer (engine/native; CPU float32 with AVX2; GGUF Q4_1 / Q8_0 blocks where the float32
# weights were dequantized from them, multiplied to the same bits). bf16: bfloat16 weights with
# float32 activations, half the bytes (CPU float32; drafters only, as it is not exact). int8, int4:
# the preset's weight-only quantization (above); the quantized model is then the target itself.
# A float drafter may also take int8 (native kernel): drafts need not be exact, verification is.
ROUTES = ("plain", "onednn", "native", "bf16", "int8", "int4")


def route_linear(route: str) -> Callable:
    return {"plain": F.linear, "onednn": packed_linear, "native": native_linear, "bf16": bf16_linear,
            "int8": quant_linear, "int4": quant_linear}[route]


def route_weight(route: str, w: torch.Tensor, output_head: bool = False):
    """A weight as the route multiplies it (the same tensor for plain). The native and int4 routes
    keep a weight dequantized from GGUF blocks (Q4_1, Q8_0) in those blocks: the same values, fewer
    bytes. Otherwise the int4 route keeps the output head (the tied embedding, 49152 x 576 in
    SmolLM2) in int8: fitted to 4 bits its relative error was 9% and SmolLM2's next-token agreement
    with its float weights 0.88; with the head in int8, 0.97."""
    if route == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    if route == "bf16":
        return w.detach().to(torch.bfloat16)
    if route == "native":
        return gguf_weight(w) or w.detach().contiguous()
    if route == "int4":
        exact = gguf_weight(w)
        if exact is not None and exact.bits <= 8:
            return exact
        return quantize_weight(8 if output_head else 4, w)
    if route == "int8":
        return quantize_weight(8, w)
    return w


def requested_route(exact: bool, given: str | None = None, quantization: str = "none") -> str:
    """The route asked for: the model's quantization (int8, int4) if any, else `given`, else
    DYNCHAT_LINEAR (targets) / DYNCHAT_DRAFT_LINEAR (drafters), else "auto" (time the candidates)."""
    if quantization != "none":
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {quantization!r}; choose {', '.join(QUANTIZATIONS)}")
        return quantization
    route = given or os.environ.get("DYNCHAT_LINEAR" if exact else "DYNCHAT_DRAFT_LINEAR", "auto")
    allowed = ("auto", "plain", "onednn", "native") + (() if exact else ("bf16", "int8"))
    if route not in allowed:
        raise ValueError(f"unknown linear route {route!r} for a {'target' if exact else 'draft'}; "
                         f"choose {', '.join(allowed)}")
    return route


def candidate_routes(device: torch.device, dtype: torch.dtype, exact: bool) -> list[str]:
    """The routes worth timing on this device and dtype."""
    cpu32 = device.type == "cpu" and dtype == torch.float32
    routes = ["plain"]
    if cpu32 and torch.backends.mkldnn.is_available():
        routes.append("onednn")
    if cpu32:
        from .native import library

        if library() is not None:
            routes.append("native")
    if cpu32 and not exact:
        routes.append("bf16")
        from .native import int8_gemm

        if int8_gemm() is not None:         # a quarter of the bytes: a drafter need not be exact
            routes.append("int8")
    return routes


def cold_seconds(steps: list[Callable[[], object]], device: torch.device, rounds: int = 5, repeats: int = 3) -> float:
    """Best of `repeats` totals of `rounds` passes over `steps`, each step timed alone with the CPU caches
    evicted before it (in decoding the other model runs between two steps): a route's decode cost."""
    best = float("inf")
    for _ in range(repeats):
        total = 0.0
        for _ in range(rounds):
            for step in steps:
                if device.type == "cpu":
                    flush_caches()
                t0 = time.perf_counter()
                step()
                total += time.perf_counter() - t0
        best = min(best, total)
    return best


def fastest_route(candidates: list[str], seconds: Callable[[str], float]) -> str:
    """The candidate whose timed step (`seconds(route)`, caches evicted as in decoding) is shortest."""
    if len(candidates) == 1:
        return candidates[0]
    timings = dict.fromkeys(candidates, float("inf"))
    with torch.inference_mode():
        for _ in range(2):          # interleaved passes: a route timed first, or while the machine drifts, is not favoured
            for route in candidates:
                timings[route] = min(timings[route], seconds(route))
    return min(timings, key=timings.get)

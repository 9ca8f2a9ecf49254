"""How a linear layer runs here: its matmul route (weights stored and multiplied as float32, packed,
native, bf16, int8 or int4), weight quantization, and choosing the fastest route on this machine.
The one place the lean forward and the EAGLE-3 drafter get their matmuls from."""
from __future__ import annotations

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
    it does not take (K % 16) by F.linear."""
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
    native: bool = False        # int8 multiplied by engine.native.int8_gemm


def quantization_of(model) -> str:
    """The weight-only quantization the loader gave a model or head (models.yaml `quantization`)."""
    return getattr(model, "dynchat_quantization", "none")


def quantize_weight(bits: int, w: torch.Tensor) -> QuantWeight | torch.Tensor:
    """w as the quantized route multiplies it; a shape the kernel cannot take stays float.

    int4 scales and zero points are fitted on the float32 values: a weight that came from a 4-bit
    GGUF block of 32 (SmolLM2's Q4_1) lands back on its own grid, rounded only by bfloat16 scales.
    """
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    w = w.detach()
    if w.device.type != "cpu":
        raise ValueError(f"int{bits} weights run on CPU only (this model is on {w.device.type})")
    if bits == 8:
        if w.shape[1] % 8:          # PyTorch 2.13's int8 kernel crashes on such widths with 4+ rows
            return w
        q = Int8Tensor.from_hp(w.float(), PerRow())
        from .native import int8_gemm

        if int8_gemm() is not None and w.shape[1] % 16 == 0:
            return QuantWeight(8, q.qdata.contiguous(), q.scale.flatten().float().contiguous(), w.shape[0], native=True)
        return QuantWeight(8, q.qdata.contiguous(), q.scale.flatten().to(torch.bfloat16), w.shape[0])
    if w.shape[1] % INT4_GROUP or w.shape[0] % 16:     # what the int4 packing takes
        return w
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor

    q = Int4OpaqueTensor.from_hp(w.float(), [1, INT4_GROUP])
    return QuantWeight(4, q.qdata, q.scale_and_zero.to(torch.bfloat16), w.shape[0])


def quant_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T for a QuantWeight, or F.linear for a weight left in float."""
    if not isinstance(w, QuantWeight):
        return F.linear(x, w, b)
    shape = x.shape
    if w.native:
        from .native import int8_gemm

        y = int8_gemm()(x.reshape(-1, shape[-1]).float().contiguous(), w.data, w.scales)
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
# plain: F.linear. onednn: weights prepacked for oneDNN (CPU float32). native: dynchat's own kernel
# and decoder layer (engine/native; CPU float32 with AVX2). bf16: bfloat16 weights with
# float32 activations, half the bytes (CPU float32; drafters only, as it is not exact). int8, int4:
# the preset's weight-only quantization (above); the quantized model is then the target itself.
# A float drafter may also take int8 (native kernel): drafts need not be exact, verification is.
ROUTES = ("plain", "onednn", "native", "bf16", "int8", "int4")


def route_linear(route: str) -> Callable:
    return {"plain": F.linear, "onednn": packed_linear, "native": native_linear, "bf16": bf16_linear,
            "int8": quant_linear, "int4": quant_linear}[route]


def route_weight(route: str, w: torch.Tensor, output_head: bool = False):
    """A weight as the route multiplies it (the same tensor for plain). The int4 route keeps the
    output head (the tied embedding, 49152 x 576 in SmolLM2) in int8: in 4 bits its relative error
    is 9% and SmolLM2's next-token agreement with its float weights 0.88; with the head in int8 it
    is 0.97, for about 1.4 ms more per step."""
    if route == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    if route == "bf16":
        return w.detach().to(torch.bfloat16)
    if route == "native":
        return w.detach().contiguous()
    if route in ("int8", "int4"):
        return quantize_weight(8 if route == "int8" or output_head else 4, w)
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

"""Low-level tensor ops shared by the lean forward and the EAGLE-3 drafter, and the one place a
matmul route (how weights are stored and multiplied) is chosen for both."""
from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


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


# -- matmul routes -------------------------------------------------------------------------------
# plain: F.linear. onednn: weights prepacked for oneDNN (CPU float32). bf16: bfloat16 weights with
# float32 activations, half the bytes (CPU float32; drafters only, as it is not exact).
ROUTES = ("plain", "onednn", "bf16")


def route_linear(route: str) -> Callable:
    return {"plain": F.linear, "onednn": packed_linear, "bf16": bf16_linear}[route]


def route_weight(route: str, w: torch.Tensor) -> torch.Tensor:
    """A weight as the route multiplies it (the same tensor for plain)."""
    if route == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    if route == "bf16":
        return w.detach().to(torch.bfloat16)
    return w


def requested_route(exact: bool, given: str | None = None) -> str:
    """The route asked for: `given`, else DYNCHAT_LINEAR (targets) / DYNCHAT_DRAFT_LINEAR (drafters),
    else "auto" (time the candidates)."""
    route = given or os.environ.get("DYNCHAT_LINEAR" if exact else "DYNCHAT_DRAFT_LINEAR", "auto")
    allowed = ("auto", "plain", "onednn") + (() if exact else ("bf16",))
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
    if cpu32 and not exact:
        routes.append("bf16")
    return routes


def fastest_route(candidates: list[str], seconds: Callable[[str], float]) -> str:
    """The candidate whose timed step (`seconds(route)`, caches evicted as in decoding) is shortest."""
    if len(candidates) == 1:
        return candidates[0]
    with torch.inference_mode():
        timings = {route: seconds(route) for route in candidates}
    return min(timings, key=timings.get)

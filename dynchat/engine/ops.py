"""Low-level tensor ops shared by the lean forward and the EAGLE-3 drafter."""
from __future__ import annotations

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

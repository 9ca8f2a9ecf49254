"""A decoder layer's arithmetic on fused weights, written once: the target's lean forward, the
EAGLE-3 drafter and the head's training forward compute their layers with these two pieces
(the attention between them differs: a KV cache at run time, training-time-test in training)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .primitives import rms, rotate


@dataclass(frozen=True)
class Heads:
    n_heads: int
    n_kv: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv * self.head_dim

    def split(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm=None, k_norm=None):
        """A fused qkv projection (..., n, q + 2 kv) -> rotated q (..., n, heads, hd), rotated k and
        v (..., n, kv heads, hd). cos/sin broadcast over the heads axis."""
        lead, qk = qkv.shape[:-1], self.q_size + self.kv_size
        v = qkv[..., qk:].view(*lead, self.n_kv, self.head_dim)
        if q_norm is None:        # q and k heads rotated in one call
            both = rotate(qkv[..., :qk].view(*lead, self.n_heads + self.n_kv, self.head_dim), cos, sin)
            return both[..., :self.n_heads, :], both[..., self.n_heads:, :], v
        q = q_norm(qkv[..., :self.q_size].view(*lead, self.n_heads, self.head_dim))
        k = k_norm(qkv[..., self.q_size:qk].view(*lead, self.n_kv, self.head_dim))
        return rotate(q, cos, sin), rotate(k, cos, sin), v


def output_and_mlp(residual: torch.Tensor, att: torch.Tensor, linear: Callable, o, gate_up, down,
                   post_norm: torch.Tensor, eps: float, biases: tuple = (None, None, None)) -> torch.Tensor:
    """The layer after attention: residual + o(att) (att: (..., n, q_size)), then plus the SwiGLU MLP
    (fused gate and up rows) of its post-attention RMSNorm."""
    x = residual + linear(att, o, biases[0])
    gate, up = linear(rms(x, post_norm, eps), gate_up, biases[1]).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, down, biases[2])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           causal: bool = False, fold: bool | None = None) -> torch.Tensor:
    """Attention of new rows q (n, heads, hd) over cached k, v (1, kv heads, L, hd) -> (1, heads, n, hd).

    mask (n, L), True where a row may look; causal: rows 0..n-1 over keys 0..n-1 (a prefill from
    position 0), given to the kernel as a flag, never materialised. Grouped-query attention with a
    mask folds each kv head's query heads into the row axis (fold; default: on CUDA), so fused
    kernels take it: `enable_gqa` with a mask runs the O(n L) math kernel with repeated keys there."""
    n, heads, hd = q.shape
    kv = k.shape[1]
    rows = q.transpose(0, 1)[None]                                  # (1, heads, n, hd)
    if kv == heads:
        return F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, is_causal=causal)
    if (q.is_cuda if fold is None else fold) and mask is not None:
        rep = heads // kv           # query head h reads kv head h // rep: fold rows as (kv, rep * n)
        out = F.scaled_dot_product_attention(rows.reshape(1, kv, rep * n, hd), k, v, attn_mask=mask.repeat(rep, 1))
        return out.view(1, heads, n, hd)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

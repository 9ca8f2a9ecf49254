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

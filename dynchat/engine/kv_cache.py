"""The attention cache of the hand-written forwards (the lean target and the EAGLE-3 head): keys and
values per layer, the RoPE tables for every cached position, and optionally a per-position feature
row (the target's EAGLE-3 features), grown together by doubling.

Written once because its shapes are what a native kernel or a captured graph reads: (layers, kv
heads, capacity, head dim) keys and values, (capacity, head dim) cos/sin, always contiguous.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import torch


def common_prefix(held: Sequence[int], prompt: Sequence[int], limit: int) -> int:
    """How many leading tokens (at most `limit`) a cache's held sequence and a new prompt share."""
    m = min(len(held), len(prompt), limit)
    if list(held[:m]) == list(prompt[:m]):
        return m
    return next(i for i in range(m) if held[i] != prompt[i])


def switch_session(kept: collections.OrderedDict, leaving, left: tuple, key, fresh: Callable[[], tuple],
                   limit: int) -> tuple:
    """A conversation's caches kept between its turns: file the leaving one's state, take `key`'s (or
    fresh()), and keep at most `limit` conversations alive, the current one included (least recently
    used dropped)."""
    kept[leaving] = left
    state = kept.pop(key, None) or fresh()
    while kept and len(kept) >= limit:
        kept.popitem(last=False)
    return state


class KVCache:
    def __init__(self, layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device, rotary,
                 max_length: int | None = None, feature_width: int = 0, kv_dtype: torch.dtype | None = None):
        self.layers, self.n_kv, self.head_dim = layers, n_kv, head_dim
        self.dtype, self.device, self.rotary = dtype, device, rotary
        self.kv_dtype = kv_dtype or dtype            # keys and values (the RoPE tables and features: dtype)
        self.max_length, self.feature_width = max_length, feature_width
        self.capacity = 0
        self.k = self.v = self.cos = self.sin = None
        self.features: torch.Tensor | None = None

    def ensure(self, needed: int) -> None:
        """Room for `needed` positions: at least 256, doubling (capped at max_length, never below needed)."""
        if needed <= self.capacity:
            return
        cap = max(256, 1 << (needed - 1).bit_length())
        if self.max_length:
            cap = max(min(cap, self.max_length), needed)
        shape = (self.layers, self.n_kv, cap, self.head_dim)
        k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        v = torch.zeros_like(k)
        if self.k is not None:
            k[:, :, :self.capacity], v[:, :, :self.capacity] = self.k, self.v
        self.k, self.v = k, v
        if self.feature_width:
            feats = torch.zeros(cap, self.feature_width, dtype=self.dtype, device=self.device)
            if self.features is not None:
                feats[:self.capacity] = self.features
            self.features = feats
        with torch.no_grad():
            dummy = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(dummy, torch.arange(cap, device=self.device)[None])
        self.cos, self.sin = cos[0], sin[0]          # (cap, head_dim)
        self.capacity = cap

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store n new positions' keys and values (n, kv heads, head dim) of a layer at start.."""
        end = start + k.shape[0]
        self.k[layer, :, start:end] = k.transpose(0, 1)
        self.v[layer, :, start:end] = v.transpose(0, 1)

    def keep_path(self, first: int, slots: torch.Tensor) -> None:
        """After a tree verify: move the accepted nodes' entries (slots) to first, first+1, ..."""
        n = slots.numel()
        if n:
            self.k[:, :, first:first + n] = self.k[:, :, slots]
            self.v[:, :, first:first + n] = self.v[:, :, slots]
            if self.features is not None:
                self.features[first:first + n] = self.features[slots]

"""A lean functional forward for Llama-family models (Llama, Mistral, Qwen2, Qwen3).

Why: on a CPU a small model's forward through Transformers modules is mostly per-module Python
overhead, and verification of k+1 tokens should cost barely more than one token. This runs the
same weights as plain tensor ops: fused q/k/v and gate/up projections, a preallocated KV cache
rolled back by resetting a length, PyTorch SDPA. RoPE tables come from the model's own rotary
module, so every rope scaling Transformers supports is reproduced exactly.
"""
from __future__ import annotations

import collections
import os
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .graphs import StaticSteps, graphs_wanted
from .kv_cache import KVCache, switch_session
from .layer import Heads, attend, output_and_mlp
from .linear import (
    candidate_routes,
    cold_seconds,
    fastest_route,
    fuse,
    integer_activations,
    quantization_of,
    requested_route,
    route_linear,
    route_weight,
)
from .model import context_length
from .primitives import rms

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}


def supports(model) -> bool:
    cfg = model.config
    if cfg.model_type not in SUPPORTED or getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "max_window_layers", 0) < cfg.num_hidden_layers:
        return False      # Qwen2's per-layer window mix: left to Transformers
    if getattr(cfg, "layer_types", None) and any(t != "full_attention" for t in cfg.layer_types):
        return cfg.model_type == "mistral"
    return True


LINEAR_KEYS = ("qkv", "o", "gate_up", "down")
# conversations whose KV cache is kept between turns (each up to the context length: SmolLM2-135M's
# cache is 46 KB a token, 94 MB at 2,048 tokens)
KEPT_SESSIONS = int(os.environ.get("DYNCHAT_KV_SESSIONS", "4"))
PREFILL_ROWS = 32           # a prompt of this many tokens or more prefills through batched matmuls
KEPT_SCRATCH_ROWS = 64      # the native forward keeps its work buffer for up to this many rows (steps, verifies)


def batched_linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T as one BLAS matmul for many rows (prefill of the native routes): float32 weights as they
    are; GGUF blocks as the float weights they rebuild; per-row int8 scaled after the matmul."""
    from .linear import QuantWeight, dequantized

    if isinstance(w, QuantWeight):
        if w.block or w.dense is not None:
            return F.linear(x, dequantized(w), b)
        y = F.linear(x, w.data.to(x.dtype)) * w.scales.to(x.dtype)
        return y if b is None else y + b
    return F.linear(x, w, b)
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the fastest route by model shape: a route's speed depends on the machine and the weights' shapes,
# not on which copy of the weights it multiplies, so a model loaded again is not timed again
_ROUTE_BY_SHAPE: dict[tuple, str] = {}


class _Prepared:
    """Per model, built once: fused weights, and the matmul route chosen for this machine."""

    def __init__(self, model):
        self.layers = []
        with torch.no_grad():
            for layer in model.model.layers:
                a, m = layer.self_attn, layer.mlp
                bias = None
                if a.q_proj.bias is not None:
                    bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                self.layers.append({
                    "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
                    "qkv": fuse([a.q_proj, a.k_proj, a.v_proj]), "qkv_bias": bias,
                    "o": a.o_proj.weight, "o_bias": a.o_proj.bias,
                    "q_norm": getattr(a, "q_norm", None), "k_norm": getattr(a, "k_norm", None),
                    "gate_up": fuse([m.gate_proj, m.up_proj]), "down": m.down_proj.weight,
                    "gate_up_bias": None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias]),
                    "down_bias": m.down_proj.bias,
                })
        # a draft that proposes from part of the vocabulary (draft_vocab_ids) reads only those rows
        rows = getattr(model, "draft_vocab_ids", None)
        head = model.get_output_embeddings().weight
        self.lm_head = head if rows is None else head.detach()[rows.to(head.device)].contiguous()
        self.variants: dict[str, tuple] = {}
        self.routes: dict[bool, str] = {}          # the route chosen for exact (target) and draft use
        self.int_dot = getattr(model, "dynchat_int_dot", None)     # the preset's `int_dot`, else the environment's

    def variant(self, route: str) -> tuple:
        """(linear fn, per-layer weights, lm_head weight) for a matmul route, built once."""
        if route not in self.variants:
            with integer_activations(self.int_dot):
                self.variants[route] = (route_linear(route),
                                        [{k: route_weight(route, layer[k]) for k in LINEAR_KEYS} for layer in self.layers],
                                        route_weight(route, self.lm_head, output_head=True))
        return self.variants[route]


class LeanLM:
    """Same interface as CachedLM: forward(ids) -> logits, rollback(keep), length.

    linear: "plain" (F.linear), "onednn" (weights prepacked for oneDNN, CPU float32 only), "native"
    (dynchat's own kernels and decoder layer, engine/native, CPU with AVX2: float32 weights, or the GGUF
    blocks they were dequantized from, in integer dot products or to the float32 weights' bits),
    "bf16" (bfloat16 weights: half the bytes; drafters only, as it is not exact) or "auto"
    (default; DYNCHAT_LINEAR for targets, DYNCHAT_DRAFT_LINEAR for drafters): the first LeanLM of
    a model and use (exact target or draft) times the candidates on this machine, with the caches
    evicted between steps as the other model's forward does, and keeps the fastest; every later
    one (baseline and speculative decoders alike) shares that choice and the prepared weights.
    A quantized model (linear.quantization_of) always runs its own int8 or int4 route.
    """
    verifies_trees = True           # forward takes positions and a tree_mask
    keeps_sessions = True           # a cache per conversation (use_session)

    def __init__(self, model, linear: str | None = None, exact: bool = True):
        cfg = model.config
        self.model = model
        self.exact = exact
        self.device = model.device
        self.max_length = context_length(cfg)
        self.eps = cfg.rms_norm_eps
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        self.window = window if isinstance(window, int) and window > 0 else None
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.rotary = inner.rotary_emb
        self.heads = Heads(self.n_heads, self.n_kv, self.head_dim)
        self.q_size, self.kv_size = self.heads.q_size, self.heads.kv_size
        self.capture_ids: list[int] = []
        self.keep_normed = False      # keep the final normed hidden states of each forward (`normed`): head training
        self.normed: torch.Tensor | None = None
        self._capture_slot: dict[int, int] = {}       # layer -> its place among the captured features
        self._capture_at = torch.empty(0, dtype=torch.int32)
        self._scratch = torch.empty(0)                # decoder_stack's, for up to KEPT_SCRATCH_ROWS rows
        self.native, self.int8_activations = None, False     # until a route is chosen (_use)
        self.cache = self._new_cache()
        self.session = None                           # whose conversation the cache holds
        self._kept: collections.OrderedDict = collections.OrderedDict()   # other sessions' (cache, held), oldest first
        self.shared_prefix: tuple[int, ...] = ()     # the start every chat's prompt has (set by the engine)
        self._shared: tuple | None = None             # its cache rows (keys, values, features), once computed
        self.reset()
        if model not in _PREPARED:
            _PREPARED[model] = _Prepared(model)
        self.prep = _PREPARED[model]
        self.vocab_size = self.prep.lm_head.shape[0]
        self.inter = self.prep.layers[0]["down"].shape[1] if self.prep.layers else 0
        linear = requested_route(exact, linear, quantization_of(model))
        if linear == "auto":
            shape = (cfg.model_type, tuple(self.embed.shape), len(self.prep.layers), self.inter, self.vocab_size,
                     self.embed.dtype, str(self.device), exact, self.prep.int_dot)
            linear = self.prep.routes.get(exact) or _ROUTE_BY_SHAPE.get(shape) or fastest_route(
                candidate_routes(self.device, self.embed.dtype, exact), self._time_route)
            _ROUTE_BY_SHAPE[shape] = linear
        self.prep.routes[exact] = linear
        self._use(linear)

    def weight_bytes(self) -> int:
        """Bytes of weights one forward streams from memory: every layer's matmul weights (as the route
        stores them), norms and the output head; the embedding contributes a row per token."""
        def size(w) -> int:
            if w is None:
                return 0
            if isinstance(w, torch.Tensor):
                return w.numel() * w.element_size()
            return sum(size(t) for t in w.streamed())                  # a QuantWeight
        total = sum(size(w) for layer in self.weights for w in layer.values()) + size(self.head) + size(self.norm)
        return total + sum(size(layer[k]) for layer in self.prep.layers for k in ("ln1", "ln2"))

    def _use(self, route: str) -> None:
        self.linear, self.weights, self.head = self.prep.variant(route)
        self.route = route
        self.native = self._native_layers()
        if self.cache.kv_dtype != self.kv_dtype:       # the route decides the cache's type: start afresh
            self.cache, self._kept, self._shared = self._new_cache(), collections.OrderedDict(), None
            self.reset()
        self.use_static_steps(graphs_wanted(self.device))

    def use_static_steps(self, on: bool, capture: bool | None = None) -> None:
        """Run steps and verifies through graphs.py's fixed-shape forward (captured as CUDA graphs
        unless capture=False), where it applies: PyTorch's ops (not the native layers, not the
        row-by-row quantized verify), no sliding window."""
        applies = self.native is None and not self.window and self.route not in ("int8", "int4")
        self.static = StaticSteps(self, self.device.type == "cuda" if capture is None else capture) \
            if on and applies else None

    def _native_layers(self) -> torch.Tensor | None:
        """decoder_stack's table, when the whole layer stack can run on engine/native: per layer the 19
        pointers decoder_layer reads (ln1, ln2, each linear's weight, scale, mins and bias, the packed
        flags; 0 for none). Q4_1 or per-row int8 weights on the native kernels, or float32 weights
        (widths a multiple of 16); no q/k norms, no sliding window."""
        import ctypes

        from .linear import native_pointers
        from .native import library

        if self.route not in ("int8", "int4", "native") or self.window or self.embed.dtype != torch.float32 or library() is None:
            return None
        layers, self._packed_flags, self.int8_activations = [], [], False
        for layer, w in zip(self.prep.layers, self.weights):
            if layer["q_norm"] is not None:
                return None
            ptrs, packed = [], []
            for key in LINEAR_KEYS:
                native = native_pointers(w[key], float32_ok=self.route in ("native", "int4"))
                if native is None:
                    return None
                ptrs += native[0]
                packed.append(native[1])
                bias = layer[f"{key}_bias"]
                ptrs.append(None if bias is None else bias.data_ptr())
            self.int8_activations = self.int8_activations or any(packed)
            flags = torch.tensor(packed, dtype=torch.int32)
            self._packed_flags.append(flags)                        # alive as long as its pointer is used
            layers.append([layer["ln1"].data_ptr(), layer["ln2"].data_ptr(), *(ptr or 0 for ptr in ptrs), flags.data_ptr()])
        # the output head there too where the native kernels take it (else PyTorch's route after the stack)
        self._native_head = native_pointers(self.head, float32_ok=self.route in ("native", "int4"))
        head, flag = self._native_head or ((None, None, None), 0)
        p = ctypes.c_void_p
        self._stack_head = (p(self.norm.data_ptr()), *map(p, head), flag, self.vocab_size)    # decoder_stack's last
        return torch.tensor(layers, dtype=torch.int64)

    def _time_route(self, route: str) -> float:
        """Seconds for a mix of single-token steps and 5-token verifies, the decode loop's diet."""
        self._use(route)
        ids = torch.zeros(5, dtype=torch.long, device=self.device)

        def step(n: int):
            if self.length + n > self.max_length:
                self.reset()
            return self.forward(ids[:n])

        seconds = cold_seconds([lambda: step(1), lambda: step(5)], self.device, rounds=6)
        self.reset()
        return seconds

    def capture(self, layer_ids: list[int]) -> None:
        """Keep the inputs of these layers, concatenated, per cached position (EAGLE-3 features)."""
        self.capture_ids = list(layer_ids)
        self._capture_slot = {layer: i for i, layer in enumerate(self.capture_ids)}
        self._capture_at = torch.tensor([self._capture_slot.get(i, -1) for i in range(len(self.prep.layers))],
                                        dtype=torch.int32)           # per layer its feature slot, or -1 (native)
        self.cache = self._new_cache()        # allocated with the feature rows on the next forward
        self._kept.clear()                    # kept caches have no feature rows
        self._shared = None
        self.held = []

    def use_session(self, key) -> None:
        """Make `key`'s conversation the cache's: each conversation keeps its own cache between its turns,
        so a follow-up prefills only what is new even when other chats ran in between. At most
        KEPT_SESSIONS caches live (this one included); the least recently used is dropped."""
        if key == self.session:
            return
        self.cache, self.held = switch_session(self._kept, self.session, (self.cache, self.held), key,
                                               lambda: (self._new_cache(), []), KEPT_SESSIONS)
        self.length = 0
        self.session = key

    @property
    def kv_dtype(self) -> torch.dtype:
        """float16 where the native layers run llama.cpp's arithmetic (activations rounded to int8): its
        default cache type, half the bytes a long context's attention reads each step; else the model's."""
        return torch.float16 if self.native is not None and self.int8_activations else self.embed.dtype

    def _new_cache(self) -> KVCache:
        return KVCache(len(self.model.model.layers), self.n_kv, self.head_dim, self.embed.dtype, self.device, self.rotary,
                       self.max_length, len(self.capture_ids) * self.embed.shape[1], kv_dtype=self.kv_dtype)

    @property
    def features(self) -> torch.Tensor | None:
        """(capacity, 3H) when capturing, aligned with the cache: the inputs of the captured layers."""
        return self.cache.features

    @property
    def k(self) -> torch.Tensor:
        return self.cache.k

    @property
    def v(self) -> torch.Tensor:
        return self.cache.v

    # -- cache -------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0
        self.held: list[int] = []     # the tokens a finished generation left in the cache (the decoder says)

    def resume(self, keep: int) -> None:
        """A new sequence whose first `keep` tokens are the cache's (the decoder checked they match)."""
        self.reset()
        self.length = keep

    # -- the prefix every chat shares ------------------------------------------------------------
    def shared_rows(self, prompt_ids: Sequence[int]) -> int:
        """How many of the prompt's first tokens are the shared prefix (the chat template's start, its
        system prompt: 24 of a SmolLM2 chat's first ~40 tokens): all of it where the prompt begins
        with it and goes on, else 0."""
        p = len(self.shared_prefix)
        if not p or len(prompt_ids) <= p or tuple(prompt_ids[:p]) != self.shared_prefix or not self.reuses_prefix:
            return 0
        return p

    def begin(self, prompt_ids: Sequence[int], keep: int, max_reuse: int | None = None) -> int:
        """A new sequence whose first `keep` tokens the cache holds (the caller checked them), or the
        shared prefix's rows where those give more (a new chat: it prefills only its message) and
        max_reuse allows them. Returns the tokens kept."""
        shared = self.shared_rows(prompt_ids)
        if keep < shared <= (len(prompt_ids) if max_reuse is None else max_reuse):
            if self._shared is None:
                self._compute_shared(prompt_ids[:shared])      # the cache holds them now
            else:
                self._adopt_shared()
            keep = shared
        self.resume(keep)
        return keep

    @torch.inference_mode()
    def _compute_shared(self, ids: Sequence[int]) -> None:
        """The shared prefix's rows, computed alone from an empty cache: the same rows whatever prompt
        first began with it (within a longer first prompt a float route's batched prefill would
        round them otherwise)."""
        self.resume(0)
        self.forward(torch.as_tensor(list(ids), dtype=torch.long, device=self.device), last_only=True)
        p = len(ids)
        features = None if self.features is None else self.features[:p].clone()
        self._shared = (self.cache.k[:, :, :p].clone(), self.cache.v[:, :, :p].clone(), features)

    @torch.inference_mode()
    def _adopt_shared(self) -> None:
        """Copy the shared prefix's rows into this conversation's cache."""
        k, v, features = self._shared
        p = k.shape[2]
        self.cache.ensure(max(p, self.static.context) if self.static is not None else p)
        self.cache.k[:, :, :p], self.cache.v[:, :, :p] = k, v
        if features is not None and self.features is not None:
            self.features[:p] = features

    @property
    def reuses_prefix(self) -> bool:
        """On the native routes every later position is computed exactly as a single step would, so
        a spec round and a plain step that start from the same cache agree bit for bit, and the
        decoder may keep the cache between turns. Against a fresh prefill of the whole conversation
        a kept one differs only where that prefill would batch positions the turns computed one
        round at a time (a long prompt's first prefill is one batched matmul: faster, rounded
        differently)."""
        return self.native is not None

    def reserve(self, positions: int) -> None:
        """Room in the cache for `positions` (at most the context): grown now, not inside a later forward
        (growing copies every layer's keys and values: ~12 ms at 256 positions on one core of a 2-core EPYC)."""
        self.cache.ensure(min(positions, self.max_length))

    def rollback(self, keep: int) -> None:
        self.length = keep

    @torch.inference_mode()
    def keep_path(self, first: int, slots: torch.Tensor) -> None:
        """After a tree verify: move the accepted nodes' cache entries (slots) to first, first+1, ..."""
        self.cache.keep_path(first, slots)
        self.length = first + slots.numel()

    # -- forward -----------------------------------------------------------------------------
    def _attend(self, q: torch.Tensor, layer: int, keys, mask, causal: bool = False) -> torch.Tensor:
        """Attention of q (n, heads, hd) over the cached keys `keys` (a slice, or slot indices) of a layer."""
        k, v = self.k[layer:layer + 1, :, keys], self.v[layer:layer + 1, :, keys]
        return attend(q, k.to(q.dtype), v.to(q.dtype), mask, causal)

    def _row_keys(self, start: int, n: int, tree_mask: torch.Tensor | None) -> list[tuple]:
        """Per new row: the cache slots a single-token step at its position reads, in the same order
        (the prefix, then its tree ancestors by depth), and the sliding-window mask such a step uses."""
        rows = []
        for r in range(n):
            if tree_mask is None:
                keys = slice(0, start + r + 1)
            else:
                ancestors = start + tree_mask[r].nonzero()[:, 0]      # parents precede children
                keys = torch.cat([torch.arange(start, device=self.device), ancestors])
            length = start + r + 1 if tree_mask is None else keys.numel()
            mask = None
            if self.window:
                mask = (torch.arange(length, device=self.device) > length - 1 - self.window)[None]
            rows.append((keys, mask))
        return rows

    def _native_forward(self, ids: torch.Tensor, start: int, positions, tree_mask, last_only: bool) -> torch.Tensor:
        """The forward as one call of engine/native's decoder_stack (int8, 4-bit or float32 weights):
        embedding, every layer (each row attends over the slots a single-token step at its position
        reads, as the rowwise PyTorch path does; the captured layers' inputs go straight into the
        cache's feature rows), final norm and output head."""
        import ctypes

        from .native import library

        n, end, table = ids.numel(), start + ids.numel(), self.cache
        hidden, row = self.embed.shape[1], table.cos.stride(0) * table.cos.element_size()
        if positions is None:        # the tables' rows start.. as they lie
            cos, sin = table.cos.data_ptr() + start * row, table.sin.data_ptr() + start * row
        else:
            gathered = table.cos[positions].contiguous(), table.sin[positions].contiguous()
            cos, sin = (t.data_ptr() for t in gathered)
        keys, n_keys, max_keys = None, None, end        # a chain: row r attends the start + r + 1 keys before it
        if tree_mask is not None:
            rows = [k for k, _ in self._row_keys(start, n, tree_mask)]
            max_keys = max(r.numel() for r in rows)
            keys = torch.zeros(n, max_keys, dtype=torch.int32)
            for r, slots in enumerate(rows):
                keys[r, :slots.numel()] = slots
            n_keys = torch.tensor([r.numel() for r in rows], dtype=torch.int32)
        need = n * (2 * hidden + self.q_size + 2 * self.kv_size + self.q_size + 3 * self.inter)
        scratch = self._scratch
        if scratch.numel() < need:
            scratch = torch.empty(need)
            if n <= KEPT_SCRATCH_ROWS:       # a long prompt's (~150 KB a row at 2k width) is not kept
                self._scratch = scratch
        x = torch.empty(n, hidden)
        out_rows = 1 if last_only else n
        logits = torch.empty(out_rows, self.vocab_size) if self._native_head is not None else None
        if ids.dtype != torch.long or not ids.is_contiguous():
            ids = ids.to(torch.long).contiguous()
        features = self.features
        p = ctypes.c_void_p
        status = library().decoder_stack(
            p(x.data_ptr()), p(ids.data_ptr()), p(self.embed.data_ptr()), ctypes.c_long(self.embed.shape[0]), n, hidden,
            ctypes.c_float(self.eps), p(self.native.data_ptr()), len(self.native),
            p(None if features is None else self._capture_at.data_ptr()),
            p(None if features is None else features.data_ptr()), 0 if features is None else features.shape[1],
            self.n_heads, self.n_kv, self.head_dim, self.inter, p(self.k.data_ptr()), p(self.v.data_ptr()),
            ctypes.c_long(self.k.stride(0) * self.k.element_size()), int(self.k.dtype == torch.float16), self.k.shape[2],
            start, p(cos), p(sin), p(None if keys is None else keys.data_ptr()),
            p(None if n_keys is None else n_keys.data_ptr()), max_keys, p(scratch.data_ptr()), *self._stack_head, out_rows,
            p(None if logits is None else logits.data_ptr()))
        if status:
            raise IndexError(f"a token id is outside the model's {self.embed.shape[0]}-token vocabulary")
        self.length = end
        if self.keep_normed:
            self.normed = rms(x, self.norm, self.eps)
        if logits is None:
            logits = self.linear(rms(x[-out_rows:], self.norm, self.eps), self.head)
        return logits

    def layers(self, x: torch.Tensor, cos, sin, linear, write, attention, captured: list) -> torch.Tensor:
        """The layer stack in PyTorch ops (the dynamic forward and the static one of graphs.py):
        write(i, k, v) stores a layer's new keys and values, attention(q, i) -> (1, heads, n, hd)."""
        n = x.shape[0]
        for i, (layer, weights) in enumerate(zip(self.prep.layers, self.weights)):
            if i in self._capture_slot:
                captured.append((self._capture_slot[i], x))
            qkv = linear(rms(x, layer["ln1"], self.eps), weights["qkv"], layer["qkv_bias"])
            q, k, v = self.heads.split(qkv, cos, sin, layer["q_norm"], layer["k_norm"])
            write(i, k, v)
            x = output_and_mlp(x, attention(q, i)[0].transpose(0, 1).reshape(n, self.q_size), linear, weights["o"],
                               weights["gate_up"], weights["down"], layer["ln2"], self.eps,
                               (layer["o_bias"], layer["gate_up_bias"], layer["down_bias"]))
        return x

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last_only: bool = False, positions: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append ids to the cache; logits (n, V), or (1, V) for the last when last_only.

        A tree verify passes each token's position (its depth after the prefix) and tree_mask
        (n, n): which of the new tokens each may attend to (its ancestors and itself).
        """
        n, start = ids.numel(), self.length
        end = start + n
        if self.static is not None and self.static.takes(start, n, tree_mask is not None):
            return self.static.forward(ids, start, positions, tree_mask, last_only)
        self.cache.ensure(max(end, self.static.context) if self.static is not None else end)
        # a prompt's prefill (never compared with single steps: every mode prefills alike) is one batched
        # matmul per weight; the native kernels are made for the few rows of a step or a verify
        # (not with int8 activations: there a batched float prefill and the native rows round
        # differently, and a conversation's cache reused from an earlier turn would no longer give
        # what a fresh prefill gives; the integer kernels take any number of rows)
        if self.native is not None and n and not (start == 0 and n >= PREFILL_ROWS and not self.int8_activations):
            return self._native_forward(ids, start, positions, tree_mask, last_only)
        x = F.embedding(ids, self.embed)                               # (n, H)
        table = self.cache
        if positions is None:
            cos, sin = table.cos[start:end, None], table.sin[start:end, None]   # (n, 1, hd)
        else:
            cos, sin = table.cos[positions, None], table.sin[positions, None]
        mask = None
        if tree_mask is not None:
            if self.window:
                raise NotImplementedError("tree verification with a sliding window is not supported")
            mask = torch.cat([tree_mask.new_ones(n, start), tree_mask], dim=1)
        elif (n > 1 and start > 0) or self.window:
            q_pos = torch.arange(start, end, device=self.device)[:, None]
            k_pos = torch.arange(end, device=self.device)[None]
            allowed = k_pos <= q_pos
            if self.window:
                allowed &= k_pos > q_pos - self.window
            mask = allowed
        # a quantized target rounds activations to bfloat16 for its matmuls, which turns the last-bit
        # differences of a batched attention into different tokens: each verified row then attends
        # exactly as a single-token step at its position would (same call, same keys, same order)
        rowwise = self.exact and self.route in ("int8", "int4") and n > 1 and start > 0 and self.native is None
        rows = self._row_keys(start, n, tree_mask) if rowwise else None
        linear = batched_linear if self.native is not None else self.linear     # native: a batched prefill

        def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
            self.cache.write(i, start, k, v)

        def attention(q: torch.Tensor, i: int) -> torch.Tensor:
            if rows is not None:
                return torch.cat([self._attend(q[r:r + 1], i, keys, row_mask)
                                  for r, (keys, row_mask) in enumerate(rows)], dim=2)
            return self._attend(q, i, slice(0, end), mask, causal=mask is None and n > 1)

        captured = []
        x = self.layers(x, cos, sin, linear, write, attention, captured)
        if captured:
            self.features[start:end] = torch.cat([t for _, t in sorted(captured, key=lambda c: c[0])], dim=-1)
        if self.keep_normed:
            self.normed = rms(x, self.norm, self.eps)
        if last_only:
            x = x[-1:]
        self.length = end
        return (self.linear if last_only else linear)(rms(x, self.norm, self.eps), self.head)

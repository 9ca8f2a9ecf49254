"""Drafting with an EAGLE-3 head: a chain under the lookahead policy, or an EAGLE-2 dynamic tree.

The head keeps its own KV cache. Its "real" positions t take (target feature g_t, token
x_{t+1}); the target LM captures g_t for every position it caches (and rolls it back with
the cache), so each round the head first catches up on the positions the target verified
since, then drafts ahead feeding back its own pre-norm output. Drafted entries are simply
overwritten by the next round's real ones: nothing to undo.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from .drafters import Drafter, Proposal, draft_chain, setup_seconds, timed, widened
from .eagle3_head import Eagle3Head
from .kv_cache import KVCache, common_prefix, switch_session
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
from .primitives import rms


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2 dynamic tree: expand top_k nodes per level by top_k children, depth levels, keep the
    total_tokens - 1 best nodes (plus the root) for verification."""
    top_k: int = 4
    depth: int = 5
    total_tokens: int = 16

    def __post_init__(self):
        if self.top_k < 1 or self.depth < 1 or self.total_tokens < 2:
            raise ValueError(f"tree sizes must be top-k >= 1, depth >= 1, total tokens >= 2 "
                             f"(got {self.top_k}, {self.depth}, {self.total_tokens})")


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, target_model, tree: TreeShape | None = None):
        self.head = head
        self.layer_ids = head.check_target(target_model)
        head.share_embedding(target_model)
        self.shape = tree or None
        self.tree = self.shape is not None
        if self.tree:
            self.top_k, self.depth, self.total_tokens = tree.top_k, tree.depth, tree.total_tokens
        self.name = "eagle3-tree" if tree else "eagle3-chain"
        cfg = head.config
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.heads = Heads(self.n_heads, self.n_kv, self.head_dim)
        attn, layer = head.midlayer.self_attn, head.midlayer
        with torch.no_grad():
            self.qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            self.gate_up = fuse([layer.mlp.gate_proj, layer.mlp.up_proj])
        self.inter = layer.mlp.down_proj.weight.shape[1]
        self.weights = {"qkv": self.qkv, "o": attn.o_proj.weight, "gate_up": self.gate_up,
                        "down": layer.mlp.down_proj.weight, "lm_head": head.lm_head.weight, "fc": head.fc.weight}
        self.device = head.fc.weight.device
        self.read_once = self.device.type != "cpu"     # see draft_chain
        self._choose_route()
        self.native = self._native_layer()
        self.target_ids = head.to_target_ids(torch.arange(head.draft_vocab_size, device=head.d2t.device))
        self.target = None
        self.cache = self._new_cache()
        self.session, self.held = None, []      # the conversation whose real positions the cache holds, its tokens
        self._kept: collections.OrderedDict = collections.OrderedDict()    # other chats' (cache, held, real)
        self.fused = None            # NativeChain once attached, where the whole greedy step runs natively
        self.reset()

    def _new_cache(self) -> KVCache:
        return KVCache(1, self.n_kv, self.head_dim, self.qkv.dtype, self.device, self.head.rotary_emb)

    def _choose_route(self) -> None:
        """The matmul route that runs a draft step fastest here (linear.fastest_route; bf16 weights are
        allowed: a drafter need not be exact). DYNCHAT_DRAFT_LINEAR forces one."""
        variants: dict[str, tuple] = {}       # route -> (linear fn, weights), each built once

        def variant(route: str) -> tuple:
            if route not in variants:
                with integer_activations(getattr(self.head, "dynchat_int_dot", None)):
                    variants[route] = route_linear(route), {k: route_weight(route, w, output_head=k == "lm_head")
                                                            for k, w in self.weights.items()}
            return variants[route]

        route = requested_route(exact=False, quantization=quantization_of(self.head))
        if route == "auto":
            route = fastest_route(candidate_routes(self.device, self.qkv.dtype, exact=False),
                                  lambda r: self._step_time(*variant(r)))
        self.route = route
        self.linear, self.W = variant(route)

    def _native_layer(self) -> tuple | None:
        """The pointers engine/native's eagle3_layer reads, where the head's layer can run there: float32
        on the CPU, each matmul weight Q4_1 blocks or per-row int8 (the int4 and int8 routes; packed
        for integer dot products where the head's activations are int8) or float32 on the native
        kernel, as the target's decoder_layer takes them."""
        from .linear import native_pointers
        from .native import library

        layer = self.head.midlayer
        if self.device.type != "cpu" or self.qkv.dtype != torch.float32 or library() is None:
            return None
        ptrs, packed = [], []
        for key in ("qkv", "o", "gate_up", "down"):
            native = native_pointers(self.W[key], float32_ok=self.route == "native")
            if native is None:
                return None
            ptrs += [*native[0], None]                                   # no bias
            packed.append(native[1])
        self._norms = [t.detach().float().contiguous() for t in
                       (layer.input_layernorm.weight, layer.hidden_norm.weight, layer.post_attention_layernorm.weight)]
        self._flags = torch.tensor(packed, dtype=torch.int32)
        return (*(t.data_ptr() for t in self._norms), *ptrs, self._flags.data_ptr())

    def _native_forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        """_forward's causal case (a chain step, a catch-up) in one native call: the same layer (the last
        row's output, as _forward gives it there)."""
        import ctypes

        from .native import library

        n, cache = tokens.numel(), self.cache
        x = hidden.float().contiguous().clone()
        emb = torch.nn.functional.embedding(tokens, self.head.embedding()).float().contiguous()
        cos, sin = cache.cos[positions].contiguous(), cache.sin[positions].contiguous()
        n_keys = torch.arange(slot + 1, slot + n + 1, dtype=torch.int32)
        hidden_size, q = x.shape[1], self.heads.q_size
        scratch = torch.empty(n * (3 * hidden_size + q + 2 * self.n_kv * self.head_dim + q + 3 * self.inter))
        library().eagle3_layer(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(emb.data_ptr()), n, hidden_size, ctypes.c_float(self.eps),
            *map(ctypes.c_void_p, self.native), self.n_heads, self.n_kv, self.head_dim, self.inter,
            ctypes.c_void_p(cache.k.data_ptr()), ctypes.c_void_p(cache.v.data_ptr()), int(cache.k.dtype == torch.float16),
            cache.k.shape[2], slot,
            ctypes.c_void_p(cos.data_ptr()), ctypes.c_void_p(sin.data_ptr()), ctypes.c_void_p(None),
            ctypes.c_void_p(n_keys.data_ptr()), slot + n, ctypes.c_void_p(scratch.data_ptr()))
        return x[-1:]

    def _step_time(self, lin, W: dict) -> float:
        """Seconds for the head's matmuls of one draft step."""
        xs = {k: torch.randn(1, w.shape[1]) for k, w in self.weights.items()}
        return cold_seconds([lambda: [lin(xs[k], W[k]) for k in ("qkv", "o", "gate_up", "down", "lm_head")]],
                            self.device)

    def attach(self, target_lm) -> None:
        target_lm.capture(self.layer_ids)
        self.target = target_lm
        self.fused = NativeChain.of(self) if self.native is not None else None

    def reset(self) -> None:
        self.real = 0          # positions of the head's cache that hold target features
        self.started = False   # whether this reply has drafted yet (its first draft reads what the head lacks)

    def resume(self, session, prompt_ids, max_reuse=None) -> None:
        """Like the target's, the head's cache is kept per conversation between its turns (lean's
        KEPT_SESSIONS, least recently used dropped): a follow-up's first draft reads only what the head
        has not seen (a seventh turn's ~930 tokens took 4.3-5.8 ms). A real position t pairs the
        target's feature at t with token t + 1, so it is kept while the tokens up to t + 1 are the prompt's."""
        from .lean import KEPT_SESSIONS

        real = self.real
        if session != self.session:
            last = (self.cache, self.held, self.real)
            self.cache, self.held, real = switch_session(self._kept, self.session, last, session,
                                                         lambda: self._new_chat(last, prompt_ids, max_reuse), KEPT_SESSIONS)
            self.session = session
        same = common_prefix(self.held, prompt_ids, len(prompt_ids) if max_reuse is None else max_reuse)
        self.reset()
        # and while the target kept its features: those it computes again (a session it dropped, a
        # comparison run) may round differently
        self.real = min(real, max(same - 1, 0), self.target.length if self.target is not None else 0)
        self.held = list(prompt_ids[:self.real + 1])     # what the kept positions read, until finish says more

    def finish(self, sequence) -> None:
        self.held = list(sequence)

    @torch.inference_mode()
    def _new_chat(self, last: tuple, prompt_ids, max_reuse) -> tuple:
        """A new conversation's cache: the positions of the start all chats share (the target's
        shared_prefix, as its own rows) copied from the last conversation's, where that began so too."""
        cache, held, real = last
        shared = self.target.shared_rows(prompt_ids) if self.target is not None else 0
        shared = shared if max_reuse is None else min(shared, max_reuse)
        new = self._new_cache()
        if shared < 2 or real < shared - 1 or list(held[:shared]) != list(prompt_ids[:shared]) \
                or self.target.length < shared:
            return new, [], 0
        new.ensure(shared)
        new.k[:, :, :shared - 1], new.v[:, :, :shared - 1] = cache.k[:, :, :shared - 1], cache.v[:, :, :shared - 1]
        return new, list(prompt_ids[:shared]), shared - 1

    # -- the head's forward over its own cache ---------------------------------------------------
    @torch.inference_mode()
    def _forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slot: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """Write n entries at slots slot.. and return the pre-norm outputs (n, H); in the causal case only
        the last row's (1, H): all a catch-up or a chain step reads (engine/native computes no other).

        mask: (n, slot + n) which cache entries each new entry attends to; None = causal over all.
        """
        n = tokens.numel()
        end = slot + n
        cache = self.cache
        cache.ensure(end)
        last_only = mask is None
        if self.native is not None and mask is None:
            return self._native_forward(hidden, tokens, positions, slot)
        head, layer = self.head, self.head.midlayer
        x = head.layer_input(hidden, tokens)
        lin, W = self.linear, self.W
        q, k, v = self.heads.split(lin(x, W["qkv"]), cache.cos[positions, None], cache.sin[positions, None])
        cache.write(0, slot, k, v)
        if mask is None and n > 1 and slot:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(slot)
        att = attend(q, cache.k[:, :, :end], cache.v[:, :, :end], mask, causal=mask is None and n > 1)
        att = att[0].transpose(0, 1).reshape(n, self.heads.q_size)
        if last_only:
            hidden, att = hidden[-1:], att[-1:]
        return output_and_mlp(hidden, att, lin, W["o"], W["gate_up"], W["down"], layer.post_attention_layernorm.weight,
                              self.eps)

    @torch.inference_mode()
    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits."""
        return self.linear(rms(out, self.head.norm.weight, self.eps), self.W["lm_head"])

    @torch.inference_mode()
    def _catch_up(self, committed: torch.Tensor) -> torch.Tensor:
        """Feed the real positions the target has verified since last round; the last one's output."""
        m = committed.numel()
        start, stop = self.real, m - 1            # position t pairs g_t with x_{t+1}; g_{m-1} is not computed yet
        feats = self.target.features[start:stop]
        hidden = self.linear(feats.to(self.qkv.dtype).contiguous(), self.W["fc"])
        positions = torch.arange(start, stop, device=self.device)
        out = self._forward(hidden, committed[start + 1:m], positions, start, None)
        self.real = stop
        return out[-1:]

    # -- proposals --------------------------------------------------------------------------------
    def prefill(self, committed):
        """Nothing: the head reads the prompt when it first drafts (Proposal.setup_s), so a reply whose
        rounds the policy leaves to lookup or to plain steps never runs it (0.47-0.72 ms on the bench's prompts)."""

    def propose(self, committed, max_tokens, policy, sampler):
        t0 = time.perf_counter()
        room = self.target.max_length - committed.numel()
        max_tokens = min(max_tokens, room)
        if max_tokens <= 0:
            return Proposal(committed.new_empty(0))
        setup_s = 0.0
        if not self.started:       # what the head lacks of the prompt and the reply so far: once a reply
            self.started = True
            if committed.numel() - 2 > self.real:
                self._catch_up(committed[:-1])
                setup_s, t0 = setup_seconds(t0, self.device)
        if self.fused is not None and sampler.params.greedy and not self.tree and not self.read_once:
            proposal = self.fused.chain(committed, max_tokens, policy)
        else:
            out = self._catch_up(committed)
            if self.tree:
                proposal = self._tree(committed.numel(), out, max_tokens, room)
            else:
                proposal = self._chain(committed.numel(), out, max_tokens, policy, sampler)
        proposal.setup_s = setup_s
        return timed(proposal, t0, self.device)

    def _chain(self, m, out, max_tokens, policy, sampler) -> Proposal:
        """Drafts chosen over the head's draft vocabulary (argmax, or a sample of its warped distribution),
        then named by target id (drafters.widened)."""
        state = {"out": out, "j": 0}

        def advance(tok):      # head position m-2+j: own output of the previous position, the token just drafted
            state["j"] += 1
            p = m - 2 + state["j"]
            state["out"] = self._forward(state["out"], self.target_ids[tok], torch.tensor([p], device=self.device), p, None)
            return self._logits(state["out"])

        proposal = draft_chain(self._logits(out), advance, max_tokens, policy, sampler, self.read_once)
        return widened(proposal, self.target_ids, self.target.vocab_size)

    def _tree(self, m, out, max_depth, room) -> Proposal:
        """EAGLE-2 dynamic tree: expand the top_k best nodes per level by top_k children, keep the
        total_tokens - 1 best nodes overall by cumulative log-probability. Built with tensor ops on
        the device (each node's fed ancestors a boolean row): the round reads the host once, for
        the kept tree's tokens, parents and depths."""
        k, depth = self.top_k, min(self.depth, max_depth)
        budget = min(self.total_tokens - 1, room - 1)
        logp = torch.log_softmax(self._logits(out).float(), -1)[0]
        score, idx = logp.topk(min(k, logp.numel()))
        # pool of nodes: draft id, parent (index in pool, -1 = root), cumulative score, depth, and the head
        # cache slots (counted from m - 1) of its ancestors, fed in earlier levels
        tok_l, parent_l, score_l, depth_l = [idx], [torch.full_like(idx, -1)], [score], [torch.ones_like(idx)]
        width = k * max(depth - 1, 1)
        anc_l = [torch.zeros(idx.numel(), width, dtype=torch.bool, device=self.device)]
        frontier = torch.arange(idx.numel(), device=self.device)      # pool indices of the current level
        parent_out = out.expand(idx.numel(), -1)
        fed = 0                                                         # slots fed this round
        for d in range(2, depth + 1):
            pool_tok, anc = torch.cat(tok_l), torch.cat(anc_l)
            n = frontier.numel()
            # attention: the real positions, each frontier node's fed ancestors, itself
            own = torch.eye(n, dtype=torch.bool, device=self.device)
            mask = torch.cat([torch.ones(n, m - 1, dtype=torch.bool, device=self.device), anc[frontier, :fed], own], 1)
            positions = torch.full((n,), m - 3 + d, device=self.device)
            out = self._forward(parent_out, self.target_ids[pool_tok[frontier]], positions, m - 1 + fed, mask)
            logp = torch.log_softmax(self._logits(out).float(), -1)
            child_score, child_idx = logp.topk(min(k, logp.shape[-1]), dim=-1)        # (n, k)
            children = child_idx.shape[1]
            cum = (torch.cat(score_l)[frontier][:, None] + child_score).flatten()
            child_anc = anc[frontier].clone()                               # the parent's ancestors and the parent
            child_anc[:, fed:fed + n] |= own
            fed += n
            base = pool_tok.numel()
            tok_l.append(child_idx.flatten())
            parent_l.append(frontier.repeat_interleave(children))
            score_l.append(cum)
            depth_l.append(torch.full_like(cum, d, dtype=torch.long))
            anc_l.append(child_anc.repeat_interleave(children, 0))
            best = cum.topk(min(k, cum.numel())).indices
            frontier = base + best
            parent_out = out.repeat_interleave(children, dim=0)[best]
        tokens, parents, scores, depths = torch.cat(tok_l), torch.cat(parent_l), torch.cat(score_l), torch.cat(depth_l)
        # the best nodes by score, ancestors first on ties (a child never scores above its parent), then
        # ordered by depth (parents before children), by score within a level
        by_depth = depths.argsort(stable=True)
        order = by_depth[(-scores[by_depth]).argsort(stable=True)][:budget]
        by_score = order[(-scores[order]).argsort(stable=True)]
        keep = by_score[depths[by_score].argsort(stable=True)]
        new_index = torch.full_like(parents, -1)
        new_index[keep] = torch.arange(keep.numel(), device=self.device)
        par = torch.where(parents[keep] >= 0, new_index[parents[keep].clamp(min=0)], -1)
        target_tokens = self.target_ids[tokens[keep]]
        host_tokens, host_par, host_depths = torch.stack([target_tokens, par, depths[keep]]).tolist()   # the one read
        return Proposal(target_tokens, parents=host_par, depths=host_depths, token_ids=host_tokens)

    def rollback(self, n_accepted, path=None):
        pass        # nothing to undo: the next round overwrites drafted entries with real ones


class NativeChain:
    """A greedy chain drafted by engine/native's eagle3_draft, one call a token: the catch-up on the
    target's new features with the first draft, then each further step (feed back, layer, logits,
    argmax, confidence). The same layer and matmul kernels as the drafter's PyTorch-driven steps,
    without the ~25 operators a token around them (a 4-token chain 0.63 against 0.32 ms on SmolLM2's
    head); the lookahead policy still decides after every token, reading its confidence from host
    memory (the CPU's: nothing to sync)."""

    def __init__(self, drafter: Eagle3Drafter, fc: tuple, lm_head: tuple):
        import ctypes

        from .native import library

        p = ctypes.c_void_p
        self.d, self.fn = drafter, library().eagle3_draft
        cfg = drafter.head.config
        self.hidden = cfg.hidden_size
        self.embedding = drafter.head.embedding()
        self.target_ids = drafter.target_ids.contiguous()
        self.norm = drafter.head.norm.weight.detach().float().contiguous()
        self.tokens = torch.zeros(32, dtype=torch.long)        # the chain's target ids (grown for longer chains)
        self.confidence = ctypes.c_float()        # a float in host memory, read after each call (not a tensor read)
        self.x, self.scratch = torch.empty(0), torch.empty(0)
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.floats_per_row = 5 * self.hidden + 2 * q + 2 * kv + 3 * drafter.inter + 1     # eagle3_draft's scratch
        # the arguments every call passes alike: fc, the layer's norms, the final norm, lm_head; the layer's weights
        self.fixed = (ctypes.c_float(drafter.eps), *map(p, fc[0]), fc[1], drafter.weights["fc"].shape[1],
                      *map(p, drafter.native[:3]), p(self.norm.data_ptr()), *map(p, lm_head[0]), lm_head[1],
                      self.target_ids.numel(), p(self.target_ids.data_ptr()))
        self.layer = (*map(p, drafter.native[3:]), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                      drafter.inter)

    @classmethod
    def of(cls, drafter: Eagle3Drafter) -> NativeChain | None:
        """Where the head's fc and lm_head run on the native kernels too and its embedding is float32."""
        from .linear import native_pointers

        fc, lm_head = (native_pointers(drafter.W[k], float32_ok=drafter.route == "native") for k in ("fc", "lm_head"))
        emb = drafter.head.embedding()
        if fc is None or lm_head is None or emb.dtype != torch.float32 or not emb.is_contiguous():
            return None
        return cls(drafter, fc, lm_head)

    def _call(self, feats: torch.Tensor | None, tokens_at: int, n: int, slot: int, out: int) -> float:
        """eagle3_draft over n positions from `slot` (their target ids at address tokens_at); the draft
        goes to self.tokens[out]; its confidence is returned."""
        import ctypes

        p, cache = ctypes.c_void_p, self.d.cache
        row = cache.cos.stride(0) * cache.cos.element_size()
        status = self.fn(p(self.x.data_ptr()), p(None if feats is None else feats.data_ptr()), p(tokens_at),
                p(self.embedding.data_ptr()), ctypes.c_long(self.embedding.shape[0]), n, self.hidden, *self.fixed,
                p(self.tokens.data_ptr() + 8 * out), ctypes.byref(self.confidence), *self.layer,
                p(cache.k.data_ptr()), p(cache.v.data_ptr()), int(cache.k.dtype == torch.float16), cache.k.shape[2], slot,
                p(cache.cos.data_ptr() + slot * row), p(cache.sin.data_ptr() + slot * row), p(None), p(None), 0,
                p(self.scratch.data_ptr()))
        if status:
            raise IndexError(f"a token id is outside the head's {self.embedding.shape[0]}-token embedding")
        return self.confidence.value

    @torch.inference_mode()
    def chain(self, committed: torch.Tensor, max_tokens: int, policy) -> Proposal:
        """draft_chain's per-token loop, the head's real positions caught up in its first call."""
        d, m = self.d, committed.numel()
        start, stop = d.real, m - 1               # as _catch_up: position t pairs g_t with x_{t+1}
        n = stop - start
        if self.tokens.numel() < max_tokens:
            self.tokens = torch.zeros(max_tokens, dtype=torch.long)
        if n < 1:                                 # nothing verified since the last draft: nothing to draft from
            return Proposal(committed.new_empty(0))
        d.cache.ensure(m - 1 + max_tokens)
        if self.scratch.numel() < n * self.floats_per_row + self.target_ids.numel():
            self.scratch = torch.empty(n * self.floats_per_row + self.target_ids.numel())
        if self.x.numel() < n * self.hidden:
            self.x = torch.empty(n, self.hidden)
        feats = d.target.features[start:stop].float().contiguous()
        ids = committed[start + 1:m].contiguous()
        confidence = self._call(feats, ids.data_ptr(), n, start, 0)
        d.real = stop
        confidences, drafted = [], 0
        while True:
            drafted += 1
            confidences.append(confidence)
            if not policy.keep_drafting(drafted, confidence if policy.needs_confidence else None) \
                    or drafted == max_tokens:
                break
            # the token just drafted, fed back at the head position after the last one's (m - 2 + drafted)
            confidence = self._call(None, self.tokens.data_ptr() + 8 * (drafted - 1), 1, m - 2 + drafted, drafted)
        return Proposal(self.tokens[:drafted].clone(), None, confidences if policy.needs_confidence else [])

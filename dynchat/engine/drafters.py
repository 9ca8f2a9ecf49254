"""Drafters propose the tokens the target verifies. The decoding loop knows only this interface.

A drafter sees the committed sequence, proposes up to `max_tokens` tokens (with the draft
distribution each was drawn from when sampling), and is told how many were accepted so it can
roll its own state back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .forward import make_lm
from .kv_cache import common_prefix
from .lean import KEPT_SESSIONS
from .native import argmax
from .policies import LookaheadPolicy
from .sampling import Sampler


@dataclass
class Proposal:
    tokens: torch.Tensor                       # (k,) draft tokens, in the target's vocabulary
    probs: torch.Tensor | None = None          # (k, V_target) draft distributions when sampling
    confidences: list[float] = field(default_factory=list)   # draft prob of each token, when the policy asked
    seconds: float = 0.0
    parents: list[int] | None = None           # a tree: each token's parent (index in tokens, -1 = the last committed)
    depths: list[int] | None = None            # a tree: each token's depth (1 = right after the last committed)
    token_ids: list[int] | None = None         # the tokens on the host, when the drafter read them anyway
    chain: int | None = None                   # a tree whose first `chain` nodes are the model's chain (the rest lookup's)
    setup_s: float = 0.0                       # catching the drafter up on the prompt: once a reply, not a round's cost


def choose(logits: torch.Tensor, sampler: Sampler, policy: LookaheadPolicy):
    """One draft token from (1, V) logits: (token (1,), its distribution row when sampling, the
    draft's probability of it as a 0-d device tensor when the policy asks). Reads nothing."""
    if sampler.params.greedy:
        tok = argmax(logits)
        conf = torch.softmax(logits.float(), -1).gather(-1, tok.view(1, 1))[0, 0] if policy.needs_confidence else None
        return tok, None, conf
    q = sampler.probs(logits)
    tok = sampler.sample(q)
    return tok, q, q.gather(-1, tok.view(1, 1))[0, 0] if policy.needs_confidence else None


def draft_chain(logits: torch.Tensor, advance, max_tokens: int, policy: LookaheadPolicy, sampler: Sampler,
                read_once: bool) -> Proposal:
    """The draft-until-the-policy-stops loop of every model drafter: draft from `logits` (1, V), then
    `advance(token)` gives the next logits, until the policy stops or `max_tokens` are drafted.

    A policy that stops on the draft's confidence needs it per token. On a CPU that read is free
    and a draft step is not, so the loop reads each and stops at once. With `read_once` (an
    accelerator, where a read stalls the queue) it drafts the policy's planned length, reads all
    confidences in one transfer, and cuts the chain where the policy, asked token by token, stops:
    the same tokens as the per-token loop would have kept from that many."""
    per_token = policy.needs_confidence and not read_once
    steps = min(max_tokens, policy.planned_lookahead()) if read_once and policy.needs_confidence else max_tokens
    tokens, rows, confidences = [], [], []
    for j in range(steps):
        if j:
            logits = advance(tokens[-1])
        tok, q, c = choose(logits, sampler, policy)
        tokens.append(tok)
        if q is not None:
            rows.append(q)
        if c is not None:
            confidences.append(float(c) if per_token else c)
        if (per_token or not policy.needs_confidence) and not policy.keep_drafting(j + 1, confidences[-1] if per_token
                                                                                    else None):
            break
    if confidences and not per_token:
        confidences = torch.stack(confidences).tolist()                 # the round's one read of them
        keep = next((j + 1 for j, c in enumerate(confidences) if not policy.keep_drafting(j + 1, c)), len(tokens))
        tokens, rows, confidences = tokens[:keep], rows[:keep], confidences[:keep]
    return Proposal(torch.cat(tokens), torch.cat(rows) if rows else None, confidences)


def widened(proposal: Proposal, target_ids: torch.Tensor, vocab_size: int) -> Proposal:
    """A proposal drafted over a draft vocabulary, in the target's: its tokens as target ids and, when
    sampled, its distributions spread over the target's vocabulary (0 outside the draft's). Drafting
    samples over the draft's own few thousand tokens and widens once a round: warping and sampling
    over the target's 49,152 columns cost each drafted token ~0.3 ms on a CPU (top-p)."""
    proposal.tokens = target_ids[proposal.tokens]
    if proposal.probs is not None:
        rows = proposal.probs
        proposal.probs = rows.new_zeros(rows.shape[0], vocab_size).index_copy_(1, target_ids, rows)
    return proposal


def leading(path: list[int], nodes) -> int:
    """How many of a kept tree path's first nodes are `nodes`, in order (a branch's accepted tokens)."""
    return next((i for i, (a, b) in enumerate(zip(path, nodes)) if a != b), min(len(path), len(nodes)))


def timed(proposal: Proposal, t0: float, device: torch.device) -> Proposal:
    """The proposal with the seconds its drafting took (on an accelerator, once its queued work is done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    proposal.seconds = time.perf_counter() - t0
    return proposal


def setup_seconds(t0: float, device: torch.device) -> tuple[float, float]:
    """Seconds since t0 spent catching a drafter up on the prompt (Proposal.setup_s: once a reply, not a
    round's cost; on an accelerator once its queued work is done), and the time the round's own work starts."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    return now - t0, now


class Drafter:
    name = "drafter"
    # new tokens of a reply before the drafter first drafts: one whose start costs a forward over the
    # prompt waits, so a short reply never pays it (free_draft still runs in those rounds)
    start_after = 0

    def attach(self, target_lm) -> None:
        """Called once by the decoder with the target it drafts for (EAGLE-3 reads its features)."""

    def reset(self) -> None:
        """Forget the previous sequence (a new generation starts)."""

    def resume(self, session, prompt_ids: list[int], max_reuse: int | None = None) -> None:
        """A new generation of conversation `session` starts from `prompt_ids`: a drafter with its own
        cache may keep what it holds of that conversation's last generation (see finish), at most
        `max_reuse` tokens (the decoder's cap for the target: a comparison run prefills as much as the
        run it is compared with); else reset."""
        self.reset()

    def finish(self, sequence: list[int]) -> None:
        """The generation ended with `sequence` (prompt and reply, on the host)."""

    def prefill(self, committed: torch.Tensor) -> None:
        """The prompt and the first token are committed: read the prompt now, with the target's
        prefill, so the first round's drafting time (which lookahead policies learn from) is a
        round's and not the prompt's (a drafter that starts late reads it then, as setup_s)."""

    def propose(self, committed: torch.Tensor, max_tokens: int, policy: LookaheadPolicy, sampler: Sampler) -> Proposal:
        raise NotImplementedError

    def rollback(self, n_accepted: int, path: list[int] | None = None) -> None:
        """Roll the draft's state back to the committed sequence: the target kept the first
        n_accepted proposed tokens (then added one of its own); for a tree, `path` names the kept
        nodes. A drafter that learns from the outcome learns here."""

    def extend(self, new_ids: list[int]) -> None:
        """The round's committed tokens, already on the host (the decoder reads them once a round):
        a drafter that keeps the sequence on the host takes them from here instead of reading."""

    def free_draft(self, committed: torch.Tensor, max_tokens: int) -> Proposal | None:
        """A draft that costs no forward, for a round the lookahead policy drafts nothing (None: none)."""
        return None


class DraftModelDrafter(Drafter):
    """A small causal LM sharing the target's tokenizer, with its own KV cache.

    Its cache always holds a prefix of the committed sequence: each round feeds only the
    committed tokens it has not seen (the last one, or two after a fully accepted round), and
    the last drafted token is never fed, so nothing is computed twice.

    With `start_after` > 0 the prompt is not read at prefill: the first draft round catches up on
    the prompt and the reply so far in one forward (Proposal.setup_s), and a reply that ends
    before that never runs the draft at all. The draft's prefill costs ~4/30 of the target's for
    SmolLM2's 4-layer draft: a short reply (a rewritten sentence) cannot earn it back.

    Like the target's, its cache is kept per conversation between turns (the model's KEPT_SESSIONS,
    least recently used dropped): a follow-up catches up on the new message only.

    A catch-up longer than `catch_up_window` tokens reads only the window's last tokens, after the
    first SINK_ROWS rows its cache holds (the system prompt all chats share), as StreamingLLM keeps
    its attention sinks and recent tokens: the draft's positions run on without the gap, the target
    verifies every token anyway. Why: reading all of a chat that ran in another mode (~690 tokens at
    the sixth turn) costs a 4-layer draft ~33 ms on 2 cores, more than a 65-token reply's drafts save
    (its first assistant reply ran 0.78-0.83x plain decoding so). A windowed cache is kept for the conversation's next turn like
    any other: `held` lists the tokens its rows hold, and the next prompt is compared without the
    tokens the window skipped.
    """
    name = "assistant"
    SINK_ROWS = 32

    def __init__(self, model, target_vocab_size: int, backend: str | None = None, exact: bool = False,
                 start_after: int = 0, catch_up_window: int | None = None):
        self.start_after = start_after
        self.catch_up_window = catch_up_window
        self._offset = 0        # committed tokens the cache skipped after its sink rows (a windowed catch-up)
        self._sink = 0
        self._windows: dict = {}  # per conversation whose kept cache skipped tokens: (offset, sink)
        self._session = None
        # a drafter need not be exact (lossless anyway), so it may take a cheaper matmul route; exact=True
        # keeps the target's route (the target drafting for itself computes exactly what it verifies)
        self.lm = make_lm(model, backend, exact=exact)
        self.target_vocab = target_vocab_size
        # a draft that proposes from part of the vocabulary: its logits' columns are these target ids
        self.vocab_ids = getattr(model, "draft_vocab_ids", None)
        # where its forward gives logits over that vocabulary only (the lean forward reads only its rows),
        # drafts are chosen among them, then named by target id: no scatter to the target's 49,152 columns
        # and no softmax over them (0.13 ms of SmolLM2's 0.6 ms draft step, greedy; sampled, see widened);
        # trained vocabularies are sorted (head_init.draft_vocabulary), so an exact tie goes to the same
        # token as over the target's width
        narrow = self.vocab_ids is not None and self.lm.vocab_size == len(self.vocab_ids) != target_vocab_size
        self._target_ids = torch.as_tensor(self.vocab_ids, dtype=torch.long, device=self.lm.device) if narrow else None
        self._fed_before = 0
        self._drafted = 0
        self.read_once = self.lm.device.type != "cpu"     # see draft_chain

    def reset(self) -> None:
        self.lm.reset()
        self._started = False
        self._offset = 0
        self._session = None

    def resume(self, session, prompt_ids, max_reuse=None):
        self.lm.use_session(session)
        self._session = session
        offset, sink = self._windows.pop(session, (0, 0)) if self.lm.keeps_sessions else (0, 0)
        limit = len(prompt_ids) - 1 if max_reuse is None else min(len(prompt_ids) - 1, max_reuse)
        ids, keep = prompt_ids, common_prefix(self.lm.held, prompt_ids, limit)   # held: the tokens its rows hold
        self._offset, self._sink = 0, sink
        if offset and max_reuse is None:    # a windowed cache: the prompt without the tokens the window skipped
            skipped = list(prompt_ids[:sink]) + list(prompt_ids[sink + offset:])
            kept = common_prefix(self.lm.held, skipped, len(skipped) - 1)
            if kept > max(sink, keep):
                ids, keep, self._offset = skipped, kept, offset
        self.lm.begin(ids, keep, max_reuse)      # a new chat: the shared start's rows, as the target's
        self._started = False

    def finish(self, sequence):
        if self.lm.keeps_sessions:          # Transformers' cache is one for every chat: never resumed
            rows = list(sequence[:self._sink]) + list(sequence[self._sink + self._offset:]) if self._offset else sequence
            self.lm.held = list(rows[:self.lm.length])
            if self._offset:
                self._windows[self._session] = (self._offset, self._sink)
                while len(self._windows) > KEPT_SESSIONS:     # no more than the caches kept: the oldest go
                    self._windows.pop(next(iter(self._windows)))

    def prefill(self, committed):
        room = self.lm.max_length - 1
        if not self.start_after and self.lm.length < committed.numel() - 1 <= room:   # propose feeds the last token
            self._catch_up(committed)
            self._started = True

    def _catch_up(self, committed) -> None:
        """Read what the cache lacks of the committed sequence but its last token (within the window)."""
        window, end = self.catch_up_window, committed.numel() - 1
        if window is not None and end - self._offset - self.lm.length > window:
            self._sink = min(self.lm.length, self.SINK_ROWS)
            self.lm.rollback(self._sink)
            self._offset = end - window - self._sink
        start = self.lm.length + self._offset
        if start < end < self.lm.max_length + self._offset:       # beyond its context propose drafts nothing
            self.lm.forward(committed[start:end], last_only=True)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary width (embedding paddings differ between models)."""
        v = logits.shape[-1]
        if self.vocab_ids is not None and v == len(self.vocab_ids) != self.target_vocab:
            full = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
            full[..., self.vocab_ids] = logits
            return full
        if v == self.target_vocab:
            return logits
        if v > self.target_vocab:
            return logits[..., :self.target_vocab]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, committed, max_tokens, policy, sampler):
        t0 = time.perf_counter()
        setup_s = 0.0
        if not self._started:           # the prompt (what the cache does not hold of it) and the reply so far
            self._started = True
            if self.lm.length + self._offset < committed.numel() - 1:
                self._catch_up(committed)
                setup_s, t0 = setup_seconds(t0, self.lm.device)
        max_tokens = min(max_tokens, self.lm.max_length - (committed.numel() - self._offset))   # its own context
        if max_tokens <= 0:
            return Proposal(committed.new_empty(0))
        ids = self._target_ids
        fit = self._fit if ids is None else (lambda logits: logits)      # a choice among its own vocabulary
        logits = fit(self.lm.forward(committed[self.lm.length + self._offset:], last_only=True))
        self._fed_before = self.lm.length
        proposal = draft_chain(logits, lambda tok: fit(self.lm.forward(tok if ids is None else ids[tok])), max_tokens,
                               policy, sampler, self.read_once)
        if ids is not None:
            proposal = widened(proposal, ids, self.target_vocab)
        self._drafted = proposal.tokens.numel()
        proposal.setup_s = setup_s
        return timed(proposal, t0, self.lm.device)

    def rollback(self, n_accepted, path=None):
        # fed: committed prefix + drafts 1..k-1 (the k-th was never fed)
        self.lm.rollback(self._fed_before + min(n_accepted, self._drafted - 1))

"""The decoding loop: one loop for plain, lookup, assistant and EAGLE-3 decoding.

Each round: the drafter proposes up to k tokens (k from the lookahead policy, capped by the
token budget and the context length), the target verifies [last token + drafts] in one forward,
the longest acceptable prefix is kept plus one target token, and both caches roll back to it.
With no drafter every round is a plain autoregressive step, so the baseline goes through the
very same code, events and statistics.

A follow-up turn skips the history: the target's cache still holds the last generation's
sequence, so a prompt that begins with it prefills only what is new (where the cache computes
every position as a fresh prefill would: `reuses_prefix`); a draft model keeps its own the same
way (Drafter.resume, finish). A new chat's first prompt skips the start all chats share (the chat
template's system prompt: the target's `shared_prefix`), whose rows are computed once.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .drafters import Drafter, Proposal, leading
from .events import RoundEvent, Summary
from .forward import VerifyCosts, make_lm
from .kv_cache import common_prefix
from .policies import DEFAULT_POLICY, Constant, LookaheadPolicy, make_policy
from .sampling import Sampler, SamplingParams


class PromptTooLong(ValueError):
    pass


class Decoder:
    # CPU threads for the target's prefill of a prompt of PROMPT_THREADS_ROWS new tokens or more, where that
    # differs from torch's setting (None: the same). An app on a small machine leaves a core to the web server
    # and the browser while a reply streams; while a long prompt is prefilled the page only waits, and the
    # prefill, bound by arithmetic, takes every core. Through the app's API on 2 cores, a pasted text
    # of 1,300 tokens had its first token after 2.7-3.4 s against 4.8-5.8 s on one thread; prompts of 13-22
    # new tokens gained nothing (the web server and its client are busy as a turn starts, and a thread team
    # sharing a core stalls at each barrier), so they stay on the app's threads.
    prompt_threads: int | None = None
    PROMPT_THREADS_ROWS = 64
    # cache positions a prepared conversation keeps free for its next message and reply (`prepare`): a
    # cache that grows in the next turn's prefill (at 256 positions, then doubling) delayed that turn's
    # first token by ~12 ms (one thread of a 2-core EPYC)
    NEXT_TURN_ROOM = 256

    def __init__(self, target_model, drafter: Drafter | None = None, eos_token_ids: Sequence[int] = (),
                 backend: str | None = None, target_lm=None, costs: VerifyCosts | None = None):
        # target_lm: the target's cached forward, shared by the decoders of an engine (one KV cache per
        # model; generations take turns under the engine's lock); costs: the engine's verify-cost curve,
        # which each round's measured verify keeps current
        self.target = target_lm or make_lm(target_model, backend)
        self.costs = costs
        self.drafter = drafter
        if drafter is not None:
            drafter.attach(self.target)
        self.eos = set(int(t) for t in eos_token_ids)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 policy: LookaheadPolicy | None = None, stop: threading.Event | None = None,
                 max_reuse: int | None = None, session=None) -> Iterator[RoundEvent | Summary]:
        """Yield a RoundEvent per target forward, then the Summary.

        max_reuse caps the prompt tokens taken from the cache (a comparison run prefills what the run
        it is compared with prefilled); session names the conversation, whose cache the target keeps
        between its turns. A conversation's first prompt takes the rows of the prefix all chats share
        (the target's shared_prefix, its chat template's system prompt), computed once."""
        if max_new_tokens < 1:
            raise ValueError(f"max new tokens must be >= 1, got {max_new_tokens}")
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        room = self.target.max_length - n
        if room < 1:
            raise PromptTooLong(f"the prompt has {n} tokens; the model's context length is {self.target.max_length}")
        budget = min(max_new_tokens, room)
        if policy is None:
            policy = make_policy(DEFAULT_POLICY) if self.drafter else Constant(0)
        sampler = Sampler(sampling, self.device)
        seq = torch.empty(n + budget, dtype=torch.long, device=self.device)
        seq[:n] = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        self.target.use_session(session)
        t0 = time.perf_counter()
        reuse = self._reusable(prompt_ids) if max_reuse is None else min(max_reuse, self._reusable(prompt_ids))
        # forgets what it held (a generation closed half way leaves nothing); a new chat takes the rows
        # of the template's start, computed once
        reuse = self.target.begin(prompt_ids, reuse, max_reuse)
        if self.drafter:
            self.drafter.resume(session, list(prompt_ids), max_reuse)
        summary = Summary(reused_tokens=reuse)

        # prefill: the prompt (what the cache does not hold yet), then the first token from its last position
        with self._prompt_threads(n - reuse):
            logits = self.target.forward(seq[reuse:n], last_only=True)
            first = sampler.pick(logits)
            seq[n] = first[0]
            ids = first.tolist()
            generated = list(ids)
            n += 1
            prefill_s = time.perf_counter() - t0
            if self.drafter:
                self.drafter.prefill(seq[:n])
        policy.start_reply()
        summary.target_forwards = summary.new_tokens = 1
        summary.ttft_s = time.perf_counter() - t0
        yield RoundEvent(token_ids=ids, from_draft=[False], drafted=0, accepted=0, lookahead=0,
                         draft_s=summary.ttft_s - prefill_s, verify_s=prefill_s, elapsed_s=summary.ttft_s)
        finish = "eos" if ids[0] in self.eos else ""

        while not finish:
            if summary.new_tokens >= budget:
                finish = "length" if budget == max_new_tokens else "context"
                break
            if stop is not None and stop.is_set():
                finish = "stopped"
                break
            room = budget - summary.new_tokens - 1
            drafting = self.drafter is not None and summary.new_tokens >= self.drafter.start_after
            cap = min(policy.max_lookahead(), room) if drafting else 0
            proposal = self.drafter.propose(seq[:n], cap, policy, sampler) if cap > 0 else \
                (self.drafter.free_draft(seq[:n], room) if self.drafter and room > 0 and policy.allows_free_draft()
                 else None) or Proposal(seq.new_empty(0))
            k = proposal.tokens.numel()
            tv = time.perf_counter()
            accepted, row, ids, kept = self._verify(proposal, seq[n - 1:n], n, sampler)
            path = None
            if kept is None:                      # both caches back to the committed sequence
                self.target.rollback(n + accepted)
            else:
                path, path_on_device = kept
                self.target.keep_path(n, path_on_device + n)
            if k:
                self.drafter.rollback(accepted, path)
            seq[n:n + row.numel()] = row          # past the accepted ones: overwritten next round
            n += accepted + 1
            generated += ids
            if self.drafter:
                self.drafter.extend(ids)
            verify_s = time.perf_counter() - tv
            if self.costs is not None:
                self.costs.observe(k + 1, verify_s)
            for i, t in enumerate(ids):
                if t in self.eos:
                    ids, finish = ids[:i + 1], "eos"
                    break
            summary.target_forwards += 1
            summary.new_tokens += len(ids)
            summary.record_round(k, accepted, max(proposal.depths) if proposal.depths else k)
            if proposal.chain is None:
                policy.end_round(k, accepted, proposal.confidences, proposal.seconds, verify_s)
            else:                                 # the policy learns the model's chain, not lookup's branch
                on_chain = leading(path, range(proposal.chain))
                policy.end_round(proposal.chain, on_chain, proposal.confidences, proposal.seconds, verify_s, k + 1,
                                 accepted + 1)
            from_draft = [i < accepted for i in range(len(ids))]
            yield RoundEvent(token_ids=ids, from_draft=from_draft, drafted=k, accepted=accepted, lookahead=cap,
                             draft_s=proposal.seconds + proposal.setup_s, verify_s=verify_s,
                             elapsed_s=time.perf_counter() - t0)

        summary.wall_s = time.perf_counter() - t0
        summary.finish_reason = finish
        sequence = list(prompt_ids) + generated
        if self.target.reuses_prefix:
            self.target.held = sequence[:self.target.length]
        if self.drafter:
            self.drafter.finish(sequence)
        yield summary

    @torch.inference_mode()
    def prepare(self, ids: Sequence[int], session=None) -> int:
        """Compute the cache rows of `ids` that the conversation's kept cache lacks: the tokens every next
        prompt of the chat begins with (the reply shown and the chat template's start of a user turn),
        computed after a turn while its reader reads, so the next turn prefills only its message, as a
        new chat's first does (the template's start being the prefix all chats share), and the cache has
        room for it. The cache holds the reply's rows, or, after a sampled comparison, plain decoding's
        other reply: then the rows from where the two part are computed again. The rows are computed as
        the next turn's prefill would compute them, from the same cache (only where a kept cache is
        reused at all: `reuses_prefix`). Returns the rows computed."""
        if not self.target.reuses_prefix:
            return 0
        self.target.use_session(session)
        keep = common_prefix(self.target.held, ids, len(ids) - 1)      # the last row's logits start nothing
        if not keep:
            return 0
        self.target.resume(keep)
        self.target.forward(torch.as_tensor(list(ids[keep:]), dtype=torch.long, device=self.device), last_only=True)
        self.target.held = list(ids)
        self.target.reserve(len(ids) + self.NEXT_TURN_ROOM)
        return len(ids) - keep

    @contextlib.contextmanager
    def _prompt_threads(self, rows: int):
        """torch's CPU threads set to prompt_threads for the prefill of `rows` new prompt tokens, then back."""
        wide, narrow = self.prompt_threads, torch.get_num_threads()
        if not wide or wide == narrow or rows < self.PROMPT_THREADS_ROWS or self.device.type != "cpu":
            yield
            return
        torch.set_num_threads(wide)
        try:
            yield
        finally:
            torch.set_num_threads(narrow)

    def _reusable(self, prompt_ids: Sequence[int]) -> int:
        """How many leading prompt tokens the target cache holds from the last generation (never the
        last prompt token: its logits start the reply)."""
        return common_prefix(self.target.held, prompt_ids, len(prompt_ids) - 1)

    def _verify(self, proposal: Proposal, last: torch.Tensor, n: int, sampler: Sampler):
        """One target forward over [last committed token + drafts]; the cache keeps the committed
        sequence and the accepted drafts (not the target's own next token, fed next round).

        Returns the number of accepted drafts, the round's tokens on the device (the accepted
        ones and the target's own next token first), the new token ids, and for a tree the accepted
        path (node indices on the host and on the device; None for a chain). A chain round reads the host once: the accepted
        count and the tokens together. A tree is verified with a tree mask and depth positions.
        """
        if proposal.parents is None:
            logits = self.target.forward(torch.cat([last, proposal.tokens]))
            judged = sampler.judge(proposal.tokens, proposal.probs, logits)     # [accepted, the k+1 tokens]
            host = judged.tolist()                                      # the round's one host read
            return host[0], judged[1:], host[1:host[0] + 2], None
        parents = proposal.parents
        ancestors = np.eye(len(parents) + 1, dtype=bool)        # built on the host, sent once
        for i, p in enumerate(parents):                 # parents come before children
            ancestors[i + 1] |= ancestors[p + 1]
        mask = torch.from_numpy(ancestors).to(self.device, non_blocking=True)
        depths = torch.tensor([0] + proposal.depths).to(self.device, non_blocking=True)
        logits = self.target.forward(torch.cat([last, proposal.tokens]), positions=n - 1 + depths, tree_mask=mask)
        path, correction, ids = sampler.verify_tree(proposal.tokens, parents, logits, proposal.token_ids)
        path_t = torch.tensor(path, dtype=torch.long).to(self.device, non_blocking=True)
        row = torch.cat([proposal.tokens[path_t], correction.view(1)])
        if ids is None:                      # sampled: the path's tokens and the target's are read now
            ids = row.tolist()
        return len(path), row, ids, (path, path_t)


def run(decoder: Decoder, *args, on_round=None, **kwargs) -> tuple[list[int], Summary]:
    """Consume a generation: all new token ids and the summary; on_round, if given, sees each RoundEvent."""
    ids: list[int] = []
    summary = None
    for event in decoder.generate(*args, **kwargs):
        if isinstance(event, RoundEvent):
            ids.extend(event.token_ids)
            if on_round is not None:
                on_round(event)
        else:
            summary = event
    return ids, summary

"""Token choice and speculative verification (greedy and Leviathan et al. rejection sampling).

The warpers are Transformers' own (temperature, top-k, top-p), so "the target's distribution"
means exactly what `model.generate(do_sample=True, ...)` would sample from.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .native import argmax, greedy_judge


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Turns logits rows into tokens or probabilities under one set of sampling params."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        warpers = []
        if not params.greedy:
            if params.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(params.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, V) logits -> (n, V) probabilities of the warped distribution, float32."""
        logits = logits.float()
        if self.warpers:
            logits = self.warpers(None, logits)
        return torch.softmax(logits, dim=-1)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """(n, V) probabilities -> (n,) tokens."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, V) logits -> (n,) tokens: argmax when greedy, else a sample of the warped distribution."""
        if self.params.greedy:
            return argmax(logits)
        return self.sample(self.probs(logits))

    def judge(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
              target_logits: torch.Tensor) -> torch.Tensor:
        """Accept a prefix of the k draft tokens against k+1 target logits rows, on the device.

        Returns (k+2,) int64: n accepted, then the round's k+1 tokens (the n accepted drafts, then the
        target's token after them at index n, the correction on a rejection or the bonus token when
        all k were accepted; what follows index n is not meant). Greedy: accept while the target's
        argmax agrees. Sampling: accept token i with probability min(1, p_i/q_i); on rejection sample
        from norm(max(0, p_i - q_i)); with no draft distributions (deterministic drafts) q_i is
        one-hot. Either way the output follows the target's distribution exactly. No host read: the
        caller reads n and the tokens together, once per round.
        """
        k = draft_tokens.numel()
        if self.params.greedy:                  # accepted drafts equal the target's own tokens
            return greedy_judge(draft_tokens, target_logits)
        p = self.probs(target_logits)                                       # (k+1, V)
        if k == 0:
            return torch.cat([torch.zeros(1, dtype=torch.long, device=p.device), self.sample(p[:1])])
        idx = torch.arange(k, device=p.device)
        p_tok = p[idx, draft_tokens]
        # no draft distributions: deterministic drafts (lookup), a one-hot q at each drafted token
        q_tok = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones_like(p_tok)
        u = torch.rand(k, device=p.device, generator=self.generator)
        rejected = (u * q_tok > p_tok).int()                                # u >= p/q without dividing by 0
        n = torch.cat([rejected, rejected.new_ones(1)]).argmax()
        at = n.view(1)
        row = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
        p_n = p.index_select(0, at)[0]
        if draft_probs is None:
            residual = p_n.scatter(0, row.index_select(0, at), 0.0)
        else:
            residual = (p_n - torch.cat([draft_probs, draft_probs.new_zeros(1, p.shape[1])]).index_select(0, at)[0]
                        ).clamp_min(0)
        total = residual.sum()
        # all accepted: the bonus token from p_k; total == 0 means p == q on this row, where a
        # rejection has probability 0 (float safety)
        residual = torch.where((n < k) & (total > 0), residual / total.clamp_min(1e-30), p_n)
        return torch.cat([at, row.scatter(0, at, self.sample(residual[None]))])

    def verify_tree(self, tokens: torch.Tensor, parents: list[int], target_logits: torch.Tensor,
                    token_ids: list[int] | None = None) -> tuple[list[int], torch.Tensor, int | None]:
        """Accept the longest acceptable path of a draft tree; target_logits row 0 is the root
        (the last committed token), row i+1 is tokens[i].

        Greedy: follow the child equal to the target's argmax. Sampling: the draft tokens are
        deterministic choices (q = 1), so a child t is accepted with probability p(t) under the
        current residual; a rejected t is zeroed out of p and its next sibling is tried; when none
        is accepted the target's token is drawn from the residual. Exact for any tree.
        Returns (accepted node indices along the path, the target's token after them, and when greedy
        the round's new tokens on the host: the path's, then the target's). token_ids: the tokens on
        the host, if the drafter has them (greedy reads the host once either way).
        """
        children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        if self.params.greedy:         # one host read: the target's choices (with the tokens, unless given)
            if token_ids is None:
                both = torch.cat([tokens, argmax(target_logits)]).tolist()
                toks, best = both[:tokens.numel()], both[tokens.numel():]
            else:
                toks, best = token_ids, argmax(target_logits).tolist()
            path, row = [], 0
            while True:
                nxt = next((c for c in children[row] if toks[c] == best[row]), None)
                if nxt is None:
                    return path, target_logits.new_tensor(best[row], dtype=torch.long), [toks[c] for c in path] + [best[row]]
                path.append(nxt)
                row = nxt + 1
        toks = token_ids if token_ids is not None else tokens.tolist()
        probs = self.probs(target_logits)
        path, row = [], 0
        while True:
            p = probs[row]
            for c in children[row]:
                u = float(torch.rand((), device=p.device, generator=self.generator))
                total = float(p.sum())
                if u * total < float(p[toks[c]]):
                    path.append(c)
                    row = c + 1
                    break
                p = p.clone()
                p[toks[c]] = 0
            else:
                return path, self.sample((p / p.sum())[None])[0], None

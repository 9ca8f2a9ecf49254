"""Drafts with a known acceptance rate, for measuring the engine's rounds on random weights.

A random-weight model's drafter agrees with nothing, so alone it measures only rejection. Given
the target's own greedy continuation (`reference`, decoded beforehand), this wrapper lets the real
drafter run (its cost is the one measured) and then replaces its tokens: the chain's (or the
tree's first branch's) j-th token is the target's next token while draws at `rate` keep hitting,
a wrong one after the first miss. Greedy verification then accepts exactly that prefix, so a
round's accepted length follows a known law (rate 1: every draft accepted, the ceiling).
"""
from __future__ import annotations

import random

import torch

from ..engine.drafters import Drafter


class ScriptedAcceptance(Drafter):
    def __init__(self, inner: Drafter, reference: list[int], rate: float, vocab_size: int, seed: int = 0):
        self.inner, self.reference, self.rate, self.vocab = inner, reference, rate, vocab_size
        self.name = f"{inner.name}-scripted-{rate:g}"
        self._rng = random.Random(seed)

    def attach(self, target_lm) -> None:
        self.inner.attach(target_lm)

    def reset(self) -> None:
        self.inner.reset()

    def prefill(self, committed) -> None:
        self.inner.prefill(committed)

    def rollback(self, n_accepted, path=None) -> None:
        self.inner.rollback(n_accepted, path)

    def extend(self, new_ids) -> None:
        self.inner.extend(new_ids)

    def _scripted(self, at: int, count: int) -> list[int]:
        """Tokens for positions at.. of the sequence: the reference's while the draws hit, then wrong ones."""
        out, hitting = [], True
        for j in range(count):
            right = self.reference[at + j] if at + j < len(self.reference) else 0
            hitting = hitting and at + j < len(self.reference) and self._rng.random() < self.rate
            out.append(right if hitting else (right + 1) % self.vocab)
        return out

    def propose(self, committed, max_tokens, policy, sampler):
        proposal = self.inner.propose(committed, max_tokens, policy, sampler)
        m, device = committed.numel(), proposal.tokens.device
        if proposal.parents is None:
            tokens = self._scripted(m, proposal.tokens.numel())
        else:            # the first branch: each level's first child of the branch so far; the rest miss
            depth_of, branch, parent = proposal.depths, [], -1
            for i, p in enumerate(proposal.parents):
                if p == parent and depth_of[i] == len(branch) + 1:
                    branch.append(i)
                    parent = i
            script = self._scripted(m, len(branch))
            tokens = [(self.reference[m + d - 1] + 1) % self.vocab if m + d - 1 < len(self.reference) else 0
                      for d in depth_of]
            for i, tok in zip(branch, script):
                tokens[i] = tok
            proposal.token_ids = tokens
        proposal.tokens = torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        return proposal

"""Token choice and speculative verification (greedy and Leviathan et al. rejection sampling).

Temperature, top-k and top-p mean what they mean in Transformers' `generate(do_sample=True, ...)`
(its TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper; tested against them; tied tokens
at the top-p cut aside), computed here: Transformers' top-p sorts the whole vocabulary, 5.4 ms a row
for SmolLM2's 49,152 tokens on 2 CPU cores, more than the model's step. On a CPU with the native
library, a row's warp (without top-k) and its draw run in native/sampling.c: ~0.09 ms a sampled token
at top-p 0.9 against ~0.55 ms in PyTorch's operators; elsewhere the PyTorch code below.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .native import argmax, draw, greedy_judge, warp
from .native import sample as native_sample
from .native import walk as native_walk


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
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, V) logits -> (n, V) probabilities of the warped distribution, float32: the logits over the
        temperature; with top-k, every token below the k-th largest logit cut (ties kept); with top-p,
        every token whose more likely tokens already hold top_p of the mass cut (the most likely always
        kept); the rest renormalised. Without top-k on a CPU, sampling.c's warp (native.warp)."""
        logits, p = logits.float(), self.params
        if p.greedy:
            return torch.softmax(logits, dim=-1)
        if not p.top_k and (native := warp(logits, p.temperature, p.top_p)) is not None:
            return native
        if p.temperature != 1.0:
            logits = logits / p.temperature
        if p.top_k:
            kth = logits.topk(min(p.top_k, logits.shape[-1]), -1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return self._nucleus(probs) if p.top_p < 1.0 else probs

    def _nucleus(self, probs: torch.Tensor, whole: bool | None = None) -> torch.Tensor:
        """probs with the top-p cut made and renormalised. A token is cut where the mass of the tokens
        ranked before it reaches top_p (Transformers: where the ascending cumulative mass up to it is
        <= 1 - top_p; where tied tokens straddle the cut, which of them stay may differ). On an
        accelerator (`whole`) each row is sorted whole (fast there, and no host read). On a CPU, where
        a whole sort took 2.7 ms a row, only the tokens at or above (1 - top_p) / V are ranked: those
        below hold less than 1 - top_p of the mass together, so every one of them has more than top_p
        before it and is cut (~100-900 tokens of SmolLM2's 49,152 at T 0.7-1); the row's most likely
        token is always ranked."""
        top_p = self.params.top_p
        if whole if whole is not None else probs.device.type != "cpu":
            ranked, order = probs.sort(-1, descending=True)
            out = torch.zeros_like(probs).scatter_(-1, order, ranked.masked_fill(ranked.cumsum(-1) - ranked >= top_p, 0.0))
        else:
            out, floor = torch.zeros_like(probs), (1.0 - top_p) / probs.shape[-1]
            for r in range(probs.shape[0]):
                row = probs[r]
                candidates = (row >= min(floor, float(row.max()))).nonzero().squeeze(-1)
                ranked, order = row[candidates].sort(descending=True)
                out[r, candidates[order]] = ranked.masked_fill(ranked.cumsum(0) - ranked >= top_p, 0.0)
        return out / out.sum(-1, keepdim=True)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """(n, V) probabilities (each row's sum need not be 1) -> (n,) tokens, by the inverse of each row's
        cumulative distribution at one uniform draw, on the device.

        Why not torch.multinomial: on 2 CPU cores it took 1.2 ms a row for SmolLM2's 49,152 tokens, a
        quarter of a decoding step, and a sampled verify paid it again for each row it sampled; this
        takes ~0.1 ms. The sums run in float64 (float32 on Apple's MPS, which has no float64); u is drawn
        in (0, 1] and the first token whose cumulative sum reaches u * total is taken, so the last index
        is never passed and a zero-probability token (a top-k or top-p cut) is not chosen: never on a
        CPU, whose sums run in order; a GPU's parallel scan may round a cut token's sum an ulp past its
        neighbour's (a ~1e-16 chance). On a CPU, sampling.c's draw (native.draw) searches the same way
        block by block (~0.01 ms a row)."""
        dtype = torch.float32 if probs.device.type == "mps" else torch.float64
        u = 1.0 - torch.rand(probs.shape[0], 1, dtype=dtype, device=probs.device, generator=self.generator)
        if (native := draw(probs, u.view(-1))) is not None:
            return native
        cdf = probs.to(dtype).cumsum(-1)
        return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, V) logits -> (n,) tokens: argmax when greedy, else a sample of the warped distribution."""
        p = self.params
        if p.greedy:
            return argmax(logits)
        if not p.top_k and (native := native_sample(logits.float(), p.temperature, p.top_p, self.generator)) is not None:
            return native               # the same token, in one native call
        return self.sample(self.probs(logits))

    def judge(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
              target_logits: torch.Tensor) -> torch.Tensor:
        """Accept a prefix of the k draft tokens against k+1 target logits rows, on the device.

        Returns (k+2,) int64: n accepted, then the round's k+1 tokens (the n accepted drafts, then the
        target's token after them at index n, the correction on a rejection or the bonus token when
        all k were accepted; what follows index n is not meant). Greedy: accept while the target's
        argmax agrees. Sampling: accept token i with probability min(1, p_i/q_i); on rejection sample
        from norm(max(0, p_i - q_i)); with no draft distributions (deterministic drafts) q_i is
        one-hot. Either way the output follows the target's distribution exactly. On an accelerator no
        host read: the caller reads n and the tokens together, once per round; on a CPU, where a read
        costs nothing, sampled rows are warped only as far as the first rejection (walk).
        """
        k = draft_tokens.numel()
        if self.params.greedy:                  # accepted drafts equal the target's own tokens
            return greedy_judge(draft_tokens, target_logits)
        if k and target_logits.device.type == "cpu":
            return self.walk(draft_tokens, draft_probs, target_logits)
        return self.judge_rows(draft_tokens, draft_probs, target_logits)

    def judge_rows(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                   target_logits: torch.Tensor) -> torch.Tensor:
        """judge's sampled verification with every row warped at once (an accelerator's: no host read)."""
        k = draft_tokens.numel()
        if k == 0:
            return torch.cat([torch.zeros(1, dtype=torch.long, device=target_logits.device), self.pick(target_logits[:1])])
        p = self.probs(target_logits)                                       # (k+1, V)
        idx = torch.arange(k, device=p.device)
        p_tok = p[idx, draft_tokens]
        # no draft distributions: deterministic drafts (lookup), a one-hot q at each drafted token
        q_tok = draft_probs[idx, draft_tokens] if draft_probs is not None else torch.ones_like(p_tok)
        u = torch.rand(k, dtype=torch.float32, device=p.device, generator=self.generator)
        rejected = (u * q_tok > p_tok).int()                                # u >= p/q without dividing by 0
        n = torch.cat([rejected, rejected.new_ones(1)]).argmax()
        at = n.view(1)
        row = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
        p_n = p.index_select(0, at)[0]
        q_n = None if draft_probs is None else \
            torch.cat([draft_probs, draft_probs.new_zeros(1, p.shape[1])]).index_select(0, at)[0]
        # all accepted: the bonus token from p_k
        residual = torch.where(n < k, self._correction(p_n, q_n, row.index_select(0, at)), p_n)
        return torch.cat([at, row.scatter(0, at, self.sample(residual[None]))])

    @staticmethod
    def _correction(p_n: torch.Tensor, q_n: torch.Tensor | None, token: torch.Tensor) -> torch.Tensor:
        """The distribution a rejected draft token's replacement is drawn from: max(0, p - q), unnormalised
        (sample draws from a row's share of its sum), q one-hot at `token` (a 1-element index) without
        draft distributions; p itself where that is all 0 (p == q: a rejection there has probability 0:
        float safety)."""
        residual = p_n.scatter(0, token, 0.0) if q_n is None else (p_n - q_n).clamp_min(0)
        return torch.where(residual.sum() > 0, residual, p_n)

    def walk(self, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
             target_logits: torch.Tensor) -> torch.Tensor:
        """judge_rows on a CPU, where a read of a value costs nothing: the rows are warped one at a time
        as the walk reaches them, so those after the first rejection are never warped (at top-p 0.9 a
        row's warp took ~0.3 ms of SmolLM2's ~5 ms step in PyTorch's operators, ~0.06 ms in sampling.c,
        and most rounds stop at their first or second row). The same uniform draws, comparisons and
        operations as judge_rows, row by row: the same tokens from the same generator state. Without top-k
        and with the native library the walk is one call of sampling.c (native.walk): the same again."""
        k = draft_tokens.numel()
        u = torch.rand(k, dtype=torch.float32, device=target_logits.device, generator=self.generator)
        tokens = draft_tokens.tolist()
        params = self.params
        walked = None if params.top_k else native_walk(target_logits.float(), draft_tokens, draft_probs, u,
                                                      params.temperature, params.top_p, self.generator)
        if walked is not None:
            n, token = walked
        else:
            n, p_n = k, None
            for i, tok in enumerate(tokens):
                p_n = self.probs(target_logits[i:i + 1])[0]
                q_tok = draft_probs[i, tok] if draft_probs is not None else 1.0
                if bool(u[i] * q_tok > p_n[tok]):                      # u >= p/q without dividing by 0
                    n = i
                    p_n = self._correction(p_n, None if draft_probs is None else draft_probs[i], draft_tokens[i:i + 1])
                    break
            if n == k:                      # all accepted: the bonus token from the row after them
                p_n = self.probs(target_logits[k:k + 1])[0]
            token = self.sample(p_n[None])[0]
        out = torch.tensor([n, *tokens, 0], dtype=torch.long)
        out[1 + n] = token
        return out.to(draft_tokens.device)

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

"""A draft model with a different tokenizer (universal assisted generation).

Greedy: the committed target tokens become text, the text becomes draft tokens (both kept
incrementally by `TextMirror`: a round decodes and re-tokenises only the new tail, and the draft's
cache keeps the longest prefix it already holds, so usually only the new tail is fed), the
draft continues in its own tokens, and its new text is re-tokenised for the target, aligned
on a few committed target tokens so the boundary tokenises as it will be verified.
Sampling: the draft samples only tokens that exist, with the same string, in both
vocabularies; its distribution mapped into the target's vocabulary is then an ordinary draft
distribution and rejection sampling stays exact.

The assistant model and tokenizers are never modified (Transformers' implementation of this
mode rewrites the assistant's generation config and logits processors).
"""
from __future__ import annotations

import time

import torch

from .drafters import Drafter, Proposal, draft_chain, timed
from .forward import make_lm
from .model import eos_ids

REPLACEMENT = "\ufffd"      # a partial UTF-8 character at the end of decoded bytes


def _normal(token: str) -> str:
    """Token strings of byte-level BPE (Ġ = space) and SentencePiece (▁ = space) on one footing."""
    return token.replace("\u2581", "\u0120")


def vocabulary_map(draft_tokenizer, target_tokenizer) -> torch.Tensor:
    """(draft vocab,) target id of each draft token with the same string, -1 where none."""
    target = {_normal(t): i for t, i in target_tokenizer.get_vocab().items()}
    draft = draft_tokenizer.get_vocab()
    out = torch.full((max(draft.values()) + 1,), -1, dtype=torch.long)
    for tok, i in draft.items():
        j = target.get(_normal(tok))
        if j is not None:
            out[i] = j
    return out


class TextMirror:
    """The committed target tokens as text and as draft tokens, kept up to date a tail at a time.

    A round's committed tokens usually extend the last round's: only the new tail is decoded (with
    a few earlier tokens, so a character split across tokens decodes whole), and only the text after
    a word boundary a few draft tokens back is tokenised again (tokenizers split text into words
    first, so what lies before a boundary tokenises alike whatever follows). Where that does not
    hold - the new tail does not decode back to its text - the whole text is tokenised again; a new
    chat or a shorter sequence starts over. A round costs its tail, not the reply."""

    ANCHOR = 4         # earlier target tokens decoded with the tail
    BACK = 8           # draft tokens at least, re-tokenised before the tail

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.ttok, self.dtok = target_tokenizer, draft_tokenizer
        self.tokenized_chars = 0            # characters given to the draft tokenizer (what the rounds cost)
        self.reset()

    def reset(self) -> None:
        self.target_ids: list[int] = []
        self.text = ""
        self.draft_ids: list[int] = []
        self.ends: list[int] = []           # where each draft token's text ends in `text` (-1: a special token)
        self.kept = 0                       # leading draft ids the last update left as they were

    def _tokenize(self, text: str, special: bool, base: int = 0) -> tuple[list[int], list[int]]:
        self.tokenized_chars += len(text)
        enc = self.dtok(text, add_special_tokens=special, return_offsets_mapping=True)
        return enc["input_ids"], [base + b if b > a else -1 for a, b in enc["offset_mapping"]]

    def _text(self, target_ids: list[int]) -> tuple[str, bool]:
        """(the text of target_ids, whether it extends the last update's text)."""
        n = len(self.target_ids)
        if n and len(target_ids) >= n and target_ids[:n] == self.target_ids:
            a = max(0, n - self.ANCHOR)
            before = self.ttok.decode(target_ids[a:n], skip_special_tokens=False)
            after = self.ttok.decode(target_ids[a:], skip_special_tokens=False)
            if after.startswith(before):
                return self.text + after[len(before):], True
        return self.ttok.decode(target_ids, skip_special_tokens=False), False

    def _boundary(self, text: str, i: int) -> bool:
        """Draft token i starts a word: the text before it ends at whitespace, and token i - 1 is not a
        first byte of a character it shares with token i."""
        end = self.ends[i - 1]
        return end >= 0 and self.ends[i] > end and text[end:end + 1].isspace()

    def update(self, target_ids: list[int]) -> list[int] | None:
        """Draft token ids of the text of `target_ids`, or None while it ends inside a character."""
        text, extends = self._text(target_ids)
        if text.endswith(REPLACEMENT):
            return None
        cut = len(self.draft_ids) - self.BACK if extends else 0
        while cut > 0 and not self._boundary(text, cut):
            cut -= 1
        ids = None
        if cut > 0:
            base = self.ends[cut - 1]
            tail, ends = self._tokenize(text[base:], False, base)
            if self.dtok.decode(tail, skip_special_tokens=False) == text[base:]:
                ids, ends = self.draft_ids[:cut] + tail, self.ends[:cut] + ends
        if ids is None:
            cut = 0
            ids, ends = self._tokenize(text, True)
        self.target_ids, self.text, self.draft_ids, self.ends, self.kept = list(target_ids), text, ids, ends, cut
        return ids


class OtherTokenizerDrafter(Drafter):
    name = "assistant-other-tokenizer"
    ALIGN = 3          # committed target tokens re-tokenised with the draft's text to align the boundary

    def __init__(self, model, draft_tokenizer, target_tokenizer, target_eos: list[int], target_vocab: int,
                 backend: str | None = None):
        self.lm = make_lm(model, backend, exact=False)     # a drafter need not be exact: lossless anyway
        self.dtok, self.ttok = draft_tokenizer, target_tokenizer
        self.draft_eos = set(eos_ids(model, draft_tokenizer))
        self.target_eos = target_eos[0] if target_eos else None
        self.target_vocab = target_vocab
        self.to_target = vocabulary_map(draft_tokenizer, target_tokenizer)
        width = self.lm.vocab_size
        shared = self.to_target[:width] if self.to_target.numel() >= width else \
            torch.cat([self.to_target, self.to_target.new_full((width - self.to_target.numel(),), -1)])
        self.shared = (shared >= 0) & (shared < target_vocab)
        self.shared_target_ids = shared[self.shared].to(self.lm.device)
        self.shared_draft_ids = self.shared.nonzero().squeeze(-1).to(self.lm.device)
        self.target_bos = target_tokenizer.bos_token_id
        self.mirror = TextMirror(target_tokenizer, draft_tokenizer)
        self.fed: list[int] = []

    @property
    def shared_vocabulary(self) -> int:
        return int(self.shared.sum())

    def reset(self) -> None:
        self.lm.reset()
        self.mirror.reset()
        self.fed = []
        self.host_ids: list[int] = []      # the committed sequence on the host (the decoder's reads extend it)

    def prefill(self, committed):
        self.host_ids = committed.tolist()

    def extend(self, new_ids: list[int]) -> None:
        self.host_ids += new_ids

    def _draft_ids(self, committed: list[int]) -> list[int] | None:
        """The committed text in draft tokens, or None while it ends inside a character."""
        if self.target_bos is not None and committed and committed[0] == self.target_bos:
            committed = committed[1:]
        return self.mirror.update(committed)

    def _to_target(self, committed: list[int], draft_new: list[int], context: list[int]) -> list[int]:
        """Target tokens for the text the draft added after `context` (its committed draft tokens)."""
        tail = context[-4:]
        base = self.dtok.decode(tail, skip_special_tokens=False)
        full = self.dtok.decode(tail + draft_new, skip_special_tokens=False)
        text = full[len(base):] if full.startswith(base) else self.dtok.decode(draft_new, skip_special_tokens=False)
        text = text.rstrip(REPLACEMENT)
        if not text:
            return []
        anchor = committed[-self.ALIGN:]
        anchor_text = self.ttok.decode(anchor, skip_special_tokens=False)
        if not anchor_text.endswith(REPLACEMENT):
            ids = self.ttok(anchor_text + text, add_special_tokens=False)["input_ids"]
            if ids[:len(anchor)] == anchor:
                return ids[len(anchor):]
        return self.ttok(text, add_special_tokens=False)["input_ids"]

    @torch.inference_mode()
    def propose(self, committed, max_tokens, policy, sampler):
        t0 = time.perf_counter()
        if len(self.host_ids) != committed.numel():
            self.host_ids = committed.tolist()
        committed_ids = self.host_ids
        ids = self._draft_ids(committed_ids)
        empty = Proposal(committed.new_empty(0))
        if ids is None or not ids:
            return empty
        steps = min(max_tokens, self.lm.max_length - len(ids))
        if steps <= 0:
            return empty
        same = min(self.mirror.kept, len(self.fed))        # the mirror kept these; the draft's cache holds them
        if self.fed[:same] != ids[:same]:
            same = 0
        for a, b in zip(ids[same:], self.fed[same:]):
            if a != b:
                break
            same += 1
        same = min(same, len(ids) - 1)
        self.lm.rollback(same)
        greedy = sampler.params.greedy
        device = self.lm.device
        # greedy drafts any draft token (its text is re-tokenised for the target); sampling only the
        # shared ones, so each is one target token and the distribution maps over exactly
        columns = (lambda out: out[:, :self.shared.numel()]) if greedy else (lambda out: out[:, self.shared_draft_ids])
        as_draft = (lambda tok: tok) if greedy else (lambda tok: self.shared_draft_ids[tok])
        logits = columns(self.lm.forward(torch.tensor(ids[same:], device=device), last_only=True))
        chain = draft_chain(logits, lambda tok: columns(self.lm.forward(as_draft(tok))), steps, policy, sampler,
                            device.type != "cpu")
        drafted = as_draft(chain.tokens).tolist()          # the round's one read: the text is needed on the host
        self.fed = ids + drafted[:-1]                      # the last drafted token was never fed
        cut = next((j for j, t in enumerate(drafted) if t in self.draft_eos), None)
        eos = greedy and cut is not None                   # its text may mean nothing to the target: map it
        new = drafted if cut is None else drafted[:cut + (0 if greedy else 1)]
        if greedy:
            cand = self._to_target(committed_ids, new, ids)
            if eos and self.target_eos is not None:
                cand.append(self.target_eos)
            probs = None
        else:
            cand = self.shared_target_ids[chain.tokens[:len(new)]].tolist()
            probs = chain.probs[:len(new)].new_zeros(len(new), self.target_vocab)
            probs[:, self.shared_target_ids] = chain.probs[:len(new)]
        cand = cand[:max_tokens]
        if probs is not None:
            probs = probs[:len(cand)]
        # the policy learns per target token: each gets the confidence of the draft token it came from (approx.)
        confidences = chain.confidences[:max(len(new), 1)]
        confidences = (confidences + confidences[-1:] * len(cand))[:len(cand)] if confidences else []
        return timed(Proposal(torch.tensor(cand, dtype=torch.long, device=committed.device), probs, confidences),
                     t0, device)

    def rollback(self, n_accepted, path=None):
        pass        # the next round re-tokenises the committed text and keeps the common prefix

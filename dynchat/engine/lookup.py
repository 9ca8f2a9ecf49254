"""Drafts that cost no model forward: continuations found in the conversation and in earlier replies.

Two sources, each asked for the longest match of the committed sequence's tail:
- the conversation itself (prompt lookup): a scan of the committed tokens;
- a `ReplyIndex` over the target's own earlier replies (SuffixDecoding's global tree): a suffix
  array over the reversed replies, so the tail's match grows one token at a time inside a nested
  range; replies added while serving are scanned directly until the next rebuild folds them in.

From the occurrences of the match, the draft follows the most frequent continuation, token by token,
with its frequency as the draft's confidence (smoothed, so one occurrence is not certainty). Each
round takes the source whose draft has the higher expected number of accepted tokens. Drafts are
deterministic: verification treats them as one-hot proposals, so sampling stays exact.

The search runs between two target forwards, when the forward's weights have evicted the caches:
engine/native/lookup.c finds a round's candidate from both sources in one call (the numpy code here
is the reference and the fallback; the same drafts, tested).
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .drafters import Drafter, Proposal, leading
from .forward import VerifyCosts
from .policies import Calibration

SEP = -1                 # between replies in a corpus: no match or continuation crosses it
_NO_INDEX = (None, 0, 0, None, None, 0, None, 0)     # lookup_candidate's index arguments where there is none
GATHER_AT_MOST = 4096    # numpy's search: a range this small is gathered and searched, a wider one bisected


@dataclass(frozen=True)
class LookupConfig:
    max_match: int = 24          # context tokens matched at most
    min_match: int = 2           # shorter matches draft nothing
    conversation_min_match: int = 1   # in the conversation itself (one token: right 21% of the time, as estimated)
    max_occurrences: int = 256   # occurrences whose continuations are counted
    max_draft: int = 16
    match_factor: float = 2.0    # a draft is at most this times the matched length (SuffixDecoding's alpha)
    prior: float = 0.5           # pseudo-count against a continuation after a min_match-token match
    # how far a match of m tokens is trusted: the first token's estimate is scaled by m / (m + shrink).
    # Measured on SmolLM2's replies: a 2-token match in earlier replies was right 26% of the time, an
    # 8-token one 75%; in the conversation itself 44% and 88%.
    shrink_conversation: float = 1.5
    shrink_replies: float = 4.0
    # earlier replies' later tokens: their frequency overstates how often the target goes on the same
    # way (measured on 150 held-out everyday replies: frequency 0.72 / 0.81 / 0.86 at draft depth 2 / 3 /
    # 4, right 0.46 / 0.58 / 0.68; 0.94 -> 0.76 overall), so each is scaled by this; the conversation's
    # are right as often as their frequency says (0.93 -> 0.92)
    replies_later_scale: float = 0.75
    min_confidence: float = 0.05  # a token is proposed only while the chain's probability stays above this
    # this reply's own record against the calibrated estimates, as pseudo-tokens of prior: a reply
    # that rewrites its prompt finds matches there that it does not follow (0: the record is ignored)
    reply_evidence: float = 3.0


@dataclass
class Candidate:
    tokens: list[int]
    probs: list[float]           # the draft's estimate that each token is right, given the ones before

    @property
    def expected(self) -> float:
        """Expected accepted tokens: sum over i of the probability that the first i are all right."""
        total, chain = 0.0, 1.0
        for p in self.probs:            # a Python loop: numpy's calls cost more than this between forwards
            chain *= p
            total += chain
        return total


def best_prefix(cand: Candidate, costs: VerifyCosts, estimate: Callable[[float], float] | None = None) -> Candidate:
    """The prefix whose expected tokens per verify cost is highest (empty when no draft beats a plain step):
    a long lookup draft costs a long verify, and its later tokens are less sure. `estimate` maps each
    of cand's probabilities to the one weighed (the calibrated estimate), asked only of the tokens
    looked at: the search stops where even every further token right could not beat the best prefix
    (verifying more tokens taken never to cost less), as most of a 16-token candidate's tail can't."""
    best_j, best_rate = 0, 1.0 / costs.ms(1)
    chain, expected, probs, n = 1.0, 1.0, [], len(cand.probs)
    for j, raw in enumerate(cand.probs, start=1):
        p = estimate(raw) if estimate is not None else raw
        probs.append(p)
        chain *= p
        expected += chain
        rate = expected / costs.ms(j + 1)
        if rate > best_rate:
            best_j, best_rate = j, rate
        if j < n and (expected + chain * (n - j)) / costs.ms(j + 2) <= best_rate:
            break
    return Candidate(cand.tokens[:best_j], probs[:best_j])


@dataclass
class Branch:
    """A second candidate beside a chain of k drafted tokens: its tokens past where it leaves the chain,
    and the tree's parents and depths over the chain's k nodes and then these."""
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    nodes: list[int]             # the candidate's own path through the tree (shared chain nodes, then its own)


def branch_beside(chain: list[int] | None, k: int, expected: float, cand: Candidate, costs: VerifyCosts
                  ) -> Branch | None:
    """`cand` as a second branch beside a chain of k drafted tokens whose expected accepted tokens are
    `expected`: as many of its tokens as raise the round's expected tokens per verify cost (None: not
    one does). It leaves the chain where the two differ (`chain`: the chain's tokens on the host; None
    where reading them would stall an accelerator: the branch then starts at the root). Candidates
    that differ in their first token are exclusive, so their expected tokens add up."""
    shared = 0
    while chain and shared < min(k, len(cand.tokens)) and chain[shared] == cand.tokens[shared]:
        shared += 1
    p, extra, best, rate = 1.0, 0.0, 0, (1 + expected) / costs.ms(k + 1)
    probs = cand.probs
    for j, q in enumerate(probs):
        p *= q
        if j < shared:
            continue
        extra += p
        r = (1 + expected + extra) / costs.ms(k + 1 + j + 1 - shared)
        if r > rate:
            best, rate = j + 1 - shared, r
    if best == 0:
        return None
    return Branch(cand.tokens[shared:shared + best],
                  parents=list(range(-1, k - 1)) + [shared - 1] + list(range(k, k + best - 1)),
                  depths=list(range(1, k + 1)) + list(range(shared + 1, shared + best + 1)),
                  nodes=list(range(shared)) + list(range(k, k + best)))


def _most_frequent(col: list[int]) -> tuple[int, int]:
    """The most frequent token of a column and its count (ties: the smallest token)."""
    counts = collections.Counter(col)
    top = max(counts.values())
    return min(t for t, c in counts.items() if c == top), top


def draft_limit(match: int, cfg: LookupConfig) -> int:
    """The longest draft a match of `match` tokens may make."""
    return min(cfg.max_draft, max(1, int(cfg.match_factor * match)))


def follow(continuations: np.ndarray, match: int, cfg: LookupConfig, shrink: float = 0.0,
           later_scale: float = 1.0) -> Candidate:
    """The most frequent path through (n, depth) continuation rows (SEP-padded), token by token; the
    first token's estimate is scaled by match / (match + shrink) (a short match is weak evidence),
    the later ones' by later_scale. Walked on Python lists: the rows that still agree with the path
    shrink to one or two within a few tokens, where numpy's per-call cost would dominate (this runs
    every round)."""
    limit = min(draft_limit(match, cfg), continuations.shape[1])
    alive = continuations[:, :limit].tolist()
    tokens, probs, chain = [], [], 1.0
    for d in range(limit):
        col = [row[d] for row in alive if row[d] != SEP]
        if not col:
            break
        if len(col) == 1 or col.count(col[0]) == len(col):
            tok, count = col[0], len(col)
        else:
            tok, count = _most_frequent(col)
        # the pseudo-count against the continuation fades as the matched context grows: one occurrence
        # after a 2-token match is weak evidence, after 24 tokens (the draft extends the match) strong
        p = count / (len(alive) + cfg.prior * cfg.min_match / (match + d))
        p *= match / (match + shrink) if d == 0 else later_scale
        chain *= p
        if chain < cfg.min_confidence:
            break
        tokens.append(tok)
        probs.append(p)
        if count < len(alive):
            alive = [row for row in alive if row[d] == tok]
    return Candidate(tokens, probs)


def _gather(corpus: np.ndarray, starts: np.ndarray, depth: int) -> np.ndarray:
    """(n, depth) tokens of `corpus` from each start, SEP past a reply's end or the corpus's end."""
    index = starts[:, None] + np.arange(depth)
    rows = corpus[np.minimum(index, corpus.size - 1)]
    rows[index >= corpus.size] = SEP
    cut = np.cumsum(rows == SEP, axis=1) > 0
    rows[cut] = SEP
    return rows


def evenly_spaced(size: int, count: int) -> np.ndarray:
    """np.linspace(0, size - 1, count) as indices (the same ones: its arithmetic, without its checks)."""
    out = (np.arange(count, dtype=np.float64) * ((size - 1) / (count - 1))).astype(np.int64)
    out[-1] = size - 1
    return out


@functools.cache
def _native():
    """engine/native's search (lookup.c: the same results in a few calls, ~10x less time between two
    forwards), or None where the library is not built: then the numpy code here runs."""
    from .native import library
    return library()


def continuation(corpus: np.ndarray, starts: np.ndarray, match: int, cfg: LookupConfig, shrink: float = 0.0,
                 later_scale: float = 1.0) -> Candidate:
    """follow() over the continuations of `corpus` at `starts`, as deep as the match may draft."""
    limit = draft_limit(match, cfg)
    lib = _native()
    if lib is None or corpus.dtype != np.int32 or not corpus.flags.c_contiguous:
        return follow(_gather(corpus, starts, limit), match, cfg, shrink, later_scale)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    tokens, probs = np.empty(limit, dtype=np.int32), np.empty(limit, dtype=np.float64)
    made = lib.lookup_follow(corpus.ctypes.data, corpus.size, starts.ctypes.data, starts.size, limit, match,
                             cfg.prior, cfg.min_match, shrink, later_scale, cfg.min_confidence,
                             tokens.ctypes.data, probs.ctypes.data)
    return Candidate(tokens[:made].tolist(), probs[:made].tolist())


def scan_match(seq: np.ndarray, limit: int, cfg: LookupConfig, tail: int) -> tuple[np.ndarray, int]:
    """Earlier occurrences of the longest matched tail of `seq` (its last `tail` tokens at most)
    that end before index `limit`: the positions right after them, and the match length."""
    if seq.size < 2 or limit < 1:
        return np.empty(0, dtype=np.int64), 0
    lib = _native()
    if lib is not None and seq.dtype == np.int32 and seq.flags.c_contiguous:
        out, match = np.empty(limit, dtype=np.int64), ctypes.c_int()
        count = lib.lookup_scan(seq.ctypes.data, seq.size, limit, min(cfg.max_match, tail), out.ctypes.data,
                                ctypes.byref(match))
        return out[:count], match.value
    ends = np.flatnonzero(seq[:limit] == seq[-1])
    length = 1
    while ends.size and length < min(cfg.max_match, tail):
        prev = ends - length
        ok = prev >= 0
        ok[ok] = seq[prev[ok]] == seq[-1 - length]
        if not ok.any():
            break
        ends, length = ends[ok], length + 1
    return ends + 1, length if ends.size else 0


def suffix_array(text: np.ndarray, depth: int) -> np.ndarray:
    """Suffix start positions sorted by their first `depth` tokens (prefix doubling; ties past depth
    in any order). Positions past the end compare smallest."""
    n = text.size
    rank = text.astype(np.int64) + 2                         # SEP (-1) -> 1, past the end -> 0
    k = 1
    order = np.argsort(rank, kind="stable")
    while k < depth:
        second = np.zeros(n, dtype=np.int64)
        second[:n - k] = rank[k:]
        order = np.lexsort((second, rank))
        r, s = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate([[1], (r[1:] != r[:-1]) | (s[1:] != s[:-1])]).cumsum()
        rank = new
        if rank[order[-1]] == n:
            break
        k *= 2
    return order.astype(np.int32)


class ReplyIndex:
    """Earlier replies (token ids), searchable for the longest match of a tail; bounded and thread-safe.

    A suffix array over the reversed corpus: the tail read backwards is a prefix of the reversed
    suffixes, so each extra matched token narrows a range within the last. Replies added after a
    build go to a short list scanned directly; a rebuild, in a background thread once that list is
    long, folds them in (oldest replies dropped past `max_tokens`). Readers take one immutable snapshot
    per lookup, so a rebuild in another thread is safe.
    """

    def __init__(self, replies: Iterable[Sequence[int]] = (), max_tokens: int = 4_000_000,
                 recent_tokens: int = 200_000, cfg: LookupConfig = LookupConfig()):
        self.cfg, self.max_tokens, self.recent_tokens = cfg, max_tokens, recent_tokens
        self._lock = threading.Lock()
        self._replies: deque[np.ndarray] = deque()
        self._recent: list[np.ndarray] = []
        self._recent_size = 0
        self._size = 0
        self._snapshot = self._build([])
        self._recent_corpus: np.ndarray | None = None
        self._builder: threading.Thread | None = None        # a rebuild running beside the chats
        self.add_many(replies, rebuild=True)

    def __len__(self) -> int:
        return len(self._replies)

    @property
    def tokens(self) -> int:
        return self._size

    def _build(self, replies: list[np.ndarray]):
        pad = self.cfg.max_match + self.cfg.max_draft + 1
        parts = [p for r in replies for p in (r, np.full(1, SEP, dtype=np.int32))]
        corpus = np.concatenate(parts + [np.full(pad, SEP, dtype=np.int32)]) if parts else np.full(pad, SEP, np.int32)
        n = corpus.size - pad
        reversed_text = np.concatenate([corpus[:n][::-1], np.full(pad, -2, dtype=np.int32)])
        sa = suffix_array(reversed_text[:n], self.cfg.max_match) if n else np.empty(0, dtype=np.int32)
        return corpus, n, reversed_text, sa

    def add(self, reply: Sequence[int]) -> None:
        self.add_many([reply])

    def add_many(self, replies: Iterable[Sequence[int]], rebuild: bool = False) -> None:
        """Remember replies. Asked to (`rebuild`), the index is rebuilt here; past `recent_tokens`
        unindexed tokens, in a background thread: a build of millions of tokens takes seconds, and the
        chat whose reply is being remembered (holding its engine) should not wait for it. Replies
        added meanwhile stay in the scanned list until a later build."""
        with self._lock:
            for r in replies:
                arr = np.asarray(r, dtype=np.int32)
                if arr.size:
                    self._replies.append(arr)
                    self._recent.append(arr)
                    self._size += arr.size
                    self._recent_size += arr.size
            while self._size > self.max_tokens and len(self._replies) > 1:
                oldest = self._replies.popleft()
                self._size -= oldest.size
                if self._recent and self._recent[0] is oldest:     # dropped from the scanned list too
                    self._recent.pop(0)
                    self._recent_size -= oldest.size
            if rebuild:
                replies = list(self._replies)
                self._fold(self._build(replies), replies)
            elif self._recent_size > self.recent_tokens and self._builder is None:
                self._build_in_background()
            self._publish()

    def _build_in_background(self) -> None:
        """Start a rebuild over the replies remembered now, in another thread (under the lock)."""
        self._builder = threading.Thread(target=self._build_beside, args=(list(self._replies),),
                                         name="reply-index-build", daemon=True)
        self._builder.start()

    def _build_beside(self, replies: list[np.ndarray]) -> None:
        """The background rebuild: the index over `replies` (those remembered when it started). Where
        the build fell behind (past `recent_tokens` remembered, or its oldest replies dropped past
        `max_tokens`, meanwhile), the next one starts at once: an index must not keep forgotten replies."""
        try:
            snapshot = self._build(replies)
        finally:
            with self._lock:
                self._builder = None
                if "snapshot" in locals():
                    self._fold(snapshot, replies)
                    dropped = bool(replies) and (not self._replies or self._replies[0] is not replies[0])
                    if dropped or self._recent_size > self.recent_tokens:
                        self._build_in_background()
                self._publish()

    def _fold(self, snapshot, indexed: list[np.ndarray]) -> None:
        """A new index, over `indexed`: those leave the scanned list (under the lock)."""
        self._snapshot = snapshot
        done = {id(r) for r in indexed}
        self._recent = [r for r in self._recent if id(r) not in done]
        self._recent_size = sum(r.size for r in self._recent)

    def _publish(self) -> None:
        """The recent replies as one scanned corpus, and what the native search reads (under the lock)."""
        parts = [p for r in self._recent for p in (r, np.full(1, SEP, dtype=np.int32))]
        pad = np.full(self.cfg.max_match + self.cfg.max_draft + 1, SEP, dtype=np.int32)
        self._recent_corpus = np.concatenate(parts + [pad]) if parts else None    # None: nothing to scan
        self.native_args = self._native_args(self._snapshot, self._recent_corpus)

    def settle(self) -> None:
        """Wait for the background rebuilds to finish (tests; a clean shutdown)."""
        while (builder := self._builder) is not None:
            builder.join()

    @staticmethod
    def _native_args(snapshot, recent: np.ndarray | None) -> tuple:
        """lookup_candidate's index arguments (addresses and sizes), with the arrays they point into
        (kept alive by whoever holds the tuple: a rebuild in another thread replaces, never frees)."""
        corpus, n, rev, sa = snapshot
        args = (corpus.ctypes.data, corpus.size, n, rev.ctypes.data, sa.ctypes.data, sa.size,
                None if recent is None else recent.ctypes.data, 0 if recent is None else recent.size)
        return args, (corpus, rev, sa, recent)

    def candidate(self, tail: np.ndarray) -> tuple[Candidate, int]:
        """The best continuation of `tail` (newest token last) and its match length."""
        best, best_match = Candidate([], []), 0
        for starts, match, corpus in (self._indexed(tail), self._scanned(tail)):
            if match >= self.cfg.min_match and starts.size:
                if starts.size > self.cfg.max_occurrences:
                    starts = starts[evenly_spaced(starts.size, self.cfg.max_occurrences)]
                cand = continuation(corpus, starts, match, self.cfg, self.cfg.shrink_replies, self.cfg.replies_later_scale)
                if cand.expected > best.expected:
                    best, best_match = cand, match
        return best, best_match

    def _scanned(self, tail: np.ndarray):
        corpus = self._recent_corpus
        if corpus is None:
            return np.empty(0, dtype=np.int64), 0, corpus
        starts, match = scan_match(np.concatenate([corpus, tail]), corpus.size, self.cfg, tail.size)
        return starts, match, corpus

    def _indexed(self, tail: np.ndarray):
        corpus, n, rev, sa = self._snapshot
        lib = _native()
        if lib is not None:
            tail_rev = np.ascontiguousarray(tail[::-1][:self.cfg.max_match], dtype=np.int32)
            lo, hi = ctypes.c_long(), ctypes.c_long()
            match = lib.lookup_narrow(rev.ctypes.data, sa.ctypes.data, sa.size, tail_rev.ctypes.data, tail_rev.size,
                                      ctypes.byref(lo), ctypes.byref(hi))
            lo, hi = lo.value, hi.value
        else:
            lo, hi, match = self._narrowed(tail, rev, sa)
        if match == 0:
            return np.empty(0, dtype=np.int64), 0, corpus
        # a match at reversed position r covers corpus[n-1-r-match+1 .. n-1-r]: it continues at n - r
        return n - sa[lo:hi].astype(np.int64), match, corpus

    def _narrowed(self, tail: np.ndarray, rev: np.ndarray, sa: np.ndarray) -> tuple[int, int, int]:
        """_indexed's range in numpy (lookup_narrow where the library is built)."""
        lo, hi, match = 0, sa.size, 0
        for j in range(min(self.cfg.max_match, tail.size)):
            tok = int(tail[-1 - j])
            if hi - lo <= GATHER_AT_MOST:
                col = rev[sa[lo:hi] + j]
                key = col.dtype.type(tok)      # a Python int would make numpy copy the range as int64
                new_lo, new_hi = lo + int(col.searchsorted(key, "left")), lo + int(col.searchsorted(key, "right"))
            else:       # a long common phrase: bisect without gathering the range
                key = lambda i, j=j: int(rev[sa[i] + j])       # noqa: E731 - bisect's key
                new_lo = bisect.bisect_left(range(hi), tok, lo, hi, key=key)
                new_hi = bisect.bisect_right(range(hi), tok, new_lo, hi, key=key)
            if new_lo >= new_hi:
                break
            lo, hi, match = new_lo, new_hi, j + 1
        return lo, hi, match


class LookupDrafter(Drafter):
    """Drafts from the conversation (prompt lookup) and, when given, a shared ReplyIndex.

    A candidate's estimates come from counts; how often such an estimate proves right is learned from
    the rounds (`calibration`, by estimate; optimistic by one standard error, so that a few unlucky
    rounds do not shut an estimate out for good), and a draft is cut where the calibrated tokens per verify
    cost peak, at the engine's verify costs as the loop measures them. On a CPU where verifying 2
    tokens costs 1.3x a step, the raw estimates drafted 3-token runs that kept 0.8 of a token."""
    name = "lookup"

    def __init__(self, index: ReplyIndex | None = None, cfg: LookupConfig = LookupConfig(),
                 costs: VerifyCosts | None = None, calibration: Calibration | None = None, stop_ids: Iterable[int] = ()):
        self.index, self.cfg = index, cfg
        self.stop_ids = frozenset(int(t) for t in stop_ids)     # end-of-reply tokens: nothing is drafted past one
        self.costs = costs or VerifyCosts()
        self.calibration = calibration or Calibration()     # an engine's drafters share one (calibrate())
        self._estimates: list[float] = []      # the raw estimates of the tokens last proposed
        c = cfg     # lookup_candidate's configuration (its buffers hold 64 tokens of match and of draft)
        same = index is None or index.cfg == cfg
        self._native_cfg = None if max(c.max_match, c.max_draft) > 64 or not same else (
            np.array([c.max_match, c.min_match, c.conversation_min_match, c.max_occurrences, c.max_draft], np.int32),
            np.array([c.match_factor, c.prior, c.shrink_conversation, c.shrink_replies, c.replies_later_scale,
                      c.min_confidence], np.float64))
        self.reset()

    def reset(self) -> None:
        # host copy of the committed sequence: the first _n of _buf, which grows by doubling (a
        # concatenate each round copied the whole conversation)
        self._buf, self._n = np.empty(1024, dtype=np.int32), 0
        self._start_reply()

    def _start_reply(self) -> None:
        self._reply_expected = self._reply_right = 0.0    # this reply's judged tokens: calibrated sum, right

    def reply_factor(self) -> float:
        """How this reply's drafts fared against their calibrated estimates: (right + s) / (expected + s).
        The calibration pools every reply; this scales it to the one under way, so a reply whose drafts
        keep missing stops paying for verifies (a 12-token rewrite lost 15% so) and one whose drafts
        keep landing drafts further."""
        s = self.cfg.reply_evidence
        return 1.0 if s <= 0 else (self._reply_right + s) / (self._reply_expected + s)

    def _sync(self, committed: torch.Tensor) -> np.ndarray:
        """The committed sequence on the host, reading only what `extend` has not brought."""
        n = committed.numel()
        if n < self._n:
            self._n = 0
        if n > self._n:
            self._append(committed[self._n:].cpu().numpy())
        return self._buf[:self._n]

    def _append(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int32)
        end = self._n + ids.size
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=np.int32)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:end] = ids
        self._n = end

    def prefill(self, committed):
        self._sync(committed)
        self._start_reply()

    def extend(self, new_ids: list[int]) -> None:
        self._append(new_ids)

    def candidate(self, committed: torch.Tensor) -> Candidate:
        """The conversation's candidate or the earlier replies', whichever expects more accepted tokens."""
        seq = self._sync(committed)
        lib = _native()
        if lib is not None and self._native_cfg is not None:
            return self._native_candidate(lib, seq)
        return self._candidate(seq)

    def _native_candidate(self, lib, seq: np.ndarray) -> Candidate:
        """candidate() as one call of lookup.c's lookup_candidate (the same tokens and estimates)."""
        index = self.index if self.index is not None and len(self.index) else None
        args, _alive = index.native_args if index is not None else (_NO_INDEX, None)
        icfg, dcfg = self._native_cfg
        tokens, probs = np.empty(self.cfg.max_draft, dtype=np.int32), np.empty(self.cfg.max_draft, dtype=np.float64)
        made = lib.lookup_candidate(seq.ctypes.data, seq.size, *args, icfg.ctypes.data, dcfg.ctypes.data,
                                    tokens.ctypes.data, probs.ctypes.data)
        if made < 0:
            raise MemoryError("lookup_candidate: out of memory")
        return Candidate(tokens[:made].tolist(), probs[:made].tolist())

    def _candidate(self, seq: np.ndarray) -> Candidate:
        """candidate() in Python and numpy (each search step native where the library is built)."""
        starts, match = scan_match(seq, seq.size - 1, self.cfg, seq.size - 1)
        best = Candidate([], [])
        if match >= self.cfg.conversation_min_match:
            starts = starts[-self.cfg.max_occurrences:]
            best = continuation(seq, starts, match, self.cfg, self.cfg.shrink_conversation)
        if self.index is not None and len(self.index):
            other, _ = self.index.candidate(seq[-self.cfg.max_match:])
            if other.expected > best.expected:
                best = other
        return best

    def draft(self, committed: torch.Tensor, max_tokens: int) -> Candidate:
        """The candidate with calibrated estimates, cut where it pays best (empty: a plain step pays more).
        Tokens past an end-of-reply token are never drafted: the reply stops there. (A reply that copies
        the end of its prompt found the chat template's turn markers next there, and one round verified
        16 of them: 30 ms, six steps, for a 12-token rewrite.)"""
        raw = self.candidate(committed)
        if self.stop_ids:
            max_tokens = min(max_tokens, next((i + 1 for i, t in enumerate(raw.tokens) if t in self.stop_ids),
                                              len(raw.tokens)))
        factor, optimistic = self.reply_factor(), self.calibration.optimistic
        cand = best_prefix(Candidate(raw.tokens[:max_tokens], raw.probs[:max_tokens]), self.costs,
                           lambda p: min(1.0, optimistic(p) * factor))
        self._estimates = raw.probs[:len(cand.tokens)]
        return cand

    def proposed(self, n: int) -> None:
        """Only the first n tokens of the last draft went to the target."""
        del self._estimates[n:]

    def learn(self, n_accepted: int) -> None:
        """The target kept the first n_accepted tokens of the last draft."""
        judged = self._estimates[:n_accepted + 1]            # those after the first miss were never judged
        self._reply_expected += sum(self.calibration(p) for p in judged)
        self._reply_right += min(n_accepted, len(judged))
        self.calibration.observe(self._estimates, n_accepted)
        self._estimates = []

    def propose(self, committed, max_tokens, policy, sampler):
        t0 = time.perf_counter()
        cand = self.draft(committed, max_tokens)
        tokens, confidences = [], []
        for j, (tok, p) in enumerate(zip(cand.tokens, cand.probs)):
            tokens.append(tok)
            confidences.append(p)
            if not policy.keep_drafting(j + 1, p if policy.needs_confidence else None):
                break
        self.proposed(len(tokens))
        out = torch.tensor(tokens, dtype=torch.long).to(committed.device, non_blocking=True)
        return Proposal(out, None, confidences if policy.needs_confidence else [], time.perf_counter() - t0)

    def rollback(self, n_accepted: int, path: list[int] | None = None) -> None:
        self.learn(n_accepted)

    def remember(self, reply: Sequence[int]) -> None:
        """A finished reply joins the shared index (when there is one)."""
        if self.index is not None and len(reply):
            self.index.add(reply)


def calibrate(calibration: Calibration, index: ReplyIndex, replies: Iterable[Sequence[int]],
              cfg: LookupConfig = LookupConfig()) -> int:
    """Teach `calibration` how often lookup's estimates are right before any chat has run, from the
    target's own greedy replies that `index` does not hold: greedy verification keeps a drafted token
    exactly when it is the reply's next one, so walking each reply as the decoding loop would (a
    round's accepted tokens and one more) needs no forward. Without this the first replies drafted on
    uncalibrated counts (the app's first reply: 0.81x plain decoding). Returns the rounds walked."""
    drafter, rounds = LookupDrafter(index, cfg, calibration=calibration), 0
    for reply in replies:
        seq = torch.as_tensor(np.asarray(reply, dtype=np.int64))
        drafter.reset()
        i = 1
        while i < seq.numel() - 1:
            cand = drafter.candidate(seq[:i])
            right = leading(seq[i:i + len(cand.tokens)].tolist(), cand.tokens)
            calibration.observe(cand.probs, right)
            i += right + 1
            rounds += 1
    return rounds


def _tree(proposal: Proposal, branch: Branch, chain: list[int] | None) -> Proposal:
    """The proposal's chain with a second branch: a tree whose first nodes are the chain."""
    extra = torch.tensor(branch.tokens, dtype=torch.long).to(proposal.tokens.device, non_blocking=True)
    return Proposal(torch.cat([proposal.tokens, extra]), None, proposal.confidences, proposal.seconds,
                    parents=branch.parents, depths=branch.depths,
                    token_ids=chain + branch.tokens if chain is not None else None, chain=proposal.tokens.numel(),
                    setup_s=proposal.setup_s)


class WithLookup(Drafter):
    """A model drafter (EAGLE-3, a draft model) with lookup's drafts beside it.

    Each round the lookup candidate is found first (no forward). When its expected accepted tokens
    (its estimates calibrated on the rounds lookup drafted) reach the model's running mean of accepted
    tokens per round, lookup's draft is verified alone (it also saves the model's cost, so a tie goes to it).
    Otherwise the model drafts; when greedy and `branches` is on, lookup's candidate rides along as a
    second branch of a draft tree (sharing the model's nodes where the two agree), cut where one
    more lookup token no longer raises the round's expected tokens per verify cost: a round then
    keeps whichever branch the target agrees with. Sampled rounds verify one candidate (a tree of
    a sampled chain and a deterministic branch would give up the chain's p/q acceptance).
    """

    def __init__(self, model: Drafter, lookup: LookupDrafter, decay: float = 0.9, branches: bool = True):
        self.model, self.lookup, self.decay, self.branches = model, lookup, decay, branches
        self.name = model.name
        self.model_mean = 1.0          # accepted tokens per round the model drafted
        self._used: str | None = None
        self._chain = 0                # a two-branch round: the model's chain length
        self._branch: list[int] = []   # ... and lookup's nodes, in order
        self.lookup_rounds = 0
        self.branch_rounds = 0

    def attach(self, target_lm) -> None:
        self.model.attach(target_lm)

    @property
    def start_after(self) -> int:
        return self.model.start_after        # lookup alone (free_draft) until the model starts

    def reset(self) -> None:
        self.model.reset()
        self.lookup.reset()
        self._used = None

    def resume(self, session, prompt_ids, max_reuse=None) -> None:
        self.model.resume(session, prompt_ids, max_reuse)
        self.lookup.reset()
        self._used = None

    def finish(self, sequence) -> None:
        self.model.finish(sequence)

    def prefill(self, committed) -> None:
        self.model.prefill(committed)
        self.lookup.prefill(committed)

    def extend(self, new_ids: list[int]) -> None:
        self.model.extend(new_ids)
        self.lookup.extend(new_ids)

    def _candidate(self, committed, max_tokens: int) -> Candidate:
        """Lookup's draft cut where its calibrated tokens per verify cost peak."""
        return self.lookup.draft(committed, max_tokens)

    def _lookup_round(self, cand: Candidate, device, t0: float) -> Proposal:
        self._used = "lookup"
        self.lookup_rounds += 1
        out = torch.tensor(cand.tokens, dtype=torch.long).to(device, non_blocking=True)
        return Proposal(out, None, [], time.perf_counter() - t0)

    def propose(self, committed, max_tokens, policy, sampler):
        t0 = time.perf_counter()
        cand = self._candidate(committed, max_tokens)
        if cand.tokens and cand.expected >= self.model_mean:
            return self._lookup_round(cand, committed.device, t0)
        self._used = "model"
        proposal = self.model.propose(committed, max_tokens, policy, sampler)
        if self.branches and cand.tokens and sampler.params.greedy and proposal.parents is None \
                and proposal.tokens.numel():
            proposal = self._with_branch(proposal, cand, policy)
        proposal.seconds = time.perf_counter() - t0 - proposal.setup_s
        return proposal

    def _with_branch(self, proposal: Proposal, cand: Candidate, policy) -> Proposal:
        """The model's chain plus lookup's candidate as a second branch (none: the chain alone)."""
        k = proposal.tokens.numel()
        # where a read is free (a CPU) the branch leaves the model's chain where the two differ; where it
        # stalls (read_once) it starts at the root and the verify reads the tokens with the target's choices
        chain = proposal.token_ids or (None if getattr(self.model, "read_once", False) else proposal.tokens.tolist())
        calibrated = getattr(policy, "calibrated", None)
        if proposal.confidences and calibrated is not None:
            expected = float(np.cumprod([calibrated(float(c)) for c in proposal.confidences]).sum())
        else:
            expected = self.model_mean
        branch = branch_beside(chain, k, expected, cand, self.lookup.costs)
        if branch is None:
            return proposal
        self.lookup.proposed(len(branch.nodes))
        self._used, self._chain, self._branch = "both", k, branch.nodes
        self.branch_rounds += 1
        return _tree(proposal, branch, chain)

    def free_draft(self, committed, max_tokens):
        """The policy drafts nothing this round (the model's drafts do not pay): lookup still may, when
        its draft beats a plain step at the measured verify costs. A search that finds nothing returns
        an empty proposal with its seconds: on a CPU where a step takes 5 ms a miss costs a tenth of
        one, and the policy's measured rates (allows_free_draft) must see it."""
        self._used = None
        t0 = time.perf_counter()
        cand = self._candidate(committed, max_tokens)
        if cand.tokens:
            return self._lookup_round(cand, committed.device, t0)
        return Proposal(committed.new_empty(0), None, [], time.perf_counter() - t0)

    def rollback(self, n_accepted: int, path: list[int] | None = None) -> None:
        if self._used == "both":        # each branch learns how far the kept path followed it
            on_chain = leading(path, range(self._chain))
            self.lookup.learn(leading(path, self._branch))
            self.model.rollback(on_chain)
            self._learn_model(on_chain)
        elif self._used == "lookup":
            self.lookup.learn(n_accepted)
        elif self._used == "model":
            self.model.rollback(n_accepted, path)
            self._learn_model(n_accepted)

    def _learn_model(self, n_accepted: int) -> None:
        self.model_mean = self.decay * self.model_mean + (1 - self.decay) * n_accepted

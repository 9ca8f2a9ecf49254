"""Lookahead policies: how many draft tokens to propose each round.

A policy is asked three things per round: the most it allows (`max_lookahead`), after each
drafted token whether to go on (`keep_drafting`, given the draft's probability of that token),
and afterwards what happened (`end_round`). `constant`, `heuristic`, `dynamic` and `adaptive`
follow Transformers' assisted generation; `throughput` is ours: it keeps drafting only while
the expected tokens per second of the round still rises, from online estimates of acceptance
(calibrated on the draft's confidence) and of the measured draft and verify costs.
"""
from __future__ import annotations

from collections import deque

import numpy as np


class LookaheadPolicy:
    name = "base"
    needs_confidence = False      # whether keep_drafting reads the draft's confidence (a host sync per token)

    def max_lookahead(self) -> int:
        raise NotImplementedError

    def keep_drafting(self, drafted: int, confidence: float | None) -> bool:
        return True

    def planned_lookahead(self) -> int:
        """How many tokens to draft before reading their confidences, where each read stalls an
        accelerator (then the chain is cut where keep_drafting stops): by default all it allows."""
        return 1 << 30

    def allows_free_draft(self) -> bool:
        """In a round max_lookahead kept plain: whether a draft that costs no forward (lookup beside a
        model, Drafter.free_draft) may still be verified."""
        return True

    def start_reply(self) -> None:
        """A new reply begins (its prompt is prefilled); a policy kept across a chat's turns hears of each."""

    def end_round(self, drafted: int, accepted: int, confidences: list[float], draft_s: float, verify_s: float,
                  verified: int | None = None, committed: int | None = None) -> None:
        """What the round did: the model drafted `drafted` tokens (with these confidences) and `accepted` of
        them were kept; `verified` tokens went through the target (drafted + 1 unless lookup's
        tokens rode along as another branch); `committed` tokens were kept in all (accepted + 1
        unless lookup's branch won)."""

    def describe(self) -> str:
        return self.name


class Constant(LookaheadPolicy):
    name = "constant"

    def __init__(self, k: int = 5):
        self.k = k

    def max_lookahead(self) -> int:
        return self.k

    def describe(self) -> str:
        return f"constant(k={self.k})"


class Heuristic(LookaheadPolicy):
    """+2 after a fully accepted round, else -1 (minimum 1); kept across requests."""
    name = "heuristic"

    def __init__(self, k: int = 5):
        self.k = k

    def max_lookahead(self) -> int:
        return self.k

    def end_round(self, drafted, accepted, confidences, draft_s, verify_s, verified=None, committed=None):
        if drafted:
            self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)


class Dynamic(LookaheadPolicy):
    """Transformers' default since 4.45: up to 20 tokens, stop when the draft's confidence < threshold."""
    name = "dynamic"
    needs_confidence = True

    def __init__(self, max_tokens: int = 20, threshold: float = 0.4):
        self.max_tokens, self.threshold = max_tokens, threshold

    def max_lookahead(self) -> int:
        return self.max_tokens

    def keep_drafting(self, drafted, confidence):
        return confidence is None or confidence >= self.threshold

    def describe(self) -> str:
        return f"{self.name}(max={self.max_tokens}, threshold={self.threshold:.2f})"


def roc_threshold(confidences: list[float], accepted: list[int], fn_weight: float = 3.0) -> float | None:
    """The confidence threshold minimising fpr + fn_weight * fnr (Transformers' adaptive rule)."""
    c, y = np.asarray(confidences), np.asarray(accepted, dtype=bool)
    pos, neg = y.sum(), (~y).sum()
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(-c)
    c, y = c[order], y[order]
    tp, fp = np.cumsum(y), np.cumsum(~y)
    last = np.r_[c[1:] != c[:-1], True]          # one point per distinct threshold
    cost = fp[last] / neg + fn_weight * (1 - tp[last] / pos)
    return float(c[last][np.argmin(cost)])


class Adaptive(Dynamic):
    """Dynamic, with the threshold refit after every round on the draft tokens seen so far."""
    name = "adaptive"

    def __init__(self, max_tokens: int = 20, threshold: float = 0.4, history: int = 2000):
        super().__init__(max_tokens, threshold)
        self.confidences: deque[float] = deque(maxlen=history)
        self.outcomes: deque[int] = deque(maxlen=history)

    def end_round(self, drafted, accepted, confidences, draft_s, verify_s, verified=None, committed=None):
        seen = confidences[:accepted + 1]      # tokens after the first rejection were never judged
        self.confidences.extend(seen)
        self.outcomes.extend([1] * accepted + [0] * (len(seen) - accepted))
        if len(self.confidences) > 5:
            t = roc_threshold(list(self.confidences), list(self.outcomes))
            if t is not None:
                self.threshold = t


class Calibration:
    """How often a drafted token is right, by the draft's own estimate of it (10 bins): before data the
    estimate itself is trusted (two pseudo-observations), then what the rounds showed. Fed with the
    tokens up to the first rejection: those after it were never judged. Counts are Python floats: the
    loop asks this per drafted token, and numpy's scalar indexing and arithmetic cost several times
    more there (`accepted` and `seen` give them as arrays)."""
    BINS = 10

    def __init__(self):
        self._accepted = [0.0] * self.BINS
        self._seen = [0.0] * self.BINS

    @property
    def accepted(self) -> np.ndarray:
        return np.array(self._accepted)

    @property
    def seen(self) -> np.ndarray:
        return np.array(self._seen)

    def _bin(self, p: float) -> int:
        return min(self.BINS - 1, max(0, int(p * self.BINS)))

    def __call__(self, p: float) -> float:
        b = self._bin(p)
        prior = (b + 0.5) / self.BINS
        return (self._accepted[b] + 2 * prior) / (self._seen[b] + 2)

    def optimistic(self, p: float) -> float:
        """The calibrated estimate plus a standard error, damped while a bin has few observations: a bin
        that a few early rounds judged badly is still tried now and then (each try narrows it), so it
        is not shut out for good, and an empty bin is the estimate itself."""
        b, c = self._bin(p), self(p)
        n = self._seen[b]
        return min(1.0, c + (c * (1 - c) / (n + 2)) ** 0.5 * n / (n + 4))

    def judged(self) -> float:
        """Draft tokens judged so far."""
        return sum(self._seen)

    def mean(self) -> float:
        return (sum(self._accepted) + 1) / (sum(self._seen) + 2)

    def observe(self, estimates: list[float], accepted: int) -> None:
        for i, p in enumerate(estimates[:accepted + 1]):
            b = self._bin(p)
            self._seen[b] += 1
            self._accepted[b] += i < accepted


class CostSamples:
    """The last `size` (tokens, seconds) samples of a cost, with the sums its least-squares line needs
    kept as samples come and go: the loop refits once a round, and summing 64 samples in Python took
    ~70 us there (its caches cold after each forward), 2% of a verify."""

    def __init__(self, size: int = 64):
        self._samples: deque[tuple[int, float]] = deque()
        self.size = size
        self._sizes: dict[int, int] = {}        # how many samples of each size: the span of sizes seen
        self._sx = self._sxx = 0                # integer sums: exact
        self._sy = self._sxy = self._s_per = 0.0

    def append(self, sample: tuple[int, float]) -> None:
        x, y = int(sample[0]), float(sample[1])
        if len(self._samples) == self.size:
            self._add(*self._samples.popleft(), -1)
        self._samples.append((x, y))
        self._add(x, y, 1)

    def _add(self, x: int, y: float, sign: int) -> None:
        self._sizes[x] = self._sizes.get(x, 0) + sign
        if not self._sizes[x]:
            del self._sizes[x]
        self._sx += sign * x
        self._sxx += sign * x * x
        self._sy += sign * y
        self._sxy += sign * x * y
        self._s_per += sign * y / x if x else 0.0

    def __len__(self) -> int:
        return len(self._samples)

    def __iter__(self):
        return iter(self._samples)

    def span(self) -> int:
        return max(self._sizes) - min(self._sizes) if self._sizes else 0

    def line(self, span: int) -> tuple[float, float] | None:
        """seconds = fixed + per_token * tokens, least squares; None until the sizes seen span `span`
        tokens: a slope read off 1 and 2 tokens extrapolates badly (verifying 2 tokens costs ~10%
        more than 1 on a CPU, 5 tokens ~25% more)."""
        n = len(self._samples)
        if n < 3 or self.span() < span:
            return None
        slope = (n * self._sxy - self._sx * self._sy) / (n * self._sxx - self._sx * self._sx)
        return max((self._sy - slope * self._sx) / n, 0.0), max(slope, 0.0)

    def means(self) -> tuple[float, float]:
        n = len(self._samples)
        return self._sx / n, self._sy / n

    def mean_per_token(self) -> float:
        return self._s_per / len(self._samples)


class RoundRates:
    """Measured rounds of one kind (tokens committed, one-token steps taken, round number), the last
    `size` within the policy's horizon, with their sums kept: a measured rate is read several times a
    round."""

    def __init__(self, size: int = 48):
        self._rounds: deque[tuple[int, float, int]] = deque()
        self.size = size
        self._tokens, self._steps = 0, 0.0

    def append(self, tokens: int, steps: float, at: int) -> None:
        if len(self._rounds) == self.size:
            self._drop()
        self._rounds.append((tokens, steps, at))
        self._tokens += tokens
        self._steps += steps

    def _drop(self) -> None:
        tokens, steps, _ = self._rounds.popleft()
        self._tokens -= tokens
        self._steps -= steps
        if not self._rounds:
            self._steps = 0.0          # no rounding left over

    def forget_before(self, first: int) -> RoundRates:
        """Drop the rounds numbered before `first` (rounds come in order, so they are the oldest)."""
        while self._rounds and self._rounds[0][2] < first:
            self._drop()
        return self

    def clear(self) -> None:
        self._rounds.clear()
        self._tokens, self._steps = 0, 0.0

    def __len__(self) -> int:
        return len(self._rounds)

    def rate(self) -> float:
        return self._tokens / max(self._steps, 1e-9)


class Throughput(LookaheadPolicy):
    """Ours: draft while the round's expected tokens per second still rises.

    After drafting j tokens the round is expected to yield E_j = 1 + sum_i P_i tokens, where P_i is
    the probability that the first i drafts are all accepted (a running product of the draft's
    calibrated confidences), and to cost T_j = draft_cost(j) + verify_cost(j + 1). One more token
    adds P_j * mean_acceptance expected tokens for one more draft step and a slightly longer
    verify: go on only if E/T improves. Costs are measured online, so the same policy drafts
    longer on hardware where verification is nearly free (GPU) and shorter where it is not.

    The draft cost is fitted as fixed + per-token: an EAGLE-3 head first catches up on the tokens
    verified last round, whatever it drafts next. Counting that catch-up per drafted token made
    short drafts look dear, so the policy drafted less and less (0.5 tokens a round on the demo).

    What the model leaves out (an assistant's catch-up after plain rounds, rollbacks, the noise of
    its estimates, a lookup search that finds nothing) is checked against what the rounds measure:
    the tokens per one-token step (at the machine's speed of the time) of the rounds the policy let
    the drafter try against those it kept plain, over the last HORIZON rounds (every
    `probe_every`-th round is plain to know that; a new reply tries again a drafter measured slower,
    as its text may be of another kind). A draft that costs (almost) nothing is not
    gated by the model, only by this measure: on a CPU whose verify of 2 tokens costs 1.5x a step,
    lookup's misses and short drafts lost 8% to plain decoding. Where drafting does not pay, the
    policy decodes plainly and explores now and then, each time twice as rarely while drafting keeps
    not paying (an assistant's exploring round reads all the conversation since its last): the
    default must never lose to plain decoding.
    """
    name = "throughput"
    needs_confidence = True

    MEASURED_ROUNDS = 8       # of each kind, before measured rates overrule the model
    HORIZON = 512             # rounds: older measured rounds are forgotten (a reply is ~100 rounds)
    MAX_EXPLORE_GAP = 256     # rounds
    SURE_AFTER = 30           # drafted tokens seen

    def __init__(self, max_tokens: int = 20, explore_every: int = 8, probe_every: int = 32):
        self.max_tokens, self.explore_every, self.probe_every = max_tokens, explore_every, probe_every
        self._explore_gap, self._next_explore = explore_every, explore_every
        self.calibration = Calibration()      # acceptance by the draft's confidence
        self.draft_samples = CostSamples()      # (tokens drafted, seconds)
        self.verify_samples = CostSamples()     # (tokens verified, seconds)
        # (tokens committed, one-token steps it took, round number): rounds the drafter was let try
        self.drafted_rounds = RoundRates()
        self.plain_rounds = RoundRates()        # rounds the policy kept plain
        self._plain_round = True                # the round under way: plain unless max_lookahead let it draft
        # the plain rounds again, split by whether a free draft (lookup beside a model) was let try
        self.free_rounds = RoundRates()
        self.bare_rounds = RoundRates()
        self._free_round: bool | None = None
        # each measured round's seconds are counted in one-token steps of their time (see end_round)
        self._step_s: float | None = None
        self._plain_asked = 0
        self._after_plain = False               # the last round was kept plain
        self._c0 = self._c1 = 0.0               # the draft-cost fit (_fit_costs), read by end_round before the first
        self.rounds = 0
        self._p = 1.0
        self._expected = 1.0

    # -- estimates -------------------------------------------------------------------------
    def calibrated(self, confidence: float) -> float:
        return self.calibration(confidence)

    def mean_acceptance(self) -> float:
        return self.calibration.mean()

    def _fit_costs(self) -> None:
        """Refit both costs once a round (not per drafted token: this runs in the hot loop)."""
        fit = self.verify_samples.line(3)
        if fit is None:
            mean_x, mean_y = self.verify_samples.means()
            base = mean_y / (1 + 0.05 * (mean_x - 1))          # prior: +5% per extra token
            fit = 0.95 * base, 0.05 * base
        self._a, self._b = max(fit[0], 1e-6), fit[1]
        fit = self.draft_samples.line(2)
        if fit is None or fit[1] == 0.0:     # one draft size so far: all of it per token
            fit = 0.0, self.draft_samples.mean_per_token()
        self._c0, self._c1 = fit
        self._alpha = self.mean_acceptance()

    def verify_cost(self, n_tokens: int) -> float:
        return self._a + self._b * n_tokens

    def draft_cost(self, n_tokens: int) -> float:
        return self._c0 + self._c1 * n_tokens if n_tokens else 0.0

    def _warm(self) -> bool:
        return bool(self.draft_samples) and len(self.verify_samples) >= 2

    def _free_draft(self) -> bool:
        """A draft that costs (almost) nothing (lookup): nothing to save by not drafting."""
        return self.draft_cost(1) < 0.05 * self.verify_cost(1)

    def _recent(self, rounds: RoundRates) -> RoundRates:
        """The measured rounds of the last HORIZON: what the text is now decides, and a drafter turned
        off long ago is tried again once its rounds are forgotten (explores alone, ever rarer, took
        dozens of replies to bring lookup back on prompts where it paid 1.5x)."""
        return rounds.forget_before(self.rounds - self.HORIZON + 1)

    def _drafting_measures_slower(self) -> bool:
        """The model's rounds made fewer tokens a step than the plain ones, as measured lately."""
        tried, plain = self._recent(self.drafted_rounds), self._recent(self.plain_rounds)
        if min(len(tried), len(plain)) < self.MEASURED_ROUNDS:
            return False
        return tried.rate() < plain.rate()

    def _rate(self, j: int, expected: float) -> float:
        return expected / (self.draft_cost(j) + self.verify_cost(j + 1))

    def _gain(self, j: int, expected: float, p: float) -> bool:
        return self._rate(j + 1, expected + p * self._alpha) > self._rate(j, expected)

    def _drafting_pays(self) -> bool:
        """Some lookahead beats plain decoding at the mean acceptance: the fixed cost is paid once a
        round, so one draft token can lose where three win. A draft that costs (almost) nothing
        (lookup) has nothing to save by this reckoning: each round's confidences decide, and only the
        measured rates (_drafting_measures_slower) turn it off."""
        if self._free_draft():
            return True
        plain, expected, p = self._rate(0, 1.0), 1.0, 1.0
        for j in range(1, self.max_tokens + 1):
            p *= self._alpha
            expected += p
            if self._rate(j, expected) > plain:
                return True
        return False

    # -- policy ----------------------------------------------------------------------------
    def max_lookahead(self) -> int:
        k = self._lookahead()
        self._plain_round = k == 0
        return k

    def _lookahead(self) -> int:
        self.rounds += 1
        self._p, self._expected = 1.0, 1.0
        if not self._warm():
            return self.max_tokens
        self._fit_costs()
        if not self._drafting_pays() or self._drafting_measures_slower():
            if self.rounds < self._next_explore:
                return 0                              # drafting does not pay here: plain decoding
            self._next_explore = self.rounds + self._explore_gap
            if self.calibration.judged() >= self.SURE_AFTER:     # rarer only once the acceptance is known
                self._explore_gap = min(2 * self._explore_gap, self.MAX_EXPLORE_GAP)
            return self.max_tokens
        self._explore_gap, self._next_explore = self.explore_every, self.rounds + self.explore_every
        return 0 if self.rounds % self.probe_every == 0 else self.max_tokens    # a plain round to compare

    def start_reply(self) -> None:
        """A new message may ask for another kind of text (a summary after small talk: lookup's 1.5x
        after its 0.95x). Where drafting, or lookup beside a model, measured slower, the tried rounds
        are forgotten, so this reply's first rounds try again and decide anew."""
        if self._drafting_measures_slower():
            self.drafted_rounds.clear()
            self._explore_gap, self._next_explore = self.explore_every, self.rounds + self.explore_every
        free, bare = self._recent(self.free_rounds), self._recent(self.bare_rounds)
        if min(len(free), len(bare)) >= self.MEASURED_ROUNDS and free.rate() < bare.rate():
            self.free_rounds.clear()

    def allows_free_draft(self) -> bool:
        """Lookup beside a model, in a round kept plain: let it try unless the plain rounds it tried
        measure fewer tokens per second than those it did not (every `probe_every`-th is bare to know
        that; every `explore_every`-th tries, to notice when it starts to pay)."""
        self._plain_asked += 1
        if self._plain_asked % self.probe_every == 0:
            allowed = False
        elif min(len(free := self._recent(self.free_rounds)), len(bare := self._recent(self.bare_rounds))) \
                < self.MEASURED_ROUNDS:
            allowed = True
        else:
            allowed = (free.rate() >= bare.rate()
                       or self._plain_asked % self.explore_every == 0)
        self._free_round = allowed
        return allowed

    def planned_lookahead(self) -> int:
        """The length with the best expected rate at the mean acceptance, and one more (confident
        rounds run longer than the mean); 4 until the costs are measured."""
        if not self._warm():
            return 4
        expected, p, best, best_rate = 1.0, 1.0, 1, 0.0
        for j in range(1, self.max_tokens + 1):
            p *= self._alpha
            expected += p
            if self._rate(j, expected) > best_rate:
                best, best_rate = j, self._rate(j, expected)
        return min(self.max_tokens, best + 1)

    def seed_costs(self, verify_ms: dict[int, float]) -> None:
        """Start from the target's verify-cost curve measured at load (ms by tokens verified), so the
        first rounds already know what a longer verify costs; measured rounds soon outweigh it."""
        for n, ms in sorted(verify_ms.items())[:4]:
            self.verify_samples.append((int(n), ms / 1000))

    def keep_drafting(self, drafted, confidence):
        if confidence is None:
            return True
        self._p *= self.calibrated(confidence)
        self._expected += self._p
        if not self._warm():
            return confidence >= 0.4                 # dynamic's rule until costs are measured
        return self._gain(drafted, self._expected, self._p)

    def _steps(self, seconds: float, verified: int, verify_s: float) -> float:
        """`seconds` in one-token steps of the machine's speed now: a running mean of the rounds'
        one-token forwards (a first longer one by the +5%-a-token prior). Our machines' speed swings
        by a third within minutes and a reply's steps slow as its context grows, while the plain
        rounds the gate compares with were measured up to hundreds of rounds earlier: counted in
        seconds, drafting that paid was judged slower and turned off for many prompts."""
        if verify_s > 0 and (verified == 1 or self._step_s is None):
            step = verify_s / (1 + 0.05 * (verified - 1))
            self._step_s = step if self._step_s is None else self._step_s + 0.2 * (step - self._step_s)
        return seconds / self._step_s if self._step_s else seconds

    def end_round(self, drafted, accepted, confidences, draft_s, verify_s, verified=None, committed=None):
        verified = verified or drafted + 1
        self.verify_samples.append((verified, verify_s))
        committed = accepted + 1 if committed is None else committed
        # A drafter's first round after plain ones also caught up on the tokens it sat out (an EAGLE-3 head
        # reads their features, a draft model runs over them): not what drafting costs while it drafts.
        # Counted, a drafter turned off for a while looked the dearer the longer it had been off, and never
        # came back (simulated: a head at 0.1 ms a token caught up stayed off after a hard stretch of text).
        # A stalled draft (272 ms for 6 tokens in one bench run) says no more than "as slow as the target";
        # and as no new sample comes while drafting is off, an exploring round's (which read the backlog
        # too) is taken where it shows the drafter cheaper than the fit: else one stall kept it off for good.
        after_plain, self._after_plain = self._after_plain, self._plain_round
        if drafted and confidences:                        # lookup's rounds in a model's mode report none
            if self._step_s:
                draft_s = min(draft_s, drafted * self._step_s)
            if not after_plain or (self._warm() and draft_s < self.draft_cost(drafted)):
                self.draft_samples.append((drafted, draft_s))
        # a round the drafter was let try counts as tried even where it proposed nothing (a lookup miss
        # costs its search); a round kept plain as plain, even where lookup beside a model drafted
        steps = self._steps(draft_s + verify_s, verified, verify_s)
        (self.plain_rounds if self._plain_round else self.drafted_rounds).append(committed, steps, self.rounds)
        if self._plain_round and self._free_round is not None:
            (self.free_rounds if self._free_round else self.bare_rounds).append(committed, steps, self.rounds)
        self._plain_round, self._free_round = True, None
        self.calibration.observe(confidences, accepted)

    def describe(self) -> str:
        return f"{self.name}(max={self.max_tokens})"


POLICIES = {"constant": Constant, "heuristic": Heuristic, "dynamic": Dynamic, "adaptive": Adaptive,
            "throughput": Throughput}
DEFAULT_POLICY = "dynamic"


def make_policy(name: str, num_draft_tokens: int | None = None, verify_ms: dict[int, float] | None = None
                ) -> LookaheadPolicy:
    """A fresh policy by name; num_draft_tokens is k for constant/heuristic, the cap for the others;
    verify_ms (the target's verify-cost curve) seeds the policies that weigh costs."""
    policy = _new_policy(name, num_draft_tokens)
    if verify_ms and hasattr(policy, "seed_costs"):
        policy.seed_costs(verify_ms)
    return policy


def _new_policy(name: str, num_draft_tokens: int | None) -> LookaheadPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown lookahead policy {name!r}; choose one of {', '.join(POLICIES)}")
    if num_draft_tokens is not None and num_draft_tokens < 1:
        raise ValueError(f"--num-draft-tokens must be >= 1, got {num_draft_tokens}")
    cls = POLICIES[name]
    if num_draft_tokens is None:
        return cls()
    if cls in (Constant, Heuristic):
        return cls(k=num_draft_tokens)
    return cls(max_tokens=num_draft_tokens)

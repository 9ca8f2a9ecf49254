"""The cached forward the decoding loop uses for a model: our lean one where it applies, else Transformers'."""
from __future__ import annotations

import os
import statistics
import time

import torch

from . import lean
from .linear import quantization_of
from .model import CachedLM


def make_lm(model, backend: str | None = None, exact: bool = True):
    """The fastest cached forward for this model: our lean one for Llama-family models, else Transformers'.

    backend: "auto" (default, or DYNCHAT_BACKEND), "lean" or "transformers". exact=False (a
    drafter's model) lets the lean forward use cheaper, inexact matmuls (bf16 weights).
    """
    backend = backend or os.environ.get("DYNCHAT_BACKEND", "auto")
    if backend not in ("auto", "lean", "transformers"):
        raise ValueError(f"unknown backend {backend!r}; choose auto, lean or transformers")
    if backend == "transformers" or not lean.supports(model):
        if quantization_of(model) != "none":
            raise ValueError(f"{quantization_of(model)} weights run on dynchat's own forward for Llama-family "
                             "models only; Transformers' forward would run the float weights")
        if backend == "lean":
            raise ValueError(f"the lean backend does not support {model.config.model_type!r} models")
        return CachedLM(model)
    return lean.LeanLM(model, exact=exact)


@torch.inference_mode()
def verify_cost_curve(lm, sizes=(1, 2, 5, 9, 17), context: int = 128, repeats: int = 7) -> dict[int, float]:
    """Median ms of one forward of n tokens after `context` cached tokens: what verifying n tokens costs.
    The sizes take turns after one prefill (each forward rolled back), so a slow spell of the machine
    falls on all of them alike instead of bending the curve: largest first, each timed forward after an
    untimed one-token forward, so that the step and a chain's short verifies are timed as the loop runs
    them, after steps and short verifies. A forward after a much larger one runs slow for a while: on
    the 2-core Xeon a step timed right after a 17-token forward took 4.0-4.3 ms where the loop's take
    3.1-3.3, and a curve timed smallest first put a 5-token verify at 1.2-1.3x a step where one timed
    without the large sizes put it at 1.35-1.6x (largest first: 1.4-1.5x)."""
    prefix = torch.randint(0, lm.vocab_size, (context,), device=lm.device)
    ids = {n: torch.randint(0, lm.vocab_size, (n,), device=lm.device) for n in sizes}
    step = torch.randint(0, lm.vocab_size, (1,), device=lm.device)
    times: dict[int, list[float]] = {n: [] for n in sizes}

    def forward(tokens: torch.Tensor) -> float:
        t0 = time.perf_counter()
        lm.forward(tokens)
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        seconds = time.perf_counter() - t0
        lm.rollback(context)
        return seconds

    lm.reset()
    lm.forward(prefix, last_only=True)
    for r in range(repeats + 1):                # the first round warms up
        for n in sorted(sizes, reverse=True):
            forward(step)
            seconds = forward(ids[n])
            if r:
                times[n].append(seconds)
    lm.reset()
    return {n: statistics.median(t) * 1000 for n, t in times.items()}


class VerifyCosts:
    """What verifying n tokens costs, relative or in ms: the curve measured at load (verify_cost_curve),
    a prior of +5% per extra token before; shared by the drafters of an engine, filled at warm-up.

    The decoding loop then tells it what each round's verify took (`observe`), and the curve follows:
    a one-token step by a running mean, a longer verify by its running ratio to that step. Ratios, so
    that a size seen rarely is not judged against the machine's speed of minutes ago (our machines'
    speed swings by a third from minute to minute, and a curve timed at load in a slow spell read a
    2-token verify at 1.54x a step where the loop measured 1.29x). A pinned curve (DYNCHAT_VERIFY_MS,
    `learn=False`) stays as given, so cost-weighed choices repeat from run to run."""

    WEIGHT = 0.05          # of each new observation in its running mean (~20 rounds of memory)
    MAX_TOKENS = 32        # larger verifies are extrapolated, not learned

    def __init__(self, curve: dict[int, float] | None = None, learn: bool = True):
        self.learn = learn
        self.curve = dict(curve or {1: 1.0, 2: 1.05, 5: 1.2, 9: 1.4})

    @property
    def curve(self) -> dict[int, float]:
        return {n: self._step * r for n, r in self._ratio.items()}

    @curve.setter
    def curve(self, curve: dict[int, float]) -> None:
        self._step = float(curve[min(curve)])
        self._ratio = {int(n): float(ms) / self._step for n, ms in curve.items()}
        if 1 not in self._ratio:
            self._ratio[1] = self._ratio[min(self._ratio)]
        self._xs = sorted(self._ratio)
        self._settle()

    def _settle(self) -> None:
        """The ratios ms() reads: the learned ones made non-decreasing in n, as a verify of more tokens never
        costs less. Each size is learned on its own, a rarely seen one from few, noisy rounds: an 11-token
        ratio learned below the 9-token one, extrapolated, priced a 16-token verify at a third of a step
        (in a process that had not timed the curve at load): a long draft looks free at such a price."""
        top, self._env = 0.0, {}
        for n in self._xs:
            top = max(top, self._ratio[n])
            self._env[n] = top

    def observe(self, n: int, seconds: float) -> None:
        """A verify of n tokens took this long."""
        if not self.learn or n > self.MAX_TOKENS or seconds <= 0:
            return
        ms, w = seconds * 1000, self.WEIGHT
        if n == 1:
            self._step += w * (ms - self._step)
            return
        if n not in self._ratio:
            self._ratio[n] = self.ms(n) / self._step
            self._xs = sorted(self._ratio)
        self._ratio[n] += w * (ms / self._step - self._ratio[n])
        self._settle()

    def ms(self, n: int) -> float:
        xs, r = self._xs, self._env
        if n <= xs[0]:
            return self._step * r[xs[0]]
        for a, b in zip(xs, xs[1:]):
            if n <= b:
                return self._step * (r[a] + (r[b] - r[a]) * (n - a) / (b - a))
        a, b = xs[-2:] if len(xs) > 1 else (xs[0], xs[0])
        slope = (r[b] - r[a]) / (b - a) if b != a else 0.0
        return self._step * (r[b] + slope * (n - b))

"""One chat turn, end to end: prompt from history, streamed generation, baseline comparison, log.

Sits between the UI (which knows nothing of KV caches) and the engine (which knows nothing of
Gradio or SQL). Yields TurnUpdate snapshots the UI renders as it likes.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from ..engine.decoder import PromptTooLong
from ..engine.events import RoundEvent, Summary
from ..engine.policies import DEFAULT_POLICY, POLICIES
from ..engine.sampling import SamplingParams
from ..engines import open_engine
from ..presets.config import MODES, ConfigError, Preset, load_presets
from ..presets.loading import ModelLoadError
from ..presets.runtime import Engine
from ..presets.threads import set_cpu_threads
from ..vllm.server import VllmUnavailable, stop_started
from .metrics import METRIC_NAMES, SUMMARY_METRICS
from .reply_text import ReplyText
from .store import Store
from .streaming import ENGINE_THREAD, ProcessLocalPool, StopFlag, in_background
from .worker import RemoteEngine, WorkerCrashed


class LRUDict(collections.OrderedDict):
    """Per-chat state for a server that runs for months: at most `maxsize` entries, the least recently
    used dropped first (and handed to `on_evict`, which may clean up after it)."""

    def __init__(self, maxsize: int, on_evict=None):
        super().__init__()
        self.maxsize, self.on_evict = maxsize, on_evict
        self._lock = threading.Lock()

    def __getitem__(self, key):
        with self._lock:
            value = super().__getitem__(key)
            self.move_to_end(key)
            return value

    def __setitem__(self, key, value):
        with self._lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            while len(self) > self.maxsize:
                _, old = self.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(old)


MAX_CHATS_KEPT = int(os.environ.get("DYNCHAT_MAX_CHATS", "2000"))   # chats whose policies and stop flags are kept
MAX_MESSAGE_CHARS = 4000
MAX_NEW_TOKENS_LIMIT = 1024
# engines that batch requests themselves (vLLM) stream each turn from its own thread
CONCURRENT_STREAMS = ProcessLocalPool(32, "dynchat-stream")
ENGINE_GONE = (WorkerCrashed, VllmUnavailable)      # the engine's process died: started again by the next turn


class LoadMeter:
    """Chats generating right now and the tokens/s they make together (all presets), for the metrics line."""

    def __init__(self, window_s: float = 3.0):
        self.window_s, self.active, self.peak = window_s, 0, 0
        self._events: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def started(self) -> None:
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)

    def finished(self) -> None:
        with self._lock:
            self.active -= 1

    def add(self, tokens: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), tokens))

    def tokens_per_s(self) -> float:
        """Tokens committed by all chats over the last window_s seconds, per second."""
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            if not self._events:
                return 0.0
            span = max(now - self._events[0][0], 0.5)
            return sum(n for _, n in self._events) / span


def describe_policy(engine, mode: str, policy) -> str | None:
    """How the drafts of a turn were sized: the lookahead policy, or the EAGLE-3 tree's shape."""
    if mode == "eagle3" and engine.tree is not None:
        t = engine.tree
        return f"tree(top_k={t.top_k}, depth={t.depth}, tokens={t.total_tokens})"
    return policy.describe() if policy else None


def store_problem(e: Exception) -> str:
    text = str(getattr(e, "orig", e)).lower()
    if "full" in text:
        return "the database or disk is full"
    if "locked" in text or "busy" in text:
        return "the database is busy"
    return f"database error: {type(getattr(e, 'orig', e)).__name__}"


def on_zero_gpu() -> bool:
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


ZERO_GPU = on_zero_gpu()


def engine_process_default() -> bool:
    flag = os.environ.get("DYNCHAT_ENGINE_PROCESS", "").strip()
    if flag:
        return flag not in ("0", "false", "no", "off")
    # ZeroGPU lends a GPU only inside functions it runs in its own forked processes: keep models in-process there
    return not on_zero_gpu()


class TurnError(ValueError):
    """Bad input for a turn: shown to the user as is."""


@dataclass
class Settings:
    preset: str
    mode: str = "assistant"
    policy: str = DEFAULT_POLICY
    max_new_tokens: int = 96
    temperature: float = 0.0
    top_p: float = 1.0
    compare: bool = True
    seed: int | None = None

    def validate(self, engine: Engine) -> None:
        if self.mode not in MODES:
            raise TurnError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode not in engine.modes:
            raise TurnError(f"mode {self.mode!r} is not available for preset {self.preset!r} "
                            f"(available: {', '.join(engine.modes)})")
        if self.policy not in POLICIES:
            raise TurnError(f"unknown lookahead policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise TurnError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {self.max_new_tokens}")
        try:
            SamplingParams(float(self.temperature), float(self.top_p))
        except (TypeError, ValueError) as e:
            raise TurnError(str(e)) from None
        if self.temperature > 5:
            raise TurnError(f"temperature must be between 0 and 5, got {self.temperature}")


@dataclass
class TurnUpdate:
    reply: str = ""
    segments: list[tuple[str, str]] = field(default_factory=list)   # (text, "draft" | "target")
    metrics: dict = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    status: str = "streaming"          # queued | streaming | baseline | ok | cancelled | error
    notice: str = ""

    def snapshot(self) -> TurnUpdate:
        return TurnUpdate(self.reply, list(self.segments), dict(self.metrics), list(self.rounds), self.status, self.notice)


def clean_text(text: str) -> str:
    """Drop control characters (but newlines and tabs) and unpaired surrogates."""
    text = text.encode("utf-8", "replace").decode("utf-8")   # lone surrogates -> '?'
    return "".join(ch for ch in text if ch in "\n\t" or ch.isprintable() or ch == " ")


def history_messages(history: list) -> list[dict]:
    """Gradio messages (content as str or a list of text blocks) -> plain role/content dicts."""
    out = []
    for m in history or []:
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            continue
        if (m.get("metadata") or {}).get("title"):     # notices, not conversation
            continue
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(b.get("text", "") for b in c if isinstance(b, dict))
        if isinstance(c, str):
            out.append({"role": m["role"], "content": c})
    return out


class ChatService:
    def __init__(self, store: Store, models_path=None, engine_process: bool | None = None,
                 warm_in_call: bool | None = None):
        """engine_process: each preset's models in their own worker process (worker.py); default:
        DYNCHAT_ENGINE_PROCESS (1/0), else on except on ZeroGPU Spaces (SPACES_ZERO_GPU=true)."""
        self.store = store
        self.models_path = models_path
        self.presets, self.default_preset = load_presets(models_path)
        self.engines: dict[str, Engine] = {}
        self.policies: LRUDict = LRUDict(MAX_CHATS_KEPT)        # (chat, preset, mode, policy) -> its learned state
        self.stops: LRUDict = LRUDict(MAX_CHATS_KEPT)           # chat -> its Stop flag
        self._load_lock = threading.Lock()
        # seconds between UI updates while streaming (rounds are batched); DYNCHAT_STREAM_INTERVAL overrides
        self.stream_interval = float(os.environ.get("DYNCHAT_STREAM_INTERVAL", "0.1"))
        self.engine_process = engine_process_default() if engine_process is None else engine_process
        # ZeroGPU: weights load in the app's process (where ZeroGPU moves them to its GPU), but what is
        # built from them (fused weights, decoders, the measured verify costs) is built in each GPU call's
        # forked process, which is where the GPU is: warm-up runs once per process, in the call
        self.warm_in_call = on_zero_gpu() if warm_in_call is None else warm_in_call
        self._warmed: dict[str, int] = {}      # preset -> pid of the process that warmed it
        self.load = LoadMeter()
        if not self.engine_process:
            set_cpu_threads(serving=True)

    # -- models ----------------------------------------------------------------------------
    def preset(self, name: str) -> Preset:
        if name not in self.presets:
            raise TurnError(f"no such preset {name!r} (have: {', '.join(self.presets)})")
        return self.presets[name]

    def engine(self, name: str) -> Engine:
        """Load (once) and return a preset's models; errors come back as one clear line."""
        preset = self.preset(name)
        with self._load_lock:
            if name not in self.engines:
                if preset.engine != "vllm" and self.engine_process:
                    engine = RemoteEngine(preset)      # loads and warms up in the worker
                else:
                    engine = open_engine(preset)
                    try:
                        if preset.engine == "vllm":
                            engine.warm_up()
                        elif not self.warm_in_call:
                            ENGINE_THREAD.submit(engine.warm_up).result()
                            self._warmed[name] = os.getpid()
                    except BaseException as e:
                        if preset.engine == "vllm":
                            engine.close()         # no servers left running for an engine nobody holds
                        if isinstance(e, VllmUnavailable):
                            raise ModelLoadError(str(e)) from None
                        raise
                self.engines[name] = engine
                self._recall_replies(self.engines[name])
            return self.engines[name]

    def close(self) -> None:
        """Stop every engine process and vLLM server this service started (the app is ending)."""
        for engine in list(self.engines.values()):
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        stop_started()          # servers of a preset still starting

    def _recall_replies(self, engine) -> None:
        """The target's logged replies join its lookup index (the session log is its source)."""
        if "lookup" not in engine.modes:
            return
        try:
            texts = self.store.replies(engine.preset.target)
        except SQLAlchemyError:
            return                       # an unreadable log: lookup drafts from the shipped replies only
        if texts:
            engine.remember_texts(texts)

    def stop(self, session_id: str) -> None:
        if session_id not in self.stops:         # its reply runs elsewhere (a forked GPU call), or not at all
            self.stops[session_id] = StopFlag(session_id)
        self.stops[session_id].set()

    # -- a turn ----------------------------------------------------------------------------
    def build_prompt(self, engine: Engine, history: list[dict], message: str, max_new_tokens: int) -> tuple[list[int], str]:
        """Chat-template ids; drops the oldest exchanges when the context would overflow."""
        room = engine.context_length - min(max_new_tokens, 64)
        msgs = history + [{"role": "user", "content": message}]
        dropped = 0
        while True:
            ids = engine.encode(msgs)
            if len(ids) <= room:
                break
            if len(msgs) <= 1:
                raise TurnError(f"the message is too long for this model: {len(ids)} tokens, the context "
                                f"window allows about {room} with room for a reply")
            msgs = msgs[2:] if len(msgs) > 2 else msgs[1:]
            dropped += 1
        notice = f"{dropped} oldest exchange(s) dropped to fit the context window" if dropped else ""
        return ids, notice

    def turn(self, session_id: str, history: list, message: str, settings: Settings):
        """Generator of TurnUpdate; the last one has status ok, cancelled or error."""
        message = clean_text(message or "")
        if not message.strip():
            raise TurnError("the message is empty")
        if len(message) > MAX_MESSAGE_CHARS:
            raise TurnError(f"the message is {len(message)} characters long; the limit is {MAX_MESSAGE_CHARS}")
        try:
            engine = self.engine(settings.preset)
        except (ModelLoadError, ConfigError, *ENGINE_GONE) as e:
            raise TurnError(str(e)) from None
        settings.validate(engine)
        if self.warm_in_call and self._warmed.get(settings.preset) != os.getpid():
            ENGINE_THREAD.submit(engine.warm_up).result()       # in this (forked) process, once
            self._warmed[settings.preset] = os.getpid()
        ids, notice = self.build_prompt(engine, history_messages(history), message, settings.max_new_tokens)
        stop = self.stops[session_id] = StopFlag(session_id)
        policy = None
        if settings.mode != "baseline":
            key = (session_id, settings.preset, settings.mode, settings.policy)
            if key not in self.policies:
                self.policies[key] = engine.policy(settings.mode, settings.policy)
            policy = self.policies[key]
        sampling = SamplingParams(float(settings.temperature), float(settings.top_p), 0, settings.seed)
        try:
            turn_id = self.store.start_turn(
                session_id, message, preset=settings.preset, target=engine.preset.target, weights=engine.weights,
                assistant={"assistant": engine.preset.assistant, "eagle3": engine.preset.eagle3}.get(settings.mode),
                mode=settings.mode, policy=describe_policy(engine, settings.mode, policy),
                max_new_tokens=settings.max_new_tokens, temperature=float(settings.temperature),
                top_p=float(settings.top_p), prompt_tokens=len(ids))
        except SQLAlchemyError as e:
            raise TurnError(f"the session log cannot be written ({store_problem(e)}), so nothing was generated; "
                            "please try again later") from None
        update = TurnUpdate(notice=notice)
        update.metrics["weights"] = engine.weights
        reply = ReplyText(engine.decode)
        logged = False

        def log(status: str, error: str | None = None) -> None:
            nonlocal logged
            logged = True
            m = update.metrics
            try:
                self._finish(turn_id, status, update, reply.ids, m, error)
            except SQLAlchemyError as e:
                update.notice = " ".join(filter(None, [update.notice, f"this turn could not be logged ({store_problem(e)})"]))

        try:
            if not engine.lock.acquire(blocking=False):      # an engine that serves one chat at a time is busy
                update.status = "queued"
                yield update.snapshot()
                engine.lock.acquire()
            try:
                update.status = "streaming"
                yield from self._generate(engine, settings, ids, sampling, policy, stop, update, reply, session_id)
                if update.status == "ok" and "lookup" in engine.modes:
                    engine.remember([list(reply.ids)])       # later turns may draft from this reply
            finally:
                engine.lock.release()
            log(update.status)                  # logged before the last update, so the CSV made from it is complete
            yield update.snapshot()
        except Exception as e:  # noqa: BLE001 - logged with its status; the UI shows one line
            if isinstance(e, ENGINE_GONE):         # started again by the next turn
                with self._load_lock:
                    gone = self.engines.pop(settings.preset, None)
                with contextlib.suppress(Exception):
                    gone.close()
            update.status, update.notice = "error", self._error_message(e)
            if not logged:
                log("error", f"{type(e).__name__}: {str(e)[:300]}")
            yield update.snapshot()
        finally:
            if not logged:                      # the generator was closed mid-turn (UI cancel)
                log("cancelled")

    def _finish(self, turn_id, status, update, ids_out, m, error) -> None:
        """Write the finished turn and its rounds."""
        self.store.finish_turn(turn_id, status, rounds=update.rounds, reply=update.reply, error=error,
                               **{name: m.get(name) for name in METRIC_NAMES} | {"new_tokens": len(ids_out)})

    def _generate(self, engine, settings, ids, sampling, policy, stop, update, reply, session_id):
        """The reply, streamed round by round, then the baseline on the same prompt and budget; both on
        the conversation's own kept cache (its earlier turns are not prefilled again)."""
        summary, live = None, Summary()           # live: the rounds so far, for the streamed metrics
        pool = CONCURRENT_STREAMS if getattr(engine, "serves_concurrently", False) else ENGINE_THREAD
        events = engine.decoder(settings.mode).generate(ids, settings.max_new_tokens, sampling, policy, stop,
                                                        session=session_id)
        self.load.started()
        try:
            with contextlib.closing(in_background(events, stop, self.stream_interval, pool)) as batches:
                for batch in batches:
                    for ev in batch:
                        if isinstance(ev, Summary):
                            summary = ev
                        else:
                            self._apply_round(update, reply, ev, live)
                            self.load.add(len(ev.token_ids))
                    update.metrics["chats_now"] = self.load.active
                    update.metrics["all_chats_tokens_per_s"] = self.load.tokens_per_s()
                    if summary is None:
                        yield update.snapshot()
        finally:
            self.load.finished()
        update.reply, update.segments = reply.finish(), reply.segments
        update.status = "cancelled" if summary.finish_reason == "stopped" else "ok"
        update.metrics.update(self._summary_metrics(summary))
        if policy is None:
            update.metrics["acceptance_rate"] = None      # nothing was drafted
            update.metrics["baseline_tokens_per_s"] = summary.tokens_per_s
            update.metrics["speedup"] = 1.0
        elif settings.compare and update.status == "ok" and "baseline" not in engine.modes:
            update.notice = " ".join(filter(None, [update.notice, "no plain baseline to compare with on this preset"]))
        elif settings.compare and update.status == "ok":
            update.status = "baseline"
            yield update.snapshot()
            update.status = "ok"
            base = None
            # the baseline prefills what the reply prefilled (the shared cache now holds this very prompt)
            events = engine.decoder("baseline").generate(ids, settings.max_new_tokens, sampling, None, stop,
                                                         max_reuse=summary.reused_tokens, session=session_id)
            with contextlib.closing(in_background(events, stop, pool=pool)) as batches:   # same thread, same conditions
                for batch in batches:
                    base = next((ev for ev in batch if isinstance(ev, Summary)), base)
            if base is not None and base.finish_reason != "stopped" and base.tokens_per_s:
                update.metrics["baseline_tokens_per_s"] = base.tokens_per_s
                update.metrics["speedup"] = summary.tokens_per_s / base.tokens_per_s

    @staticmethod
    def _error_message(e: Exception) -> str:
        if isinstance(e, PromptTooLong):
            return str(e)
        if isinstance(e, ENGINE_GONE):
            return f"{e}; it starts again with the next message"
        if type(e).__name__ == "VllmRequestError":
            return f"vLLM refused the request: {e}"
        if "out of memory" in str(e).lower():
            return "the device ran out of memory during generation; try fewer new tokens or a smaller preset"
        return f"generation failed: {type(e).__name__}"

    @staticmethod
    def _summary_metrics(s: Summary) -> dict:
        st = s.stats()
        m = {k: st[k] for k in (*SUMMARY_METRICS, "per_position_acceptance")}
        if s.shared:
            m["acceptance_shared"] = True
        return m

    def _apply_round(self, update: TurnUpdate, reply: ReplyText, ev: RoundEvent, live: Summary) -> None:
        """Append a round: reply text, draft/target segments, live metrics."""
        reply.add(ev.token_ids, sum(ev.from_draft))
        update.reply, update.segments = reply.text, reply.segments
        update.rounds.append({"lookahead": ev.lookahead, "drafted": ev.drafted, "accepted": ev.accepted,
                              "new_tokens": len(ev.token_ids), "draft_s": ev.draft_s, "verify_s": ev.verify_s})
        live.record_round(ev.drafted, ev.accepted, depth=0)
        m = update.metrics
        if len(update.rounds) == 1:
            m["ttft_s"] = ev.elapsed_s
        m.update({"new_tokens": len(reply.ids), "tokens_per_s": len(reply.ids) / ev.elapsed_s if ev.elapsed_s else 0.0,
                  "acceptance_rate": live.acceptance_rate if live.draft_tokens else None,
                  "mean_accepted_length": live.mean_accepted_length,
                  "lookahead": ev.drafted})

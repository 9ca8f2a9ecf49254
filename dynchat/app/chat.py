"""One chat turn, end to end: prompt from history, streamed generation, baseline comparison, log.

Sits between the UI (which knows nothing of KV caches) and the engine (which knows nothing of
Gradio or SQL). Yields TurnUpdate snapshots the UI renders as it likes. The engines it runs on
live in engines.py; a turn's settings and checks in turns.py; bounded per-chat state in state.py.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os

from sqlalchemy.exc import SQLAlchemyError

from ..engine.decoder import PromptTooLong
from ..engine.events import RoundEvent, Summary
from ..engine.kv_cache import common_prefix
from ..engine.sampling import SamplingParams
from ..presets.config import ConfigError, Preset
from ..presets.loading import ModelLoadError
from ..presets.runtime import Engine
from .engines import ENGINE_GONE, ZERO_GPU, EngineRegistry
from .metrics import METRIC_NAMES, ROUND_FIELDS, SUMMARY_METRICS
from .reply_text import ReplyText
from .state import MAX_CHATS_KEPT, LoadMeter, LRUDict
from .store import Store
from .streaming import ENGINE_THREAD, ProcessLocalPool, StopFlag, in_background
from .turns import (
    MAX_MESSAGE_CHARS,
    Settings,
    TurnError,
    TurnUpdate,
    clean_text,
    history_messages,
    with_reply_ids,
)

# engines that batch requests themselves (vLLM) stream each turn from its own thread
CONCURRENT_STREAMS = ProcessLocalPool(32, "dynchat-stream")
logger = logging.getLogger(__name__)


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


class ChatService:
    def __init__(self, store: Store, models_path=None, engine_process: bool | None = None,
                 warm_in_call: bool | None = None):
        """engine_process, warm_in_call: where the engines run and warm up (engines.EngineRegistry)."""
        self.store = store
        self.registry = EngineRegistry(store, models_path, engine_process, warm_in_call)
        self.policies: LRUDict = LRUDict(MAX_CHATS_KEPT)        # (chat, preset, mode, policy) -> its learned state
        # (preset, mode, policy) -> a copy of the state the last finished turn left: where a new chat starts
        self.learned: dict[tuple, object] = {}
        self.stops: LRUDict = LRUDict(MAX_CHATS_KEPT)           # chat -> its Stop flag
        # (chat, preset) -> (the last prompt's ids, its reply's ids, the reply's text): the next prompt
        # keeps the ids the model wrote, which the chat's kept cache holds (turns.with_reply_ids)
        self.replies: LRUDict = LRUDict(MAX_CHATS_KEPT)
        # seconds between UI updates while streaming (rounds are batched); DYNCHAT_STREAM_INTERVAL overrides
        self.stream_interval = float(os.environ.get("DYNCHAT_STREAM_INTERVAL", "0.1"))
        self.load = LoadMeter()

    @property
    def presets(self) -> dict[str, Preset]:
        return self.registry.presets

    @property
    def default_preset(self) -> str:
        return self.registry.default_preset

    @property
    def engines(self) -> dict[str, Engine]:
        return self.registry.engines

    def preset(self, name: str) -> Preset:
        return self.registry.preset(name)

    def engine(self, name: str) -> Engine:
        return self.registry.engine(name)

    def close(self) -> None:
        self.registry.close()

    def stop(self, session_id: str) -> None:
        if session_id not in self.stops:         # its reply runs elsewhere (a forked GPU call), or not at all
            self.stops[session_id] = StopFlag(session_id)
        self.stops[session_id].set()

    # -- a turn ----------------------------------------------------------------------------
    def build_prompt(self, engine: Engine, history: list[dict], message: str, max_new_tokens: int,
                     last: tuple | None = None) -> tuple[list[int], str]:
        """Chat-template ids; drops the oldest exchanges when the context would overflow; the last reply
        in the ids the model wrote it in (last: see turns.with_reply_ids)."""
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
        return with_reply_ids(engine.decode, msgs, ids, last), notice

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
        self.registry.warm_here(settings.preset, engine)
        ids, notice = self.build_prompt(engine, history_messages(history), message, settings.max_new_tokens,
                                        self.replies.get((session_id, settings.preset)))
        stop = self.stops[session_id] = StopFlag(session_id)
        policy, learned_key = None, (settings.preset, settings.mode, settings.policy)
        if settings.mode != "baseline":
            key = (session_id, *learned_key)
            if key not in self.policies:
                self.policies[key] = self._new_policy(engine, settings, learned_key)
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
        reply_status = None           # "ok" or "cancelled" once the reply itself has ended (the baseline may follow)

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
                pool = CONCURRENT_STREAMS if getattr(engine, "serves_concurrently", False) else ENGINE_THREAD
                summary = yield from self._stream_reply(engine, settings, ids, sampling, policy, stop, update, reply,
                                                        session_id, pool)
                # the reply is whole: what later turns build on is kept before the baseline runs, so a Stop
                # or a closed page during the comparison loses none of it
                reply_status = update.status
                if policy is not None:
                    self.learned[learned_key] = copy.deepcopy(policy)     # no turn of this chat runs now
                reply_ids = list(reply.ids)
                if update.status == "ok" and "lookup" in engine.modes:
                    engine.remember([reply_ids])             # later turns may draft from this reply
                self.replies[(session_id, settings.preset)] = (list(ids), reply_ids, update.reply)
                yield from self._compare(engine, settings, ids, sampling, policy, stop, update, reply, summary,
                                         session_id, pool)
                if reply_status == "ok" and not stop.is_set():
                    self._prepare_next_turn(engine, history, message, (list(ids), reply_ids, update.reply), session_id,
                                            pool)
            finally:
                engine.lock.release()
            log(update.status)                  # logged before the last update, so the CSV made from it is complete
            yield update.snapshot()
        except Exception as e:  # noqa: BLE001 - logged with its status; the UI shows one line
            if isinstance(e, ENGINE_GONE):         # started again by the next turn
                self.registry.drop(settings.preset)
            update.status, update.notice = "error", self._error_message(e)
            if not logged:
                log("error", f"{type(e).__name__}: {str(e)[:300]}")
            yield update.snapshot()
        finally:
            if not logged:                      # the generator was closed mid-turn (UI cancel)
                log(reply_status or "cancelled")      # during the baseline: the reply is whole, only the figure is missing

    def _prepare_next_turn(self, engine, history: list, message: str, last: tuple, session_id: str, pool) -> None:
        """The conversation's kept cache computes what its next prompt begins with whatever the message (the
        reply's end and the template's start of a user turn: what two different messages' prompts share),
        so the next turn prefills only its message, as a new chat's first turn does. A worker gets it as
        a message and computes it while the reply is read; an engine in this process computes it now, on
        the engine's thread (~6 rows). Never fails the turn: it only saves the next one time.
        last: (prompt, reply ids, reply text)."""
        prepare = getattr(engine, "prepare_turn", None)
        if prepare is None or ZERO_GPU or self.registry.warm_in_call:   # vLLM; ZeroGPU: each call a forked process
            return
        try:
            msgs = history_messages(history) + [{"role": "user", "content": message},
                                                {"role": "assistant", "content": last[2]}]
            probe_a = msgs + [{"role": "user", "content": "A"}]
            a = engine.encode(probe_a)
            if len(a) > engine.context_length:        # the next turn drops the oldest exchanges: nothing to keep
                return
            shared = common_prefix(a, engine.encode(msgs + [{"role": "user", "content": "B"}]), len(a))
            own = with_reply_ids(engine.decode, probe_a, a, last)
            start = own[:shared + len(own) - len(a)]   # the reply, before `shared`, in the ids the model wrote
            pool.submit(prepare, session_id, start).result()
        except Exception:  # noqa: BLE001 - the next turn prefills those rows itself
            logger.exception("preparing the next turn failed")

    def _new_policy(self, engine: Engine, settings: Settings, learned_key: tuple):
        """A new chat's lookahead policy: what earlier chats on this preset, mode and policy learned (the
        draft's calibrated acceptance, the measured draft and verify costs, whether drafting paid), so a
        newcomer's first replies are sized as a long session's are; a fresh one before any turn ended.
        The throughput policy's measured gates need a few hundred rounds, more than most chats have."""
        learned = self.learned.get(learned_key)
        return copy.deepcopy(learned) if learned is not None else engine.policy(settings.mode, settings.policy)

    def _finish(self, turn_id, status, update, ids_out, m, error) -> None:
        """Write the finished turn and its rounds."""
        self.store.finish_turn(turn_id, status, rounds=update.rounds, reply=update.reply, error=error,
                               **{name: m.get(name) for name in METRIC_NAMES} | {"new_tokens": len(ids_out)})

    def _stream_reply(self, engine, settings, ids, sampling, policy, stop, update, reply, session_id, pool):
        """The reply, streamed round by round, on the conversation's own kept cache (its earlier turns are
        not prefilled again); returns its Summary."""
        summary, live = None, Summary()           # live: the rounds so far, for the streamed metrics
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
        return summary

    def _compare(self, engine, settings, ids, sampling, policy, stop, update, reply, summary, session_id, pool):
        """Plain decoding on the same prompt and budget after the reply, on the same kept cache."""
        if policy is None:
            return
        if settings.compare and update.status == "ok" and "baseline" not in engine.modes:
            update.notice = " ".join(filter(None, [update.notice, "no plain baseline to compare with on this preset"]))
        elif settings.compare and update.status == "ok":
            update.status = "baseline"
            yield update.snapshot()
            base, base_text = None, ReplyText(engine.decode)
            # the baseline prefills what the reply prefilled (the shared cache now holds this very prompt)
            events = engine.decoder("baseline").generate(ids, settings.max_new_tokens, sampling, None, stop,
                                                         max_reuse=summary.reused_tokens, session=session_id)
            # same thread, and streamed to the page as the reply was: a browser on the same machine renders
            # while the reply streams, so a baseline run unseen would be measured with a core more to itself
            with contextlib.closing(in_background(events, stop, self.stream_interval, pool)) as batches:
                for batch in batches:
                    for ev in batch:
                        if isinstance(ev, Summary):
                            base = ev
                        else:
                            base_text.add(ev.token_ids, 0)
                    update.baseline_reply = base_text.text
                    if base is None:
                        yield update.snapshot()
            update.status = "ok"
            if base is not None and base.finish_reason != "stopped" and base.tokens_per_s:
                update.baseline_reply = base_text.finish()
                update.metrics["baseline_tokens_per_s"] = base.tokens_per_s
                update.metrics["speedup"] = summary.tokens_per_s / base.tokens_per_s
                if sampling.greedy:          # lossless: greedy speculation writes plain decoding's tokens
                    base_ids, ids_out = base_text.ids, reply.ids
                    shared = common_prefix(base_ids, ids_out, max(len(base_ids), len(ids_out)))
                    update.metrics["same_tokens_as_baseline"] = shared == len(base_ids) == len(ids_out)
                    if not update.metrics["same_tokens_as_baseline"]:   # a near-tie rounded another way
                        update.metrics["baseline_parts_at"] = shared     # (reduced precision, another server)

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
        update.rounds.append({name: getattr(ev, name) for name in ROUND_FIELDS})
        live.record_round(ev.drafted, ev.accepted, depth=0)
        m = update.metrics
        if len(update.rounds) == 1:
            m["ttft_s"] = ev.elapsed_s
        m.update({"new_tokens": len(reply.ids), "tokens_per_s": len(reply.ids) / ev.elapsed_s if ev.elapsed_s else 0.0,
                  "acceptance_rate": live.acceptance_rate if live.draft_tokens else None,
                  "mean_accepted_length": live.mean_accepted_length,
                  "lookahead": ev.drafted})

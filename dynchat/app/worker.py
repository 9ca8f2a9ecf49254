"""A preset's engine in its own process, for the app.

Why: a decoding step dispatches a few hundred small torch ops, and each op lets go of the GIL and
takes it back. In the app's process Gradio's threads hold the GIL for their own Python work
(requests, queue, streaming, JSON), so each take-back can wait a switch interval (5 ms), and an
in-process engine makes a share of its tokens/s only. vLLM's V1 engine core runs in its own
process for the same reason. Here the app keeps only the tokenizer (prompts are built and replies
decoded in the app); requests go to the worker over a socket pair, RoundEvents and the Summary
come back, and a "stop" message ends a generation at the next round.

The worker is a plain `python -m dynchat.app.worker FD` subprocess (not multiprocessing's spawn, which
would re-run app.py's top level), and exits when the app's end of the socket closes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from ..engine.sampling import SamplingParams
from ..presets.config import Preset
from ..presets.loading import ModelLoadError, load_tokenizer, local_source
from ..presets.runtime import TokenizedPreset

log = logging.getLogger(__name__)


class WorkerCrashed(RuntimeError):
    pass


def _portable(e: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - anything unpicklable is described instead
        return RuntimeError(f"{type(e).__name__}: {e}")


def _heap_trimmer():
    """glibc's malloc_trim, or a no-op where the C library has none.

    Why: a generation allocates and frees tensors of shapes that vary with each conversation, and
    glibc keeps the freed pages in the heap; over hundreds of chats the worker's heap held ~80 MB
    more than it used (the soak test's 1,000 chats), flat with a trim after each generation."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class _StopMessage:
    """threading.Event's is_set() for the decoder, fed by a "stop" message from the app."""

    def __init__(self, conn: Connection):
        self.conn, self.flag = conn, False

    def is_set(self) -> bool:
        while not self.flag and self.conn.poll():
            self.flag = self.conn.recv() == "stop"
        return self.flag


def serve(conn: Connection) -> None:
    """The worker's loop: load, then one generation per request until the app goes away."""
    from ..presets.loading import load_engine
    from ..presets.threads import set_cpu_threads

    set_cpu_threads(serving=True)
    trim_heap = _heap_trimmer()
    try:
        preset = conn.recv()
        engine = load_engine(preset)
        engine.warm_up()
    except EOFError:
        return
    except Exception as e:  # noqa: BLE001 - reported to the app as one line
        conn.send(("error", _portable(e if isinstance(e, ModelLoadError) else ModelLoadError(str(e)))))
        return
    conn.send(("ready", {"modes": engine.modes, "context_length": engine.context_length, "weights": engine.weights,
                         "verify_ms": engine.verify_ms}))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request == "stop":            # arrived after its generation had ended
            continue
        if request[0] in ("remember", "remember_texts"):     # replies lookup may draft from
            getattr(engine, request[0])(request[1])
            continue
        if request[0] == "prepare_turn":                      # the next turn's start, while the reader reads
            try:
                engine.prepare_turn(*request[1])
            except Exception:  # noqa: BLE001 - only time is lost: the next turn prefills those rows itself
                log.exception("preparing the next turn failed")
            continue
        mode, ids, max_new_tokens, sampling, policy, max_reuse, session = request
        try:
            for event in engine.decoder(mode).generate(ids, max_new_tokens, sampling, policy, _StopMessage(conn),
                                                       max_reuse, session):
                conn.send(("event", event))
            conn.send(("done", policy))   # the policy learns across turns: its new state goes back
            trim_heap()                   # after the reply has gone: the app is not kept waiting
        except (BrokenPipeError, EOFError, ConnectionResetError):
            return
        except Exception as e:  # noqa: BLE001 - raised again in the app
            conn.send(("error", _portable(e)))


class RemoteEngine(TokenizedPreset):
    """What ChatService needs of an Engine (modes, tree, encode/decode, lock, decoder(mode)), served by a worker."""

    def __init__(self, preset: Preset):
        self.preset = preset
        self.lock = threading.Lock()
        self.tokenizer = load_tokenizer("target", local_source("target", preset.target))
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "dynchat.app.worker", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=os.environ.copy())
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send(preset)
        kind, payload = self._receive()
        if kind == "error":
            self.close()
            raise payload
        self.modes, self.context_length, self.weights = payload["modes"], payload["context_length"], payload["weights"]
        self.verify_ms = payload["verify_ms"]

    def _gone(self) -> WorkerCrashed:
        return WorkerCrashed(f"the engine process for preset {self.preset.name!r} went away")

    def _send(self, message) -> None:
        try:
            self._conn.send(message)
        except OSError:
            raise self._gone() from None

    def _receive(self, timeout: float | None = None):
        while not self._conn.poll(1.0 if timeout is None else timeout):
            if self._proc.poll() is not None:
                raise WorkerCrashed(f"the engine process for preset {self.preset.name!r} exited "
                                    f"(code {self._proc.returncode})")
            if timeout is not None:
                return None
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._gone() from None

    def decoder(self, mode: str) -> RemoteDecoder:
        self.require_mode(mode)
        return RemoteDecoder(self, mode)

    def warm_up(self) -> None:
        """Done by the worker when it loads."""

    def remember(self, replies: list[list[int]]) -> None:
        self._send(("remember", replies))

    def remember_texts(self, texts: list[str]) -> None:
        self._send(("remember_texts", texts))

    def prepare_turn(self, session, ids: list[int]) -> None:
        self._send(("prepare_turn", (session, list(ids))))

    def close(self) -> None:
        self._conn.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


class RemoteDecoder:
    def __init__(self, engine: RemoteEngine, mode: str):
        self.engine, self.mode = engine, mode

    def generate(self, prompt_ids, max_new_tokens, sampling: SamplingParams = SamplingParams(), policy=None,
                 stop: threading.Event | None = None, max_reuse: int | None = None, session=None):
        """Decoder.generate through the worker: the same events, the same errors."""
        eng = self.engine
        eng._send((self.mode, list(prompt_ids), max_new_tokens, sampling, policy, max_reuse, session))
        stopped = finished = False
        try:
            while True:
                if stop is not None and stop.is_set() and not stopped:
                    eng._send("stop")
                    stopped = True
                message = eng._receive(timeout=0.02)
                if message is None:
                    continue
                kind, payload = message
                if kind == "event":
                    yield payload
                    continue
                finished = True
                if kind == "error":
                    raise payload
                if policy is not None:
                    policy.__dict__.update(payload.__dict__)
                return
        finally:
            if not finished:             # the consumer left early: end the generation, keep the stream in step
                if not stopped:
                    eng._send("stop")
                while (m := eng._receive()) and m[0] == "event":
                    pass


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))

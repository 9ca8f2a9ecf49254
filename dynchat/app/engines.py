"""The app's engines: each preset's models loaded once (in a worker process, in-process, or as vLLM
servers), warmed up where the generating process will use them, dropped when their process dies,
and closed with the app."""
from __future__ import annotations

import contextlib
import os
import threading

from sqlalchemy.exc import SQLAlchemyError

from ..engines import open_engine
from ..presets.config import Preset, load_presets
from ..presets.loading import ModelLoadError
from ..presets.runtime import Engine
from ..presets.threads import set_cpu_threads
from ..vllm.server import VllmUnavailable, stop_started
from .streaming import ENGINE_THREAD
from .turns import TurnError
from .worker import RemoteEngine, WorkerCrashed

ENGINE_GONE = (WorkerCrashed, VllmUnavailable)      # the engine's process died: started again by the next turn


def on_zero_gpu() -> bool:
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


ZERO_GPU = on_zero_gpu()


def engine_process_default() -> bool:
    flag = os.environ.get("DYNCHAT_ENGINE_PROCESS", "").strip()
    if flag:
        return flag not in ("0", "false", "no", "off")
    # ZeroGPU lends a GPU only inside functions it runs in its own forked processes: keep models in-process there
    return not on_zero_gpu()


class EngineRegistry:
    def __init__(self, store, models_path=None, engine_process: bool | None = None, warm_in_call: bool | None = None):
        """engine_process: each preset's models in their own worker process (worker.py); default:
        DYNCHAT_ENGINE_PROCESS (1/0), else on except on ZeroGPU Spaces (SPACES_ZERO_GPU=true).
        store: the session log, whose replies seed each engine's lookup index."""
        self.store = store
        self.presets, self.default_preset = load_presets(models_path)
        self.engines: dict[str, Engine] = {}
        self._load_lock = threading.Lock()
        self.engine_process = engine_process_default() if engine_process is None else engine_process
        # ZeroGPU: weights load in the app's process (where ZeroGPU moves them to its GPU), but what is
        # built from them (fused weights, decoders, the measured verify costs) is built in each GPU call's
        # forked process, which is where the GPU is: warm-up runs once per process, in the call
        self.warm_in_call = on_zero_gpu() if warm_in_call is None else warm_in_call
        self._warmed: dict[str, int] = {}      # preset -> pid of the process that warmed it
        if not self.engine_process:
            set_cpu_threads(serving=True)

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

    def warm_here(self, name: str, engine) -> None:
        """Warm a preset's engine up in this process once, when warm-up belongs in the GPU call."""
        if self.warm_in_call and self._warmed.get(name) != os.getpid():
            ENGINE_THREAD.submit(engine.warm_up).result()       # in this (forked) process, once
            self._warmed[name] = os.getpid()

    def drop(self, name: str) -> None:
        """Forget a preset's engine whose process died; the next turn starts it again."""
        with self._load_lock:
            gone = self.engines.pop(name, None)
        with contextlib.suppress(Exception):
            gone.close()

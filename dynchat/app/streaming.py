"""The one engine thread and streaming from it: model work off the UI's threads, events in batches."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import queue
import tempfile
import threading
import time
from pathlib import Path


class ProcessLocalPool:
    """A thread pool made on first use in each process. ZeroGPU runs every GPU call in a process
    forked from the app's; a pool inherited through a fork believes its threads exist (they did not
    survive the fork), so work submitted there would wait forever."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = workers, name
        self._pid, self._pool = None, None
        self._lock = threading.Lock()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        with self._lock:
            if self._pid != os.getpid():
                self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
                self._pid = os.getpid()
            return self._pool.submit(fn, *args, **kwargs)


# All model work runs on this one thread. OpenMP keeps a thread team per calling thread, and idle
# teams spin for a while after each parallel region: generating from ever-new threads (Gradio's
# pool, a worker per turn) leaves several teams fighting over the cores, and tokens/s drops.
ENGINE_THREAD = ProcessLocalPool(1, "dynchat-engine")
STOP_DIR = Path(tempfile.gettempdir()) / f"dynchat-stop-{os.getpid()}"     # the app's, shared by its forks


class StopFlag:
    """A chat's Stop, seen by whichever process generates its reply: an event in this process and a
    file under STOP_DIR (ZeroGPU generates in a child forked from the app, where Stop is pressed),
    checked once a round. A new flag for a key starts cleared."""

    def __init__(self, key: str):
        self._event = threading.Event()
        self.path = STOP_DIR / hashlib.sha1(key.encode()).hexdigest()
        self.path.unlink(missing_ok=True)

    def set(self) -> None:
        self._event.set()
        STOP_DIR.mkdir(exist_ok=True)
        self.path.touch()

    def is_set(self) -> bool:
        return self._event.is_set() or self.path.exists()


def in_background(events, stop: threading.Event, interval: float = 0.1, pool=ENGINE_THREAD):
    """Run an event generator in a worker thread; yield the events that arrived, in batches.

    The engine then never waits for the consumer (rendering, streaming to a browser), so the
    tokens/s it measures are the engine's own, and a slow client just receives bigger batches.
    Closing this generator (a UI cancel) stops the engine and waits for it. pool: ENGINE_THREAD, or a
    pool of many threads for an engine that serves requests concurrently (vLLM).
    """
    q: queue.Queue = queue.Queue()
    done = object()

    def work():
        try:
            for ev in events:
                q.put(ev)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)
        finally:
            q.put(done)

    worker = pool.submit(work)
    try:
        while True:
            batch = [q.get()]
            time.sleep(interval)            # let a few rounds gather: fewer, larger UI updates steal less CPU
            while True:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            finished = batch[-1] is done
            items = [b for b in batch if b is not done]
            for item in items:
                if isinstance(item, BaseException):
                    raise item
            if items:
                yield items
            if finished:
                return
    finally:
        if not worker.done():
            stop.set()
        worker.result()

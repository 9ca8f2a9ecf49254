"""The one engine thread and streaming from it: model work off the UI's threads, events in batches."""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

# All model work runs on this one thread. OpenMP keeps a thread team per calling thread, and idle
# teams spin for a while after each parallel region: generating from ever-new threads (Gradio's
# pool, a worker per turn) left several teams fighting over the cores (measured: -17% tokens/s).
ENGINE_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynchat-engine")


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

"""State that outlives a turn, kept bounded for a server that runs for months: per-chat entries
(least recently used dropped first) and the load meter all chats share."""
from __future__ import annotations

import collections
import os
import threading
import time

MAX_CHATS_KEPT = int(os.environ.get("DYNCHAT_MAX_CHATS", "2000"))   # chats whose per-chat state is kept


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

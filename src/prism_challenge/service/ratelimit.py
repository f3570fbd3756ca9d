"""Per-hotkey rate limits: at most ``limit`` requests in any sliding window of ``window_s``.

Counted per service process, in memory (the window restarts with the process), for requests
whose signature verified (or that the gateway vouched for): an unverified request names no
hotkey it could be charged to. A refused request is answered 429 with ``Retry-After``: the
whole seconds until the oldest request in the window leaves it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable


class RateLimiter:
    """A sliding-window counter per key.

    Args:
        limit: requests allowed per window (>= 1).
        window_s: the window, seconds (> 0).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: ``limit`` below 1 or ``window_s`` not positive.
    """

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        if limit < 1 or not window_s > 0:
            raise ValueError(f"rate limit {limit} per {window_s} s: need limit >= 1 and window > 0")
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._hits: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def hit(self, key: str) -> float | None:
        """Count one request of ``key``; ``None`` when allowed, else the seconds to wait (not counted)."""
        now = self.clock()
        with self._lock:
            hits = self._hits.setdefault(key, deque())
            while hits and hits[0] <= now - self.window_s:
                hits.popleft()
            if len(hits) >= self.limit:
                return hits[0] + self.window_s - now
            hits.append(now)
            if len(self._hits) > self.PRUNE_AT:
                self._prune(now)
            return None

    PRUNE_AT = 10_000
    """Keys kept before those with no request in the window are dropped (memory stays bounded
    by the requests of one window, whatever the number of hotkeys)."""

    def _prune(self, now: float) -> None:
        for key in [k for k, h in self._hits.items() if not h or h[-1] <= now - self.window_s]:
            del self._hits[key]

    @staticmethod
    def retry_after(wait_s: float) -> str:
        """``Retry-After``'s value: whole seconds, rounded up, at least 1."""
        return str(max(1, math.ceil(wait_s)))


__all__ = ["RateLimiter"]

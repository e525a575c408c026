"""Per-person limits on what costs the most: chats (each a model request or more).

Kept in the replica's memory: a person spread over replicas by a load balancer gets up to
the limit on each, which bounds a runaway script all the same (budgets bound the cost).
"""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_SECONDS = 60.0
PEOPLE_KEPT = 10_000  # a bound on memory; past it, idle people are forgotten first


class RateLimit:
    """At most ``per_minute`` in any 60 seconds per person."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._times: dict[str, deque[float]] = {}

    def take(self, person: str) -> float | None:
        """Count one for ``person``; None when allowed, else the seconds until it would be."""
        now = time.monotonic()
        times = self._times.get(person)
        if times is None:
            if len(self._times) >= PEOPLE_KEPT:
                self._forget(now)
            times = self._times[person] = deque()
        while times and now - times[0] >= WINDOW_SECONDS:
            times.popleft()
        if len(times) >= self.per_minute:
            return max(1.0, math.ceil(WINDOW_SECONDS - (now - times[0])))
        times.append(now)
        return None

    def _forget(self, now: float) -> None:
        self._times = {p: t for p, t in self._times.items() if t and now - t[-1] < WINDOW_SECONDS}
        if len(self._times) >= PEOPLE_KEPT:
            self._times.clear()

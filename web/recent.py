"""What a replica answered a moment ago, kept for a moment: the pollers' probe stays cheap.

A client polls a session's ``GET`` every few seconds (``isActive``, ``lastMessageId``); many
clients (a team's open tabs) poll the same session. Who a key acts as, and the parts of a
session's summary that need queries of their own, are kept here for ``ttl`` seconds, so a poll
reads one row. This replica's own writes to a session drop its entry at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

MOST = 10_000  # entries kept at once (a bound on memory, not a tuning)


class Recent(Generic[K, V]):
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._kept: dict[K, tuple[float, V]] = {}
        self._drops = 0  # how many drops so far: a value read before one is not kept

    @property
    def mark(self) -> int:
        """Taken before reading what ``put`` will keep (see ``put``)."""
        return self._drops

    def get(self, key: K) -> V | None:
        found = self._kept.get(key)
        if found is None:
            return None
        if time.monotonic() - found[0] >= self.ttl:
            del self._kept[key]
            return None
        return found[1]

    def put(self, key: K, value: V, mark: int | None = None) -> None:
        """Keep ``value``; with ``mark`` (taken before it was read), only if nothing was
        dropped since: a write that landed meanwhile may have made it old already."""
        if mark is not None and mark != self._drops:
            return
        if len(self._kept) >= MOST:
            now = time.monotonic()
            self._kept = {k: v for k, v in self._kept.items() if now - v[0] < self.ttl}
            if len(self._kept) >= MOST:
                self._kept.clear()
        self._kept[key] = (time.monotonic(), value)

    def drop(self, key: K) -> None:
        self._drops += 1
        self._kept.pop(key, None)

    def drop_values(self, gone: Callable[[V], bool]) -> None:
        """Drop every entry whose value is ``gone`` (a person erased: every key of theirs)."""
        self._drops += 1
        self._kept = {k: v for k, v in self._kept.items() if not gone(v[1])}

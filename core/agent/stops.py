"""Stop requests reaching the turns this process runs (a stop button clicked on any replica).

``SessionStore.request_stop`` marks a running turn's token in the database; the process that
runs the turn finds the mark here. One query every ``STOP_POLL_SECONDS`` for all the turns the
process runs, not one per turn, so a replica holding hundreds of turns polls once a second.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from core.errors import DatabaseError
from core.records import TurnLease

log = logging.getLogger(__name__)

STOP_POLL_SECONDS = 1.0

Lookup = Callable[[Sequence[TurnLease]], Awaitable[set[int]]]


class StopRequests(Protocol):
    """Where stop marks are read (the session store)."""

    async def stops_requested(self, leases: Sequence[TurnLease]) -> set[int]: ...


class StopWatch:
    def __init__(self, lookup: Lookup, every: float = STOP_POLL_SECONDS) -> None:
        self.lookup = lookup
        self.every = every
        self._watched: dict[int, tuple[TurnLease, Callable[[], None]]] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, lease: TurnLease, on_stop: Callable[[], None]) -> None:
        """Call ``on_stop`` (once) when a stop is requested for this lease's turn."""
        self._watched[lease.session_id] = (lease, on_stop)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())

    def forget(self, lease: TurnLease) -> None:
        watched = self._watched.get(lease.session_id)
        if watched is not None and watched[0] is lease:
            del self._watched[lease.session_id]

    async def _poll(self) -> None:
        while self._watched:
            await asyncio.sleep(self.every)
            watched = list(self._watched.values())
            try:
                stopped = await self.lookup([lease for lease, _ in watched])
            except DatabaseError as exc:  # a database blip: the next poll tries again
                log.warning("could not look for stop requests: %s", exc)
                continue
            except Exception:
                log.warning("could not look for stop requests", exc_info=True)
                continue
            for lease, on_stop in watched:
                if lease.session_id in stopped:
                    log.info("session %s: stop requested; stopping its turn", lease.session_id)
                    self.forget(lease)
                    on_stop()


_WATCHES: weakref.WeakKeyDictionary[StopRequests, StopWatch] = weakref.WeakKeyDictionary()


def stops_for(store: StopRequests) -> StopWatch:
    """The one watch of ``store``'s turns: every turn a process runs on one store shares one
    poll, however many callers start turns on it."""
    watch = _WATCHES.get(store)
    if watch is None:
        watch = _WATCHES[store] = StopWatch(store.stops_requested)
    return watch

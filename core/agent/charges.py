"""Ledger rows that must not be lost: written at once, and when a write fails, kept and written
again until the database takes them.

A model request is charged whether or not its answer finished (a provider bills the input of a
stopped request), and the ledger is what budgets count: a row lost to a database hiccup is a
request nobody pays for. ``LedgerWriter.write`` tries once in the turn (the turn must not wait
out an outage for its bookkeeping); a row that failed waits in the process, in order, and a
task of the process writes it again with a growing pause (up to ``MAX_PAUSE_SECONDS``), as does
every later write first. Only a process that ends with rows still waiting loses them (said in
its log, with their count), or more than ``MOST_WAITING`` waiting at once (the oldest dropped,
said in the log too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Final

from core.storage.usage import LedgerEntry, UsageLedger

log = logging.getLogger(__name__)

FIRST_PAUSE_SECONDS: Final = 0.05
MAX_PAUSE_SECONDS: Final = 5.0
MOST_WAITING: Final = 10_000


class LedgerWriter:
    """One per process (``Accounting``): the ledger's writes, retried (see the module)."""

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        self._waiting: deque[LedgerEntry] = deque()
        self._retrying: asyncio.Task[None] | None = None
        self._flushing = asyncio.Lock()  # one writer of the waiting rows at a time, in order

    @property
    def waiting(self) -> int:
        """Rows that failed and wait to be written again."""
        return len(self._waiting)

    async def write(self, entry: LedgerEntry) -> bool:
        """Write ``entry`` (after any row still waiting); ``False``: it failed and waits, to be
        written again by the process's retry task."""
        if self._waiting:
            self._keep(entry)
            self._retry_soon()
            return False
        try:
            await self.ledger.record(entry)
        except Exception:  # the answer must not be lost to its bookkeeping: kept, retried
            log.warning(
                "session %s: a model request's usage was not recorded; retrying",
                entry.session_id,
                exc_info=True,
            )
            self._keep(entry)
            self._retry_soon()
            return False
        return True

    async def flush(self) -> None:
        """Write every waiting row now (tests; a process's last moments)."""
        async with self._flushing:
            while self._waiting:
                await self.ledger.record(self._waiting[0])
                self._waiting.popleft()

    def _keep(self, entry: LedgerEntry) -> None:
        if len(self._waiting) >= MOST_WAITING:
            dropped = self._waiting.popleft()
            log.error("a model request's usage was dropped (session %s)", dropped.session_id)
        self._waiting.append(entry)

    def _retry_soon(self) -> None:
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.get_running_loop().create_task(self._retry())

    async def _retry(self) -> None:
        pause = FIRST_PAUSE_SECONDS
        while self._waiting:
            await asyncio.sleep(pause)
            try:
                await self.flush()
            except Exception:
                pause = min(pause * 2, MAX_PAUSE_SECONDS)
                log.warning("%d model requests' usage still not recorded", self.waiting)

    async def close(self) -> None:
        """Stop retrying; rows still waiting are said in the log."""
        if self._retrying is not None:
            self._retrying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retrying
        if self._waiting:
            log.error("%d model requests' usage was never recorded", self.waiting)


__all__ = ["LedgerWriter"]

"""The sweeper's thread: every ``SWEEPER_INTERVAL_SECONDS`` ± jitter, on every replica.

A sweep pass deletes in batches that can take a while on a large database; run on the serving
event loop it would hold acknowledgements. So it runs on a thread of its own with its own loop
and its own small engine (``Storage.open(pool_size=2)``); the passes are safe in parallel
across replicas (``core.storage.sweeper``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading

from core.settings import Settings
from core.storage import Storage

log = logging.getLogger(__name__)


class SweeperThread(threading.Thread):
    def __init__(self, settings: Settings) -> None:
        super().__init__(name="sweeper", daemon=True)
        self.settings = settings
        self._stopping = threading.Event()  # not ``_stop``: Thread.join calls a method of that name

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        s = self.settings
        storage = Storage.open(s, pool_size=2)
        try:
            while True:
                jitter = random.uniform(-s.sweeper_jitter_seconds, s.sweeper_jitter_seconds)
                delay = max(0.05, s.sweeper_interval_seconds + jitter)
                if await asyncio.to_thread(self._stopping.wait, delay):
                    return
                try:
                    report = await storage.sweep()
                except Exception:
                    log.exception("sweeper pass failed; will try again next period")
                    continue
                log.info(
                    "sweeper: deleted %d expired, %d idle, %d over-cap sessions; "
                    "%d snapshot contents; %d finished delivery records",
                    report.expired,
                    report.idle,
                    report.over_cap,
                    report.snapshot_contents,
                    report.extra.get("deliveries", 0),
                )
        finally:
            await storage.dispose()

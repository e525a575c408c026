"""Work a listener hands off after acknowledging (shortcuts, clicks, commands), stopped cleanly.

Bolt acknowledges first; what a shortcut or a button then does runs as a task here, so a
stop can let it finish for the grace period and then cancel it, and a failure is logged once
(a malformed payload as a warning) instead of being lost in an unobserved task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from core.conversation.worker import SHUTDOWN
from core.errors import InvalidRequest

log = logging.getLogger(__name__)


class BackgroundWork:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        if self.closing:
            coro.close()
            return
        task = asyncio.create_task(self._guard(coro))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _guard(coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except InvalidRequest as exc:
            log.warning("malformed payload: %s", exc)
        except Exception:
            log.exception("background Slack work failed")

    async def shutdown(self, grace: float) -> None:
        """Let running work finish for ``grace`` seconds, then cancel it."""
        self.closing = True
        pending = set(self._tasks)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace)
        for task in pending:
            task.cancel(SHUTDOWN)
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

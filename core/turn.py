"""A running turn: the lease, its heartbeat task, and the release that always happens.

``run_turn`` is what every surface uses around model work. It starts the turn (stale guard,
claim, user message: see ``SessionStore.start_turn``), refreshes the heartbeat every
``heartbeat_seconds`` in a background task, and on the way out either finishes, or persists the
partial output marked ``metadata.interrupted = true`` (SPEC §6.7), then releases the lock in a
``finally``. If the heartbeat finds the lock taken over, ``Turn.lost`` is set so the caller can
stop early; every later write of the turn fails with ``AgentSessionLockLost`` anyway.

The caller keeps ``Turn.partial`` up to date (the assistant message as streamed so far); that is
what is persisted, marked interrupted, if the turn ends by an exception or a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from core.errors import AgentSessionLockLost
from core.messages import Message
from core.records import ModelChoice, StoredMessage, TurnLease
from core.snapshots import SnapshotRef
from core.store import SessionStore, _Unset

log = logging.getLogger(__name__)


class Turn:
    def __init__(self, store: SessionStore, lease: TurnLease) -> None:
        self.store = store
        self.lease = lease
        self.lost = asyncio.Event()
        self.partial: Message | None = None
        self.finished = False

    @property
    def session_id(self) -> int:
        return self.lease.session_id

    async def history(self) -> list[StoredMessage]:
        return await self.store.history(self.session_id)

    async def append(
        self, messages: Sequence[Message], *, compaction: bool = False
    ) -> list[StoredMessage]:
        return await self.store.append(self.lease, messages, compaction=compaction)

    async def finish(
        self, messages: Sequence[Message] = (), *, snapshot: SnapshotRef | None = None
    ) -> list[StoredMessage]:
        stored = await self.store.finish(self.lease, messages, snapshot=snapshot)
        self.finished = True
        return stored

    async def _beat(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.store.heartbeat(self.lease)
            except AgentSessionLockLost:
                log.warning("session %s: turn lost its lock; stopping", self.session_id)
                self.lost.set()
                return
            except Exception:  # a transient database error must not kill the turn
                log.exception("session %s: heartbeat failed; will retry", self.session_id)


@contextlib.asynccontextmanager
async def run_turn(
    store: SessionStore,
    session_id: int,
    *,
    user_message: Message | None,
    last_message_id: str | _Unset | None,
    model: ModelChoice | None = None,
    heartbeat_seconds: float = 15.0,
) -> AsyncIterator[Turn]:
    lease = await store.start_turn(
        session_id, user_message=user_message, last_message_id=last_message_id, model=model
    )
    turn = Turn(store, lease)
    beat = asyncio.create_task(turn._beat(heartbeat_seconds))
    try:
        yield turn
    except BaseException:
        if turn.partial is not None and turn.partial.get("parts") and not turn.finished:
            metadata = {**turn.partial.get("metadata", {}), "interrupted": True}
            partial = {**turn.partial, "metadata": metadata}
            with contextlib.suppress(AgentSessionLockLost):
                await asyncio.shield(store.finish(lease, [partial]))
                turn.finished = True
        raise
    finally:
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        if not turn.finished:
            try:
                await asyncio.shield(store.release(lease))
            except AgentSessionLockLost:
                log.warning("session %s: lock was already taken over at release", session_id)

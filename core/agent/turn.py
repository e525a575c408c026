"""A running turn: the lease, its heartbeat task, and the release that always happens.

``run_turn`` is what every surface uses around model work. It starts the turn (stale guard,
claim, user message: see ``SessionStore.start_turn``), refreshes the heartbeat every
``heartbeat_seconds`` in a background task, and on the way out either finishes, or persists the
partial output marked ``metadata.interrupted = true`` with the sandbox state of
what already ran (``Turn.partial_snapshot``), then releases the lock in a ``finally``.

Interruptions. A turn stops early in three ways, all as a cancellation of the task that runs
it, so the model stream and any running command stop at once wherever they are:

- its task is cancelled from outside (a shutdown past its grace, Ctrl-C in a terminal): the
  ``CancelledError`` goes on up after the partial output is kept;
- the heartbeat finds the lock taken over: ``Turn.interrupt("lock_lost")`` cancels
  the task within one heartbeat period, and ``run_turn`` raises ``AgentSessionLockLost``
  instead (every write of the turn would fail with it anyway);
- a surface calls ``Turn.interrupt(reason)`` (a stop button): ``run_turn`` raises
  ``TurnInterrupted`` after keeping the partial output.

The caller keeps ``Turn.partial`` up to date (the assistant message as streamed so far); that is
what is persisted, marked interrupted, if the turn ends by an exception or a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

from core import metrics
from core.agent.stops import stops_for
from core.errors import AgentSessionLockLost, TurnInterrupted
from core.messages import Message
from core.records import AnyTail, ModelChoice, StoredMessage, TurnLease
from core.storage.sessions import SessionStore
from core.storage.snapshots import SnapshotRef
from core.storage.usage import Reservation

log = logging.getLogger(__name__)

LOCK_LOST = "lock_lost"
STOPPED = "stopped"


class Turn:
    def __init__(self, store: SessionStore, lease: TurnLease, task: asyncio.Task[object]) -> None:
        self.store = store
        self.lease = lease
        self.lost = asyncio.Event()
        self.partial: Message | None = None
        self.partial_snapshot: SnapshotRef | None = None
        self.finished = False
        self.outcome = "answered"  # what the metrics call a turn that returns normally
        self.interrupted_by: str | None = None
        self._task = task

    @property
    def session_id(self) -> int:
        return self.lease.session_id

    def interrupt(self, reason: str) -> None:
        """Stop this turn's work now: its task is cancelled, wherever it waits."""
        if self.interrupted_by is None and not self.finished:
            self.interrupted_by = reason
            self._task.cancel(reason)

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
                metrics.LOCKS_LOST.inc()
                self.lost.set()
                self.interrupt(LOCK_LOST)
                return
            except Exception:  # a transient database error must not kill the turn
                log.exception("session %s: heartbeat failed; will retry", self.session_id)

    async def _keep_partial(self, reason: str) -> None:
        """Persist what the turn wrote so far, marked interrupted, with its sandbox state."""
        if self.finished or self.partial is None or not self.partial.get("parts"):
            return
        metadata = {**self.partial.get("metadata", {}), "interrupted": True}
        metadata.setdefault("interrupted_by", reason)
        partial = {**self.partial, "metadata": metadata}
        with contextlib.suppress(AgentSessionLockLost):
            await asyncio.shield(
                self.store.finish(self.lease, [partial], snapshot=self.partial_snapshot)
            )
            self.finished = True


@contextlib.asynccontextmanager
async def run_turn(
    store: SessionStore,
    session_id: int,
    *,
    user_message: Message | None,
    last_message_id: str | AnyTail | None,
    model: ModelChoice | None = None,
    heartbeat_seconds: float = 15.0,
    reservation: Reservation | None = None,
) -> AsyncIterator[Turn]:
    task = asyncio.current_task()
    assert task is not None, "run_turn runs inside a task"
    lease = await store.start_turn(
        session_id,
        user_message=user_message,
        last_message_id=last_message_id,
        model=model,
        reservation=reservation,
    )
    metrics.TURNS_STARTED.inc()
    started = time.monotonic()
    turn = Turn(store, lease, task)
    beat = asyncio.create_task(turn._beat(heartbeat_seconds))
    stops = stops_for(store)
    stops.watch(lease, lambda: turn.interrupt(STOPPED))
    outcome = "failed"
    try:
        yield turn
        outcome = turn.outcome
    except asyncio.CancelledError as exc:
        reason = turn.interrupted_by or (str(exc.args[0]) if exc.args else "cancelled")
        outcome = LOCK_LOST if reason == LOCK_LOST else "interrupted"
        await turn._keep_partial(reason)
        if turn.interrupted_by is not None and task.uncancel() == 0:
            # Our own interruption, not one from outside: say what happened instead.
            if reason == LOCK_LOST:
                raise AgentSessionLockLost(
                    f"session {session_id}: this turn's lock was taken over; it stopped"
                ) from None
            raise TurnInterrupted(f"session {session_id}: turn {reason}", reason=reason) from None
        raise
    except AgentSessionLockLost:
        outcome = LOCK_LOST
        raise
    except BaseException:
        await turn._keep_partial("error")
        raise
    finally:
        stops.forget(lease)
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        if not turn.finished:
            try:
                await asyncio.shield(store.release(lease))
            except AgentSessionLockLost:
                log.warning("session %s: lock was already taken over at release", session_id)
        metrics.TURNS_FINISHED.labels(outcome).inc()
        metrics.TURN_SECONDS.labels(outcome).observe(time.monotonic() - started)

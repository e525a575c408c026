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
  ``TurnInterrupted`` after keeping the partial output;
- the database has not confirmed a heartbeat for ``TURN_SAFE_SHARE`` of the staleness window
  (a network partition, a failover, a half-open connection, a process that was paused), by
  this process's lease clock (``core.leases``: it counts a suspended machine's sleep):
  ``Turn.interrupt("database_unreachable")``, and
  ``run_turn`` raises ``DatabaseUnreachable`` (§6.12). Another replica may claim the lock
  only once the whole window has passed since the database stamped the last heartbeat, which
  it did after this process sent it; so the turn stops streaming, calling tools and calling
  the model before anyone else can start. What it wrote is kept if the database answers
  while the turn ends (fenced: never over a new owner's turn); otherwise whoever resumes the
  message answers it again from the user message, which the claim stored. The heartbeat task
  may wake after the turn's own task following a stall, so the turn also checks the age
  itself right before every side effect (``Turn.check_lease``, through
  ``core.leases.before_side_effect``): a model request, an MCP call or a shell command is never
  sent past that share.

A turn that ends without the database confirming its release (the database went away
mid-turn) leaves its lock to this process: ``SessionStore.abandon``, so this process's own
retry of the message takes the lock back at once instead of being refused as busy until the
window passes.

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
from core.errors import AgentSessionLockLost, DatabaseError, DatabaseUnreachable, TurnInterrupted
from core.leases import guarding, lease_clock
from core.messages import Message, said_anything
from core.records import AnyTail, ModelChoice, StoredMessage, TurnLease
from core.settings import TURN_SAFE_SHARE
from core.storage.sessions import SessionStore
from core.storage.snapshots import SnapshotRef
from core.storage.usage import Reservation

log = logging.getLogger(__name__)

LOCK_LOST = "lock_lost"
STOPPED = "stopped"
UNREACHABLE = "database_unreachable"
FAILED = "error"  # ended by an exception of its own (retried like any failure)


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
        # When (``lease_clock``) this process sent the last statement the database confirmed
        # the lock with: the database stamped the heartbeat no earlier than that.
        self.confirmed = lease_clock()
        # How long after ``confirmed`` the turn may still act (``run_turn`` sets it).
        self.trusted = TURN_SAFE_SHARE * store.staleness_seconds
        self._checked_out = False  # check_lease stopped the turn (no cancel requested)
        self._task = task

    @property
    def session_id(self) -> int:
        return self.lease.session_id

    def interrupt(self, reason: str) -> None:
        """Stop this turn's work now: its task is cancelled, wherever it waits."""
        if self.interrupted_by is None and not self.finished:
            self.interrupted_by = reason
            self._task.cancel(reason)

    def check_lease(self) -> None:
        """Right before a side effect: stop the turn, without sending it, if the lease's last
        confirmation is ``trusted`` seconds old or more (whatever the heartbeat task has
        managed to do). Raises the cancellation the heartbeat would have delivered, so the turn
        ends the same way (``DatabaseUnreachable`` from ``run_turn``)."""
        if self._checked_out:
            raise asyncio.CancelledError(UNREACHABLE)
        if self.interrupted_by is not None or lease_clock() - self.confirmed < self.trusted:
            return  # still its own, or a cancellation is already on its way to this task
        self._checked_out = True
        self._unreachable(self.trusted, cancel=False)
        raise asyncio.CancelledError(UNREACHABLE)

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

    async def _beat(self, every: float, trusted: float) -> None:
        """Heartbeat every ``every`` seconds; stop the turn when the lock was taken over, or
        when no heartbeat was confirmed for ``trusted`` seconds (a heartbeat that hangs is
        given up at that moment, not when the database call would time out)."""
        while True:
            left = self.confirmed + trusted - lease_clock()
            await asyncio.sleep(max(0.0, min(every, left)))
            left = self.confirmed + trusted - lease_clock()
            if left <= 0:
                self._unreachable(trusted)
                return
            sent = lease_clock()
            try:
                async with asyncio.timeout(left):
                    await self.store.heartbeat(self.lease)
                self.confirmed = max(self.confirmed, sent)
            except AgentSessionLockLost:
                log.warning("session %s: turn lost its lock; stopping", self.session_id)
                metrics.LOCKS_LOST.inc()
                self.lost.set()
                self.interrupt(LOCK_LOST)
                return
            except TimeoutError:
                self._unreachable(trusted)
                return
            except Exception as exc:  # a passing database error: the next beat may land
                log.warning("session %s: heartbeat failed (%s); will retry", self.session_id, exc)

    def _unreachable(self, trusted: float, *, cancel: bool = True) -> None:
        """``cancel``: cancel the turn's task (the heartbeat's way); else only mark the turn,
        for a check that raises in the task itself (a cancel requested too would be delivered
        again at the turn's next wait, while it keeps what it wrote)."""
        log.error(
            "session %s: no heartbeat confirmed for %.1fs (the database does not answer); "
            "the turn stops before another replica may take it over",
            self.session_id,
            lease_clock() - self.confirmed,
        )
        metrics.TURNS_SELF_STOPPED.inc()
        if cancel:
            self.interrupt(UNREACHABLE)
        else:
            self.interrupted_by = UNREACHABLE

    async def _keep_partial(self, reason: str) -> None:
        """Persist what the turn wrote so far, marked interrupted, with its sandbox state.

        A turn that failed (``database_unreachable``, an error) before its model said or did
        anything keeps nothing: its message is answered again by whoever resumes it, and an
        interrupted answer holding only ``step-start`` parts, stored after the message, made
        that resume take the message as answered (``AlreadyAnswered`` with nothing to show):
        the record finished and no reply was ever posted. A turn stopped on purpose (a stop,
        a shutdown, a lost lock) keeps its empty answer as before: its message is not tried
        again, and the transcript says it was interrupted."""
        if self.finished or self.partial is None or not self.partial.get("parts"):
            return
        if reason in (UNREACHABLE, FAILED) and not said_anything(self.partial):
            return
        metadata = {**self.partial.get("metadata", {}), "interrupted": True}
        metadata.setdefault("interrupted_by", reason)
        partial = {**self.partial, "metadata": metadata}
        try:
            await asyncio.shield(
                self.store.finish(self.lease, [partial], snapshot=self.partial_snapshot)
            )
            self.finished = True
        except AgentSessionLockLost:
            pass
        except DatabaseError as exc:  # the error that ends the turn is the one to report
            log.warning("session %s: partial answer not kept: %s", self.session_id, exc)


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
    started = time.monotonic()
    claimed = lease_clock()
    lease = await store.start_turn(
        session_id,
        user_message=user_message,
        last_message_id=last_message_id,
        model=model,
        reservation=reservation,
    )
    metrics.TURNS_STARTED.inc()
    turn = Turn(store, lease, task)
    turn.confirmed = claimed  # the claim stamped the lock after this
    beat = asyncio.create_task(turn._beat(heartbeat_seconds, turn.trusted))
    guard = guarding(turn.check_lease)
    guard.__enter__()
    stops = stops_for(store)
    stops.watch(lease, lambda: turn.interrupt(STOPPED))
    outcome = "failed"
    try:
        yield turn
        outcome = turn.outcome
    except asyncio.CancelledError as exc:
        beat.cancel()  # no second interruption while the partial answer is kept
        reason = turn.interrupted_by or (str(exc.args[0]) if exc.args else "cancelled")
        outcome = reason if reason in (LOCK_LOST, UNREACHABLE) else "interrupted"
        await turn._keep_partial(reason)
        if turn.interrupted_by is not None and task.uncancel() == 0:
            # Our own interruption, not one from outside: say what happened instead.
            if reason == LOCK_LOST:
                raise AgentSessionLockLost(
                    f"session {session_id}: this turn's lock was taken over; it stopped"
                ) from None
            if reason == UNREACHABLE:
                raise DatabaseUnreachable(
                    f"session {session_id}: the database did not confirm this turn's lock in "
                    "time; the turn stopped"
                ) from None
            raise TurnInterrupted(f"session {session_id}: turn {reason}", reason=reason) from None
        raise
    except AgentSessionLockLost:
        outcome = LOCK_LOST
        raise
    except BaseException:
        beat.cancel()
        await turn._keep_partial(FAILED)
        raise
    finally:
        guard.__exit__(None, None, None)
        stops.forget(lease)
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat
        if not turn.finished:
            try:
                await asyncio.shield(store.release(lease))
            except AgentSessionLockLost:
                log.warning("session %s: lock was already taken over at release", session_id)
            except DatabaseError as exc:
                # The turn is over; its lock stays set in the database until the window
                # passes, or until this process claims the session again (its retry).
                log.warning(
                    "session %s: lock not released (%s); this process may take it back",
                    session_id,
                    exc,
                )
                store.abandon(lease)
        metrics.TURNS_FINISHED.labels(outcome).inc()
        metrics.TURN_SECONDS.labels(outcome).observe(time.monotonic() - started)

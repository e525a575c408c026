"""Every received message through to its answer, whatever dies in between (§6.10).

A surface records a message for the agent (``core.storage.deliveries``) before it acknowledges
it: if the record cannot be written, the sender is told so and sends the message again (Slack
gets a 500). From then on the record drives the work, on whichever replica holds it. What is the
surface's own (answering in its thread, telling the poster, offering Send/Discard, which client
reaches the poster's workspace) is a ``DeliverySurface``; the rest is here, once:

- **The line.** A thread's records are answered in arrival order: a record waits while an
  earlier one of its thread is received, running, or waiting to be sent automatically. A
  follow-up posted while its thread's own turn runs is told so and answered right after; a
  follow-up whose thread's first message is still being handled elsewhere waits for it.
- **Busy elsewhere.** A turn refused as busy (the terminal client, a compaction or rewind from
  outside the thread) waits as ``waiting`` (``BUSY_MODE=queue``: sent in order when free;
  ``ask``: offered with Send/Discard), polled every ``BUSY_POLL_SECONDS``, and gives up after
  ``BUSY_POLL_TIMEOUT_SECONDS`` (measured on the database clock, across take-overs).
- **Leases.** This process renews the leases of the records it works on every
  ``TURN_HEARTBEAT_SECONDS`` and takes over records whose lease lapsed (a dead replica's) or
  that were released (a stopped one's), resuming each from what the transcript holds.
- **Stopping.** ``stop``: records not in a turn are released at once for the next replica;
  running turns get the grace period, then are interrupted (partial answer and sandbox kept,
  the thread told).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Generic

from core import metrics
from core.agent.loop import ModelCalled, ModelDone
from core.conversation.conversations import Conversations
from core.conversation.intake import Incoming, Intake
from core.conversation.surface import (
    C,
    ClickAnswer,
    DeliverySurface,
    Outcome,
    WaitingNotice,
)
from core.errors import AgentSessionNotFound, DatabaseError
from core.settings import Settings
from core.storage.deliveries import ACTIVE, MAX_TAKEOVERS, Deliveries, DeliveryRecord

log = logging.getLogger(__name__)

TAKEOVER_BATCH = 50
# A follow-up still waiting behind its thread's turn after this long is told it waits.
NOTICE_AFTER_SECONDS = 1.0
# Pauses before carrying a message on again after a database error (then: left to a take-over).
DATABASE_RETRIES = (0.5, 1.0, 2.0, 4.0, 8.0)
# A waiting record looks for itself at least this often, whatever the watch says.
WAIT_RECHECK_SECONDS = 30.0
# Work on a message waits at most this long for a burst of requests to be acknowledged.
ACKS_FIRST_SECONDS = 0.5
# Turns doing their own work at once: before their model call (records, claim, history,
# sandbox, the surface's status) and after it (storing the answer, closing the reply, records).
# That work is CPU on the one event loop; hundreds of turns starting or ending together made
# each pass of the loop long, and every acknowledgement waited for such passes. Turns waiting on
# their model, the most of a turn, are not counted. An acknowledgement takes a few passes, each
# as long as the ready turns' steps: fewer places acknowledge a burst sooner, and starting turns
# is CPU-bound, so more places do not start them faster (docs/benchmarks.md, *Figures behind
# choices in the code*).
TURNS_AT_WORK = 4


SHUTDOWN = "shutdown"  # the cancellation message of work stopped by a shutdown
# The cancellation message of a turn stopped because this process may no longer hold its
# record: its lease went unconfirmed too long, or another replica took the record over.
RECORD_LOST = "record_lost"
# The share of the lease window after which a turn whose record's lease renewal went
# unconfirmed is stopped: later than a turn stops itself when its own lock goes unconfirmed
# (``TURN_SAFE_SHARE``), so a replica cut off from its database stops its turns by their own
# path; before the window ends, so no other replica has taken the record over yet.
LEASE_SAFE_SHARE = 0.9


class DeliveryWorker(Generic[C]):
    """The records this process works on: one task each, their leases, take-overs, a stop."""

    def __init__(
        self,
        settings: Settings,
        deliveries: Deliveries,
        conversations: Conversations,
        surface: DeliverySurface[C],
        *,
        max_turns: int = 64,
        max_held: int | None = None,
    ) -> None:
        self.settings = settings
        self.deliveries = deliveries
        self.conversations = conversations
        self.surface = surface
        self.closing = False
        self._tasks: dict[int, asyncio.Task[None]] = {}
        # Where each record's reply went, as soon as the surface said (``_Progress.replying``).
        self.replies: dict[int, str] = {}
        self._turning: set[int] = set()  # records whose turn runs now (not released on stop)
        # When (monotonic) each record's lease was last confirmed: the statement that renewed
        # it (or took or wrote it) was sent no earlier. A turn stops before its lease can lapse.
        self._confirmed: dict[int, float] = {}
        self._stopping: set[int] = set()  # turns stopped (by us or by themselves): not watched
        self._wake: dict[str, asyncio.Event] = {}  # thread -> set when a record of it finishes
        # Turns run at once by this process; the rest wait, already recorded and leased.
        self._slots = asyncio.Semaphore(max_turns)
        self.at_work = asyncio.Semaphore(TURNS_AT_WORK)  # taken by ``_Progress``
        self._upkeep: asyncio.Task[None] | None = None
        self._leases: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._waiters: dict[int, _Waiter] = {}  # records waiting here, by id
        self._parked: set[int] = set()  # records waiting for another turn to end (``held``)
        self._arriving = 0  # requests being acknowledged right now
        # Their tasks: a request answered 503 at its deadline goes on recording (``bot.http``),
        # and ``stop`` lets it end (or cancels it) before the database is disposed of.
        self._arrivals: set[asyncio.Task[Any]] = set()
        self._quiet = asyncio.Event()
        self._quiet.set()
        # Records this process holds at most (running, in line, waiting): past it, new messages
        # are recorded for any replica with room (``core.conversation.intake``).
        self.max_held = max_held if max_held is not None else settings.max_held_messages
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed = 0  # records handed over from another thread, not yet taken here
        self._handed_lock = threading.Lock()  # ``+=`` is not atomic across threads
        self._releasing: set[asyncio.Task[int]] = set()
        self.intake = Intake(
            deliveries,
            conversations.find,
            self.accept,
            closing=lambda: self.closing,
            has_room=self.has_room,
        )

    # -- what other threads may call ------------------------------------------------------------

    @property
    def held(self) -> int:
        """Records this process holds now and has to work on (any thread): running, or in line
        for a turn's place here. Not those parked until another turn of their thread or
        session ends: they wait for that turn, not for this replica, and would wait as long on
        any other; counting them made a replica with a few busy threads refuse new ones."""
        return len(self._tasks) + self._handed - len(self._parked)

    @property
    def parked(self) -> int:
        """Records held here waiting for another turn of their thread or session to end."""
        return len(self._parked)

    def has_room(self) -> bool:
        """Fewer records held than ``max_held`` (any thread: a read of two numbers)."""
        return self.held < self.max_held

    def hand_over(self, record: DeliveryRecord) -> None:
        """A record written by an intake on another thread: carried on here (thread-safe)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the delivery worker has not started")
        with self._handed_lock:
            self._handed += 1
        metrics.INTAKE_QUEUE.inc()
        loop.call_soon_threadsafe(self._handed_over, record)

    def _handed_over(self, record: DeliveryRecord) -> None:
        with self._handed_lock:
            self._handed -= 1
        metrics.INTAKE_QUEUE.dec()
        self.accept(record)

    def accept(self, record: DeliveryRecord) -> None:
        """Carry on a record this process just wrote (on the worker's loop); the client that
        reaches its workspace is found when its work starts."""
        if self.closing:
            # Written while this process began stopping: the next replica takes it.
            release = asyncio.create_task(self.deliveries.release([record.id]))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)
            return
        self.start()
        self._carry_on(record, None, resumed=False)

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Around each incoming request: work on messages waits while requests are being
        acknowledged, so a burst is acknowledged first (Slack's 3 s) and answered after."""
        task = asyncio.current_task()
        if task is not None:
            self._arrivals.add(task)
        self._arriving += 1
        self._quiet.clear()
        try:
            yield
        finally:
            if task is not None:
                self._arrivals.discard(task)
            self._arriving -= 1
            if not self._arriving:
                self._quiet.set()

    # -- intake ---------------------------------------------------------------------------------

    async def known_thread(self, thread: str) -> bool:
        """A session thread, or one whose first message was recorded a moment ago."""
        return await self.intake.known_thread(thread)

    async def receive(self, message: Incoming, client: C) -> None:
        """Record a message for the agent on this loop (``Intake.receive``) and carry it on
        here with ``client``; called before the acknowledgement."""
        self.start()
        await self.intake.receive(message, hand_off=self._carrier(client))

    def _carrier(self, client: C) -> Callable[[DeliveryRecord], None]:
        return lambda record: self._carry_on(record, client, resumed=False)

    def _carry_on(self, record: DeliveryRecord, client: C | None, *, resumed: bool) -> None:
        task = asyncio.create_task(self._guarded(record, client, resumed))
        self._tasks[record.id] = task
        # Its lease was written a moment ago (received, taken over, claimed back by a click;
        # the handover's delay is well inside the window).
        self._confirmed[record.id] = time.monotonic()

        def forget(done: asyncio.Task[None]) -> None:
            # A click may start a record's next task while the one that offered it is still
            # finishing: only the task a record is tracked under is forgotten.
            if self._tasks.get(record.id) is done:
                del self._tasks[record.id]
                self._confirmed.pop(record.id, None)
                self._stopping.discard(record.id)

        task.add_done_callback(forget)

    async def _guarded(self, record: DeliveryRecord, client: C | None, resumed: bool) -> None:
        with contextlib.suppress(TimeoutError):  # bounded: a steady stream never starves it
            await asyncio.wait_for(self._quiet.wait(), ACKS_FIRST_SECONDS)
        if client is None:
            client = await self.surface.client_for(record)
            if client is None:
                # Its lease lapses; a take-over gives up on it with a log line.
                log.error("message %s: no installation reaches its workspace", record.event_key)
                return
        try:
            await self._retried(record, client, resumed)
        finally:
            self.replies.pop(record.id, None)

    async def _retried(self, record: DeliveryRecord, client: C, resumed: bool) -> None:
        current: DeliveryRecord | None = record
        failure: BaseException | None = None
        pauses = iter(DATABASE_RETRIES)
        while True:
            if current is None:
                log.info("message %s: no longer ours; leaving it", record.event_key)
                return
            try:
                await self._carry(current, client, resumed)
                return
            except asyncio.CancelledError:
                raise
            except DatabaseError as exc:
                # A database blip (a restart, a failover, a partition): the record stays ours
                # and leased; carry on from what the transcript holds once the database
                # answers again.
                resumed = True
                found = await self._reloaded(current, exc, pauses)
                if isinstance(found, DatabaseError):
                    failure = found
                    break
                current = found
            except Exception as exc:
                failure = exc
                break
        # The record stays active and ours; its lease is no longer renewed, so after the
        # staleness window a replica (maybe this one) takes it over and tries again.
        log.error(
            "message %s: failed; it will be taken over and retried",
            record.event_key,
            exc_info=failure,
        )

    async def _reloaded(
        self, record: DeliveryRecord, failure: DatabaseError, pauses: Iterator[float]
    ) -> DeliveryRecord | DatabaseError | None:
        """After a database failure: the record as the database has it once it answers again
        (None: no longer ours), or the last failure when the pauses run out first. Never the
        copy held here: while this process could not reach the database, another replica may
        have taken the record over and answered it, and carrying on from the copy would show
        that answer a second time."""
        for pause in pauses:
            log.warning("message %s: %s; retrying in %gs", record.event_key, failure, pause)
            await asyncio.sleep(pause)
            try:
                current = await self._reload(record)
            except DatabaseError as exc:
                failure = exc
                continue
            shown = self.replies.get(record.id)
            if current is not None and current.reply_ref is None and shown is not None:
                current = replace(current, reply_ref=shown)
            return current
        return failure

    # -- one record, from received to finished --------------------------------------------------

    async def _carry(self, record: DeliveryRecord, client: C, resumed: bool) -> None:
        await self.intake.adopt(
            record.thread_key,
            self._carrier(client),
            lambda strays: self.surface.words(strays, client),
        )
        if record.state == "stray":
            return  # handed over by its own receiver, only for its thread's strays to be adopted
        current: DeliveryRecord | None = record
        while current is not None and not self.closing:
            blocker = await self.deliveries.blocker(current)
            if blocker is not None:
                current = await self._wait_in_line(current, blocker, client)
                continue
            if current.state == "waiting" and current.wait_reason in ("ask", "queue"):
                if await self._session_busy(current):
                    current = await self._wait(current, client)
                    continue
                if current.wait_reason == "ask":
                    await self._offer(current, client)
                    return
            async with self._slots:
                if self.closing:
                    return
                if self._unconfirmed_for(current.id) >= 0:
                    # Its lease may have lapsed while it waited for a place: whoever takes
                    # it over answers it.
                    log.warning("message %s: lease not confirmed; leaving it", current.event_key)
                    return
                self._turning.add(current.id)  # from here on, a stop waits for it
                self._stopping.discard(current.id)
                progress = _Progress(self, current)
                current_progress = _CURRENT.set(progress)
                try:
                    await progress.enter()  # its work before the model call
                    outcome = await self.surface.answer(
                        current, client, resumed=resumed, progress=progress
                    )
                    if outcome is Outcome.STALE:
                        await self._offer(current, client, stale=True)
                        return
                    if outcome is Outcome.ANSWERED:
                        await self._finish(current, "done")
                        return
                except asyncio.CancelledError as exc:
                    if RECORD_LOST in exc.args:
                        raise  # not ours any more, or the database cannot say: nothing to do
                    # A stop past its grace. A turn that started was interrupted and answered
                    # as such; one that had not is handed to the next replica.
                    if await asyncio.shield(self._was_started(current)):
                        await asyncio.shield(self._finish(current, "done"))
                    else:
                        await asyncio.shield(self.deliveries.release([current.id]))
                    raise
                finally:
                    progress.leave()  # the turn ended: its place goes to another
                    _CURRENT.reset(current_progress)
                    self._turning.discard(current.id)
            resumed = False
            current = await self._start_waiting(current, client)

    async def _was_started(self, record: DeliveryRecord) -> bool:
        current = await self.deliveries.get(record.id)
        return current is not None and current.state == "started"

    async def _finish(self, record: DeliveryRecord, state: str) -> None:
        """The record's end (``done``, ``failed``): only whether it moved is needed, so it is
        not read back (``Deliveries.moved``)."""
        self._finished(record, state, await self.deliveries.moved(record.id, ACTIVE, state))

    async def _finish_and_read(self, record: DeliveryRecord, state: str) -> DeliveryRecord | None:
        """``_finish``, the record read back as it moved (None: it did not)."""
        moved = await self.deliveries.move(record.id, ACTIVE, state)
        self._finished(record, state, moved is not None)
        return moved

    def _finished(self, record: DeliveryRecord, state: str, moved: bool) -> None:
        if moved:
            metrics.DELIVERIES_FINISHED.labels(state).inc()
        self._wake_thread(record.thread_key)

    async def _wait_in_line(
        self, record: DeliveryRecord, blocker: DeliveryRecord, client: C
    ) -> DeliveryRecord | None:
        if record.state != "received":
            return await self._wait(record, client)
        moved = await self.deliveries.wait(record.id, ("received",), "thread")
        if moved is None:
            return None
        # Most follow-ups arrive as the reply before them is being finished: say nothing
        # unless the wait is real.
        with self._parking(moved):
            await self._pause(moved.thread_key, NOTICE_AFTER_SECONDS)
        current = await self._reload(moved)
        blocker_now = None if current is None else await self.deliveries.blocker(current)
        if current is not None and blocker_now is not None:
            queued = blocker_now.state == "waiting" and blocker_now.wait_reason == "queue"
            await self.surface.tell(
                current, client, WaitingNotice.QUEUED if queued else WaitingNotice.FOLLOW_UP
            )
        return current

    async def _start_waiting(self, record: DeliveryRecord, client: C) -> DeliveryRecord | None:
        """The session is held elsewhere: wait (and say so once)."""
        if record.state == "waiting" and record.wait_reason in ("ask", "queue"):
            return await self._wait(record, client)  # it looked free a moment ago
        queue = self.settings.busy_mode == "queue"
        session = await self._session_of(record)
        moved = await self.deliveries.wait(
            record.id,
            ("received", "waiting"),
            "queue" if queue else "ask",
            session_id=session,
        )
        if moved is None:
            return None
        await self.surface.tell(
            moved, client, WaitingNotice.QUEUED if queue else WaitingNotice.BUSY
        )
        return await self._wait(moved, client)

    async def _wait(self, record: DeliveryRecord, client: C) -> DeliveryRecord | None:
        """Until this replica's watch (``_watch_waiting``) or a finish here says the record may
        go on; the record as it is then, if it is still ours."""
        waiter = _Waiter(record)
        self._waiters[record.id] = waiter
        try:
            with self._parking(record), contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.event.wait(), WAIT_RECHECK_SECONDS)
        finally:
            self._waiters.pop(record.id, None)
        if waiter.expired:
            metrics.DELIVERIES_FINISHED.labels("expired").inc()
            self._wake_thread(record.thread_key)
            await self.surface.tell(record, client, WaitingNotice.TIMED_OUT)
            return None
        return await self._reload(record)

    @contextlib.contextmanager
    def _parking(self, record: DeliveryRecord) -> Iterator[None]:
        self._parked.add(record.id)
        try:
            yield
        finally:
            self._parked.discard(record.id)

    async def _watch_waiting(self) -> None:
        """Every BUSY_POLL_SECONDS, for all the records this replica has waiting at once: which
        are first in their thread's line, which of those still meet a busy session, which of
        those waited too long. A few queries per period, however many records wait."""
        while True:
            await asyncio.sleep(self.settings.busy_poll_seconds)
            waiters = list(self._waiters.values())
            if not waiters:
                continue
            try:
                free = await self.deliveries.unblocked([w.record.id for w in waiters])
                on_session = {
                    w.record.id: w.record.session_id
                    for w in waiters
                    if w.record.id in free
                    and w.record.wait_reason in ("ask", "queue")
                    and w.record.session_id is not None
                }
                busy = await self.conversations.busy(
                    {sid for sid in on_session.values() if sid is not None}
                )
                held = [rid for rid, sid in on_session.items() if sid in busy]
                expired = await self.deliveries.expire_overdue_many(
                    held, self.settings.busy_poll_timeout_seconds
                )
            except asyncio.CancelledError:
                raise
            except Exception:  # a database blip: the next period tries again
                log.warning("could not check the waiting messages", exc_info=True)
                continue
            for waiter in waiters:
                if waiter.record.id in expired:
                    waiter.expired = True
                    waiter.event.set()
                elif waiter.record.id in free and waiter.record.id not in held:
                    waiter.event.set()

    async def _offer(self, record: DeliveryRecord, client: C, *, stale: bool = False) -> None:
        """Offer Send/Discard (ask mode on a free session, or **Send anyway** after a stale
        refusal). The record becomes passive (``offered`` / ``stale``) *before* the offer is
        posted, so a click, however quick, finds it claimable. An offer Slack refused takes the
        record back (no click can have come: nobody saw it) and leaves it ours and active
        without a lease renewal, so a take-over offers it again."""
        state = "stale" if stale else "offered"
        moved = (
            await self._finish_and_read(record, state)
            if stale
            else await self._mark_offered(record)
        )
        if moved is None:
            return  # no longer ours (taken over, or discarded meanwhile)
        if not await self.surface.offer(moved, client, stale=stale):
            log.warning("offer for %s not posted; will try again", record.event_key)
            back = await self.deliveries.claim(record.id, (state,))
            if back is not None and not stale:
                await self.deliveries.wait(back.id, ("received",), "ask")

    async def _mark_offered(self, record: DeliveryRecord) -> DeliveryRecord | None:
        moved = await self.deliveries.move(record.id, ("waiting",), "offered")
        self._wake_thread(record.thread_key)
        return moved

    async def _session_busy(self, record: DeliveryRecord) -> bool:
        try:
            session = await self._session_of(record)
        except AgentSessionNotFound:
            return False
        return session is not None and bool(await self.conversations.busy({session}))

    async def _session_of(self, record: DeliveryRecord) -> int | None:
        """The id of the session of the record's thread, if it exists yet."""
        if record.session_id is not None:
            return (await self.conversations.get(record.session_id)).id
        found = await self.conversations.find(record.thread_key)
        return None if found is None else found.id

    async def _reload(self, record: DeliveryRecord) -> DeliveryRecord | None:
        """The record as it is now, if it is still ours and active (a click may have discarded
        it, or another replica taken it over while this one could not renew its lease)."""
        current = await self.deliveries.get(record.id)
        if current is None or current.owner != self.deliveries.owner or not current.active:
            return None
        return current

    async def _pause(self, thread: str, most: float | None = None) -> None:
        """Until a record of this thread finishes here, or BUSY_POLL_SECONDS (other replicas)."""
        event = self._wake.setdefault(thread, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), most or self.settings.busy_poll_seconds)

    def _wake_thread(self, thread: str) -> None:
        """A record of this thread finished here: its waiters here look again at once."""
        event = self._wake.pop(thread, None)
        if event is not None:
            event.set()
        for waiter in list(self._waiters.values()):
            if waiter.record.thread_key == thread:
                waiter.event.set()

    # -- clicks ---------------------------------------------------------------------------------

    async def click(
        self,
        record_id: str,
        user: str,
        send: bool,
        client: C,
        answer: Callable[[DeliveryRecord, ClickAnswer], Awaitable[None]],
    ) -> None:
        """Send / Send anyway / Discard on an offer, from whichever replica gets the click.
        ``answer`` replaces the offer with what came of the click (before the message is
        carried on), so it cannot be clicked twice."""
        try:
            number = int(record_id)
        except ValueError:
            return
        record = await self.deliveries.get(number)
        if record is None or record.author != user:
            return
        if not send:
            discarded = await self.deliveries.discard(number, author=user)
            if discarded is not None:
                metrics.DELIVERIES_FINISHED.labels("discarded").inc()
                self._wake_thread(record.thread_key)
            await answer(record, ClickAnswer.DISCARDED if discarded else ClickAnswer.GONE)
            return
        claimed = await self.deliveries.claim(number, ("offered", "stale"), author=user)
        if claimed is None:
            await answer(record, ClickAnswer.GONE)
            return
        await answer(record, ClickAnswer.SENDING)
        self._carry_on(claimed, client, resumed=False)

    # -- leases and take-overs ------------------------------------------------------------------

    def start(self) -> None:
        """Start renewing leases, taking records over and watching waiting records
        (idempotent; needs a running loop)."""
        if self._upkeep is None and not self.closing:
            self._loop = asyncio.get_running_loop()
            self._upkeep = asyncio.create_task(self._keep_up())
            self._leases = asyncio.create_task(self._keep_leases())
            self._watcher = asyncio.create_task(self._watch_waiting())

    async def _keep_up(self) -> None:
        async def take_over() -> None:
            if not self.closing:
                await self._take_over()

        heartbeat = self.settings.turn_heartbeat_seconds
        await self._every("delivery upkeep", take_over, lambda: heartbeat)

    @staticmethod
    async def _every(
        what: str, step: Callable[[], Awaitable[None]], pause: Callable[[], float]
    ) -> None:
        """``step`` again and again, ``pause()`` seconds apart; a failure is logged and the
        next step tries again (a database blip: leases are renewed well within the window)."""
        while True:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except (DatabaseError, TimeoutError) as exc:
                log.warning("%s failed (%s); will retry", what, str(exc) or "timed out")
            except Exception:
                log.exception("%s failed; will retry", what)
            await asyncio.sleep(pause())

    async def _keep_leases(self) -> None:
        """Renew the leases of this process's records every ``TURN_HEARTBEAT_SECONDS``; stop
        the turn of a record whose lease was not confirmed within ``LEASE_SAFE_SHARE`` of the
        window, or that another replica took over.

        The turn's own lock does not cover this: its heartbeat renews the session's row, and a
        renewal of the records' rows can fail while it succeeds (the rows locked by another
        transaction until the statement timeout). After the window another replica takes the
        record over, waits for the session and, finding the answer stored, shows it; a turn
        that went on here showed it too. So a turn stops first, as it does when its own lock
        goes unconfirmed, and its reply says another replica picks it up."""

        async def renew() -> None:
            try:
                await self._renew()
            finally:  # renewed or not, a turn past its lease's trust stops
                self._stop_unconfirmed()

        heartbeat = self.settings.turn_heartbeat_seconds
        await self._every(
            "lease renewal", renew, lambda: max(0.0, min(heartbeat, self._trusted_for(heartbeat)))
        )

    def _window(self) -> float:
        return LEASE_SAFE_SHARE * self.deliveries.staleness_seconds

    def _trusted_for(self, default: float) -> float:
        """Seconds until the first running turn's lease can no longer be trusted."""
        return min(
            (-self._unconfirmed_for(r) for r in self._turning - self._stopping),
            default=default,
        )

    def _unconfirmed_for(self, record_id: int) -> float:
        """Seconds past the point where the record's lease can no longer be trusted (negative:
        how long it still can)."""
        confirmed = self._confirmed.get(record_id, time.monotonic())
        return time.monotonic() - confirmed - self._window()

    async def _renew(self) -> None:
        ids = list(self._tasks)
        if not ids:
            return
        sent = time.monotonic()
        # Bounded: a renewal that hangs past the turns' deadline is given up then.
        async with asyncio.timeout(max(0.0, self._trusted_for(self._window()))):
            ours = await self.deliveries.refresh(ids)
        for record_id in ours:
            if record_id in self._confirmed:
                self._confirmed[record_id] = max(self._confirmed[record_id], sent)
        for record_id in set(ids) - ours:
            if record_id in self._turning and await self._taken_over(record_id):
                self._stop_turn(record_id, "taken over by another replica")

    async def _taken_over(self, record_id: int) -> bool:
        """Active under another owner (not merely finished here a moment ago)."""
        current = await self.deliveries.get(record_id)
        return current is not None and current.active and current.owner != self.deliveries.owner

    def _stop_unconfirmed(self) -> None:
        for record_id in list(self._turning - self._stopping):
            if self._unconfirmed_for(record_id) >= 0:
                self._stop_turn(record_id, "its lease not confirmed in time")

    def _stop_turn(self, record_id: int, why: str) -> None:
        task = self._tasks.get(record_id)
        if task is None or record_id in self._stopping:
            return
        self._stopping.add(record_id)
        if task.cancelling():
            return  # already stopping: its turn stopped itself (or a shutdown stops it)
        log.error(
            "record %s: %s; the turn stops before another replica may take it over",
            record_id,
            why,
        )
        metrics.TURNS_RECORD_LOST.inc()
        task.cancel(RECORD_LOST)

    async def _take_over(self) -> None:
        room = self.max_held - self.held
        if room <= 0:
            return  # saturated: what lapsed is left to replicas with room
        for record in await self.deliveries.take_over(min(TAKEOVER_BATCH, room)):
            metrics.DELIVERIES_TAKEN_OVER.inc()
            client = await self.surface.client_for(record)
            if record.takeovers > MAX_TAKEOVERS or client is None:
                log.error(
                    "message %s: giving up after %d take-overs (or no installation)",
                    record.event_key,
                    record.takeovers,
                )
                await self._finish(record, "failed")
                if client is not None:
                    await self.surface.tell(record, client, WaitingNotice.GAVE_UP)
                continue
            log.info(
                "message %s: taken over in state %s; carrying on", record.event_key, record.state
            )
            self._carry_on(record, client, resumed=True)

    # -- stopping -------------------------------------------------------------------------------

    def stop_taking(self) -> None:
        """From now on a request is refused (503: Slack sends it again, maybe elsewhere) and
        a message still being recorded is recorded for the next replica (``Intake``)."""
        self.closing = True

    async def stop(self, grace: float) -> None:
        """Stop taking records; let the requests still being handled end (records in flight:
        one answered 503 at its deadline may still be writing its record), for the grace
        period at most, then cancel them; release the records not in a turn at once; give
        running turns what is left of ``grace``, then interrupt them (the core keeps their
        partial answers). Nothing of the worker uses the database once this returns: the
        owner disposes of it next, and a statement still under way would leave its
        connection open behind the engine's back."""
        self.stop_taking()
        until = time.monotonic() + grace
        await finish_or_cancel(self._arrivals - {asyncio.current_task()}, grace)
        await self.deliveries.settle()  # a write the cancelled requests waited for
        idle = {rid: t for rid, t in self._tasks.items() if rid not in self._turning}
        for task in idle.values():
            task.cancel(SHUTDOWN)
        await asyncio.gather(*idle.values(), return_exceptions=True)
        released = await self.deliveries.release(list(idle))
        if released:
            log.info("released %d waiting message(s) for the next replica", released)
        running = set(self._tasks.values())
        if running:
            left = max(0.0, until - time.monotonic())
            # To a tenth: what the requests took of the grace is milliseconds, mostly.
            log.info("waiting up to %gs for %d running turn(s)", round(left, 1), len(running))
            await finish_or_cancel(running, left)
        for background in (self._upkeep, self._leases, self._watcher):
            if background is not None:
                background.cancel()
                await asyncio.gather(background, return_exceptions=True)
        # Records handed over while stopping, being released for the next replica.
        await asyncio.gather(*self._releasing, return_exceptions=True)


async def finish_or_cancel(tasks: set[asyncio.Task[Any]], within: float) -> None:
    """``tasks`` end by themselves within ``within`` seconds, or are cancelled (``SHUTDOWN``);
    either way they have ended when this returns."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=within) if within > 0 else (set(), tasks)
    for task in pending:
        task.cancel(SHUTDOWN)
    await asyncio.gather(*pending, return_exceptions=True)


# The try the running task works for (set by ``_carry``, inherited by the tasks it starts).
_CURRENT: contextvars.ContextVar[_Progress | None] = contextvars.ContextVar(
    "slack_agent_progress", default=None
)


@contextlib.asynccontextmanager
async def waiting_aside() -> AsyncIterator[None]:
    """The current turn waits on something outside the process for a while (a Web API's
    ``Retry-After``, a retry's backoff): its place among the ``TURNS_AT_WORK`` goes to another
    turn meanwhile. Slack's 429s say how many seconds to wait, and four turns sleeping on
    them held every place: no other turn of the replica, of any workspace, could start or
    finish. Outside a turn's own work this does nothing."""
    progress = _CURRENT.get()
    if progress is None:
        yield
        return
    async with progress.aside():
        yield


class _Progress:
    """What a try tells its record: started (the user message is stored), replying (where);
    and, from the turn's events, when its own work holds one of the ``TURNS_AT_WORK`` places."""

    def __init__(self, worker: DeliveryWorker[Any], record: DeliveryRecord) -> None:
        self.worker = worker
        self.deliveries = worker.deliveries
        self.record = record
        self._places = worker.at_work  # the worker's ``TURNS_AT_WORK`` places
        self._holding = False
        self._phase = 0  # model calls and ends seen (``aside``)

    async def enter(self) -> None:
        if not self._holding:
            await self._places.acquire()
            self._holding = True

    def leave(self) -> None:
        if self._holding:
            self._holding = False
            self._places.release()

    @contextlib.asynccontextmanager
    async def aside(self) -> AsyncIterator[None]:
        """Give the place up while the body waits; take one again after it unless the turn
        moved on meanwhile (a task of the turn's reply waited while the turn itself reached
        its model call, which gives the place up anyway). A body that raises (the turn is
        stopped) does not take a place again: the turn's end gives back what it holds."""
        if not self._holding:
            yield
            return
        phase = self._phase
        self.leave()
        yield
        if self._phase == phase:
            await self.enter()

    async def observe(self, event: object) -> None:
        if isinstance(event, ModelCalled):
            self._phase += 1
            self.leave()  # from here the turn mostly waits on its model
        elif isinstance(event, ModelDone):
            self._phase += 1
            await self.enter()  # storing the answer is its own work again

    async def started(self, session_id: int) -> None:
        await self.deliveries.moved(
            self.record.id, ("received", "waiting"), "started", session_id=session_id
        )

    async def replying(self, reply_ref: str) -> None:
        # Known here first: if the database cannot take it now, this process's retry still
        # knows the reply exists and edits it instead of posting the answer a second time.
        self.worker.replies[self.record.id] = reply_ref
        await self.deliveries.set_reply(self.record.id, reply_ref)


@dataclass
class _Waiter:
    """A record waiting here, and how the watch wakes it."""

    record: DeliveryRecord
    event: asyncio.Event = field(default_factory=asyncio.Event)
    expired: bool = False

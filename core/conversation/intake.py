"""Recording received messages, apart from the work of answering them.

A surface acknowledges a message only once its delivery record is written
(``core.storage.deliveries``); answering it is the delivery worker's
(``core.conversation.worker``). The two are split so the recording can run on a loop (and a
thread, and a database engine) of its own: an acknowledgement then never waits behind a turn's
rendering, its calls to the surface or its bookkeeping, however many turns the worker runs.

``Intake`` writes the record and hands it over (``hand_off``, any thread to the worker's loop);
it is also *honest about capacity*: when the worker says it is saturated (``has_room``), the
record is written unowned (no lease), which is exactly how a stopping replica leaves a message
for the others. Any replica with room, this one included once it has some, takes it over
at its next lease upkeep (``Deliveries.take_over``; a released record does not count as a
take-over). Nothing acknowledged is dropped: it is in the database before the answer goes out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from core import metrics
from core.storage import Storage
from core.storage.deliveries import Deliveries, DeliveryRecord

log = logging.getLogger(__name__)

# The log line that says a saturated replica left messages for the others, at most this often.
SHED_LOG_SECONDS = 5.0
# A thread found known (a session, or a recorded message) is remembered this long, so the
# follow-ups of a conversation are recorded without reading the database first: a thread stays
# known unless its session is deleted, and then for at most this long a message in it is taken
# as a follow-up (answered) instead of kept as a stray.
KNOWN_SECONDS = 600.0
KNOWN_MOST = 100_000  # threads remembered at most (the oldest forgotten first)

_NO_THREAD = "-"  # a thread key no surface writes (``Intake.warm``)

# A stray's words as the surface gives them at its adoption: event key -> (text, context).
Words = dict[str, tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Incoming:
    """A message for the agent as a surface received it, not yet recorded: what its delivery
    record holds. ``stray``: of a thread nobody knows yet, maybe a follow-up that overtook its
    thread's first message; recorded as a stray (where and by whom, not its ``text``), adopted
    when that message is carried on."""

    event_key: str
    thread_key: str
    author: str
    message_id: str
    text: str
    context: dict[str, Any]
    stray: bool = False


class Intake:
    """``known_thread`` and ``receive`` for one surface, on whatever loop calls them.

    ``hand_off``: called with each record this replica keeps (it must return at once; from
    another thread it schedules the work on the worker's loop). ``closing`` and ``has_room``
    are asked for every message; both must be cheap and safe from any thread.
    """

    def __init__(
        self,
        deliveries: Deliveries,
        find_thread: Callable[[str], Awaitable[object | None]],
        hand_off: Callable[[DeliveryRecord], None],
        *,
        closing: Callable[[], bool] = lambda: False,
        has_room: Callable[[], bool] = lambda: True,
    ) -> None:
        self.deliveries = deliveries
        self.find_thread = find_thread  # a thread's session (or its surface row), or None
        self.hand_off = hand_off
        self.closing = closing
        self.has_room = has_room
        self._shed = 0  # messages left for other replicas since the last log line
        self._shed_logged = 0.0
        self._lock = threading.Lock()
        self._known: dict[str, float] = {}  # thread -> when it was last found known

    async def known_thread(self, thread: str) -> bool:
        """A session thread, or one whose first message was recorded a moment ago (its
        session may not exist yet when a quick follow-up arrives). Remembered for
        ``KNOWN_SECONDS``: an acknowledgement of a follow-up then reads nothing."""
        seen = self._known.get(thread)
        if seen is not None and time.monotonic() - seen < KNOWN_SECONDS:
            return True
        known = await self.find_thread(thread) is not None or (
            await self.deliveries.thread_known(thread)
        )
        if known:
            self._remember(thread)
        return known

    async def warm(self) -> None:
        """The reads a message's acknowledgement makes (``known_thread``), made once before
        listening on a thread no message has: their statements are then prepared on the
        connections the storage's warm-up opened (``Storage.warm``), not inside the first
        acknowledgement. Nothing is remembered or written."""
        await self.find_thread(_NO_THREAD)
        await self.deliveries.thread_known(_NO_THREAD)

    @classmethod
    def apart(
        cls,
        storage: Storage,
        surface: str,
        *,
        owner: str,
        hand_off: Callable[[DeliveryRecord], None],
        closing: Callable[[], bool],
        has_room: Callable[[], bool],
    ) -> Intake:
        """An intake on storage of its own (an engine for another thread's loop): what it
        records is written as ``owner``, the replica's delivery worker, which renews and moves
        it; a thread is known by the surface's own table. Nothing more is built: recording a
        message needs no agent, model providers or tracer."""
        return cls(
            storage.deliveries(surface, owner=owner),
            storage.surface(surface).get_thread,
            hand_off,
            closing=closing,
            has_room=has_room,
        )

    def _remember(self, thread: str) -> None:
        known = self._known
        known.pop(thread, None)
        known[thread] = time.monotonic()
        if len(known) > KNOWN_MOST:
            del known[next(iter(known))]  # insertion order: the least recently found

    async def receive(
        self, message: Incoming, *, hand_off: Callable[[DeliveryRecord], None] | None = None
    ) -> None:
        """Record a message (before the acknowledgement: a failure here fails the request, so
        the sender sends it again), then hand it to the worker, or leave it to any replica with
        room when this one has none (or is stopping). A stray is recorded as such and adopted
        when its thread's first message is carried on.
        ``hand_off``: in place of the intake's own, for this message (and strays it adopts).
        """
        hand_off = hand_off or self.hand_off
        stray = message.stray
        keep = not self.closing()
        shed = keep and not stray and not self.has_room()
        record = await self.deliveries.record(
            event_key=message.event_key,
            thread_key=message.thread_key,
            author=message.author,
            message_id=message.message_id,
            text=message.text,
            context=message.context,
            owned=keep and not shed,
            stray=stray,
        )
        if not stray:
            self._remember(message.thread_key)  # recorded (now or before): its thread is known
        if record is None:
            log.debug("message %s already recorded", message.event_key)
        elif stray:
            # The thread's first message may have been recorded while this one was checked;
            # its carrier adopts the strays it sees, this looks once more for the rest: the
            # stray itself goes to the worker, which adopts its thread's strays (reading their
            # words from the surface takes the worker's client for the workspace).
            if not self.closing() and await self.known_thread(message.thread_key):
                hand_off(record)
        elif shed:
            self._count_shed(message.event_key)
        elif keep:
            hand_off(record)

    async def adopt(
        self,
        thread: str,
        hand_off: Callable[[DeliveryRecord], None],
        words: Callable[[list[DeliveryRecord]], Awaitable[Words | None]],
    ) -> None:
        """The strays of ``thread`` (now known), recorded as this replica's and handed off.

        ``words``: the surface's text and context of each stray, by event key (a stray it has
        none for was deleted there, and is dropped); None when the surface could not say, and
        the strays are left for the thread's next carrier (or the sweep)."""
        strays = await self.deliveries.strays(thread)
        if not strays:
            return  # the usual case: one read
        found = await words(strays)
        if found is None:
            log.warning("thread %s: %d stray(s) not adopted yet", thread, len(strays))
            return
        asked = [stray.event_key for stray in strays]
        for adopted in await self.deliveries.adopt_strays(thread, found, asked):
            log.info("message %s: its thread is known now; answering it", adopted.event_key)
            hand_off(adopted)

    def _count_shed(self, event_key: str) -> None:
        metrics.MESSAGES_SHED.inc()
        with self._lock:
            self._shed += 1
            now = time.monotonic()
            if now - self._shed_logged < SHED_LOG_SECONDS:
                return
            shed, self._shed, self._shed_logged = self._shed, 0, now
        log.warning(
            "saturated: left %d message(s) (the last %s) recorded for any replica with room",
            shed,
            event_key,
        )

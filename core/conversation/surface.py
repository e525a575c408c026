"""What the delivery worker needs from the surface whose messages it carries, and the few
values they exchange: the outcome of a try, what a waiting poster is told, what came of a click.

A surface implements ``DeliverySurface`` (the Slack one is ``bot.answers.ThreadAnswers``):
answering in its own way (a thread, a stream), telling and offering in its own words, and
reaching its people (``C``: for Slack, a Web API client).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, TypeVar

from core.storage.deliveries import DeliveryRecord

C = TypeVar("C")  # what reaches the surface's people: a Slack Web API client


class Outcome(enum.Enum):
    """What came of one try at a record."""

    ANSWERED = "answered"  # answered now, or found answered (or interrupted) already
    BUSY = "busy"  # the session's lock is held elsewhere; nothing was written
    STALE = "stale"  # the session moved on elsewhere; the poster was shown what changed


class WaitingNotice(enum.Enum):
    """What the poster of a record is told while it waits, or when it cannot be answered."""

    FOLLOW_UP = "follow_up"  # waits behind its thread's own turn
    QUEUED = "queued"  # waits, in order, for a session busy elsewhere (``BUSY_MODE=queue``)
    BUSY = "busy"  # the session is in use elsewhere; offered when free (``BUSY_MODE=ask``)
    TIMED_OUT = "timed_out"  # waited longer than ``BUSY_POLL_TIMEOUT_SECONDS``
    GAVE_UP = "gave_up"  # taken over too many times, or no way to reach its workspace


class ClickAnswer(enum.Enum):
    """What came of a person's Send or Discard on an offer."""

    SENDING = "sending"
    DISCARDED = "discarded"
    GONE = "gone"  # already sent, discarded or expired


class DeliverySurface(Protocol[C]):
    """What the worker needs from the surface whose messages it carries."""

    async def answer(
        self, record: DeliveryRecord, client: C, *, resumed: bool, progress: Progress
    ) -> Outcome:
        """One try at answering ``record`` now (through the conversation API)."""

    async def tell(self, record: DeliveryRecord, client: C, notice: WaitingNotice) -> None:
        """Tell the record's poster ``notice``; a notice that fails never stops the work."""

    async def offer(self, record: DeliveryRecord, client: C, *, stale: bool) -> bool:
        """Offer Send (or Send anyway) / Discard to the poster; False when it was not posted."""

    async def words(
        self, strays: list[DeliveryRecord], client: C
    ) -> dict[str, tuple[str, dict[str, Any]]] | None:
        """The text and context of each stray of one thread (by event key), read from the
        surface, which keeps what was said (a stray record does not); a stray missing from the
        result no longer exists there. None when the surface could not be read."""

    async def client_for(self, record: DeliveryRecord) -> C | None:
        """What reaches the record's workspace outside a request (a take-over); None when
        nothing does (the app was removed from it)."""


class Progress(Protocol):
    """What a try tells its record while it runs (the worker keeps it)."""

    async def started(self, session_id: int) -> None:
        """The claim held: the user message is in the transcript."""

    async def replying(self, reply_ref: str) -> None:
        """The reply's first message exists on the surface (a take-over finishes it)."""

    async def observe(self, event: object) -> None:
        """Every event of the turn: the worker keeps the turns' own work in check with them."""

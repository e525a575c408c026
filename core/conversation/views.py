"""What a surface has shown of a session, and what it has not shown yet.

Every surface passes the last message it showed as the turn's ``last_message_id`` (the stale
guard), so where that mark is kept is the one thing surfaces differ in: the Slack surface keeps
it per thread in the database (any replica answers the thread), the terminal in memory (one
process, one person). ``View`` is that mark; ``unseen`` is the one definition of "what was added
or changed since": used for a stale refusal's refresh, for the terminal's idle watch and for
the Slack thread's one-shot refresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from core.records import StoredMessage
from core.storage import SessionStore, SurfaceState

# After a rewind elsewhere the message last shown is gone: this many of the latest messages are
# what the surface is shown instead (a refresh quotes at most this many in any case).
REFRESH_LAST = 10


@dataclass(frozen=True)
class Unseen:
    """Messages a surface had not shown, oldest first."""

    messages: list[StoredMessage]
    rewound: bool  # the message last shown is gone: the session was rewound elsewhere


class View(Protocol):
    """Where a surface keeps the id of the last message it showed of one session."""

    async def shown(self) -> str | None: ...

    async def show(self, message_id: str | None) -> None: ...


class MemoryView:
    """A mark kept by the process itself (the terminal: nobody else shows its screen)."""

    def __init__(self, shown: str | None = None) -> None:
        self._shown = shown

    async def shown(self) -> str | None:
        return self._shown

    async def show(self, message_id: str | None) -> None:
        self._shown = message_id


class ThreadView:
    """A mark kept in the surface's tables (``surface_threads``), shared by every replica."""

    def __init__(self, state: SurfaceState, thread_key: str, session_id: int) -> None:
        self._state = state
        self._key = thread_key
        self._session_id = session_id

    async def shown(self) -> str | None:
        thread = await self._state.get_thread(self._key)
        return thread.last_shown_message_id if thread else None

    async def show(self, message_id: str | None) -> None:
        await self._state.set_shown(self._session_id, message_id)


async def unseen(store: SessionStore, session_id: int, shown: str | None) -> Unseen:
    """The messages after ``shown``, read from there on (never the whole transcript); when
    ``shown`` is gone (rewound elsewhere), the last ``REFRESH_LAST``. Nothing when the tail is
    still ``shown``: one small read when nothing happened."""
    tail = await store.tail(session_id)
    if (tail.message_id if tail else None) == shown:
        return Unseen([], False)
    if shown is None:
        return Unseen(await store.messages(session_id), False)
    found = await store.find_message(shown)
    if found is None or found[0] != session_id:
        start = tail.position - REFRESH_LAST if tail else -1
        return Unseen(await store.messages(session_id, after_position=start), True)
    return Unseen(await store.messages(session_id, after_position=found[1].position), False)

"""What ``bench --compare`` asks of each contender: append a message, load the history, run a
writer's turn; and slack-agent's own side of it.

Ours appends each message as a whole turn (``core.turn.run_turn``: the stale guard against the
tail it last saw, the claim of the turn lock, the message, the release), never a bare insert: the
comparison is our full turn against a peer's bare append. Its writers retry, like a queued Slack
message, when the session is busy or their view is stale.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from core.db import create_database
from core.errors import AgentSessionBusy, AgentSessionStale
from core.messages import assistant_message, message_text, user_message
from core.migrate import upgrade
from core.store import SessionStore
from core.turn import run_turn


@dataclass(frozen=True)
class Item:
    role: str  # "user" or "assistant"
    text: str


class Conversation(abc.ABC):
    """One conversation in one contender's storage."""

    @abc.abstractmethod
    async def append(self, item: Item) -> None:
        """Store one more message at the end."""

    @abc.abstractmethod
    async def load(self) -> list[str]:
        """The texts of the whole history, oldest first."""

    async def turn(
        self, question: Item, answer: Item, think: Callable[[], Awaitable[None]]
    ) -> None:
        """A writer's turn: the question, the model thinking, the answer (no lock of its own)."""
        await self.append(question)
        await think()
        await self.append(answer)


class Ours(Conversation):
    def __init__(self, store: SessionStore, session_id: int) -> None:
        self.store = store
        self.session_id = session_id
        self.last: str | None = None  # the tail this client has seen (the stale guard's input)

    async def append(self, item: Item) -> None:
        if item.role == "user":
            question, answers = user_message(item.text), []
        else:
            question, answers = None, [assistant_message(item.text)]
        async with run_turn(
            self.store, self.session_id, user_message=question, last_message_id=self.last
        ) as turn:
            stored = await turn.finish(answers)
        self.last = stored[-1].message_id if stored else (question or {}).get("id")

    async def load(self) -> list[str]:
        return [message_text(m.message) for m in await self.store.history(self.session_id)]

    async def turn(
        self, question: Item, answer: Item, think: Callable[[], Awaitable[None]]
    ) -> None:
        while True:
            tail = await self.store.tail(self.session_id)
            try:
                async with run_turn(
                    self.store,
                    self.session_id,
                    user_message=user_message(question.text),
                    last_message_id=tail.message_id if tail else None,
                ) as turn:
                    await think()
                    await turn.finish([assistant_message(answer.text)])
                return
            except (AgentSessionBusy, AgentSessionStale):
                await asyncio.sleep(0.002)  # the product queues the message; here: try again


@contextlib.asynccontextmanager
async def ours(url: str, conversation: str) -> AsyncIterator[Conversation]:
    db = create_database(url)
    try:
        await upgrade(db)
        store = SessionStore(db, staleness_seconds=60)
        session, _ = await store.get_or_create_session("bench-compare", conversation, user_id=None)
        yield Ours(store, session.id)
    finally:
        await db.dispose()

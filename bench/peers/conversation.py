"""What ``bench --compare`` asks of each contender: append a message, load the history, run a
writer's turn; and slack-agent's own side of it.

Ours appends the conversation as the product stores it, in whole turns
(``core.agent.turn.run_turn``): a question opens a turn (the stale guard against the tail it last
saw, the claim of the turn lock and the question, one transaction) and the answer closes it (the
fence, the answer and the release, one transaction). Every message is still appended, and timed, on
its own, never as a bare insert: per message, our cost is half a full locked, guarded turn, which is
what a turn costs the product per message it keeps. (Until 2026-12-01 every message was a turn of
its own, two transactions for one message, a turn the product never runs: a claim with no question
or a release with no answer.) Its writers retry, like a queued Slack message, when the session is
busy or their view is stale.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from core.agent.turn import Turn, run_turn
from core.errors import AgentSessionBusy, AgentSessionStale
from core.messages import Message, assistant_message, message_text, user_message
from core.settings import Settings
from core.storage import Storage
from core.storage.sessions import SessionStore


@dataclass(frozen=True)
class Item:
    role: str  # "user" or "assistant"
    text: str


class PeerConversation(abc.ABC):
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


class Ours(PeerConversation):
    def __init__(self, store: SessionStore, session_id: int) -> None:
        self.store = store
        self.session_id = session_id
        self.last: str | None = None  # the tail this client has seen (the stale guard's input)
        self._open: tuple[contextlib.AsyncExitStack, Turn] | None = None  # a question's turn

    async def append(self, item: Item) -> None:
        if item.role == "user":
            await self._close([])  # two questions in a row: the first went unanswered
            question = user_message(item.text)
            await self._start(question)
            self.last = question["id"]
            return
        if self._open is None:  # an answer with no question before it: a turn of its own
            await self._start(None)
        await self._close([assistant_message(item.text)])

    async def _start(self, question: Message | None) -> None:
        stack = contextlib.AsyncExitStack()
        turn = await stack.enter_async_context(
            run_turn(self.store, self.session_id, user_message=question, last_message_id=self.last)
        )
        self._open = (stack, turn)

    async def _close(self, answers: list[Message]) -> None:
        if self._open is None:
            return
        (stack, turn), self._open = self._open, None
        async with stack:
            stored = await turn.finish(answers)
        if stored:
            self.last = stored[-1].message_id

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
async def ours(url: str, conversation: str) -> AsyncIterator[PeerConversation]:
    storage = Storage.open(Settings(database_url=url))
    try:
        await storage.migrate()
        store = storage.sessions
        session, _ = await store.get_or_create_session("bench-compare", conversation, user_id=None)
        mine = Ours(store, session.id)
        try:
            yield mine
        finally:
            await mine._close([])  # a question left unanswered: release its turn
    finally:
        await storage.dispose()

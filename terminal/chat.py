"""One terminal's hold on a session: what it has shown, and every core call it makes.

No terminal I/O here and no SQL: the session store, the agent and the permalink lookups of
``core``, exactly as the Slack side uses them. The client's view of the session is ``shown``,
the id of the last message it printed; every turn passes it as ``last_message_id``, so the
core refuses a send into a session that moved on elsewhere (stale) before any model call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from core.agent.loop import Agent, AgentConfig, AgentEvent, OnEvent, TurnResult, TurnStarted
from core.agent.model_choice import ProviderCache
from core.errors import MessageNotFound, UsageError
from core.messages import user_message
from core.operator import operator_external_id
from core.permalinks import looks_like_link, permalink_of_session, session_for_permalink
from core.records import Actor, BranchResult, SessionInfo, StoredMessage, TruncateResult
from core.settings import Settings
from core.storage.engine import Database, create_database
from core.storage.migrate import upgrade
from core.storage.sessions import SessionStore
from core.storage.snapshots import messages_with_snapshots

PROJECT = "cli"  # sessions started from the terminal: project_session_id is "<login>/<uuid>"
REFRESH_LAST = 10  # after a rewind elsewhere, how many of the latest messages are reprinted


@dataclass(frozen=True)
class Unseen:
    messages: list[StoredMessage]
    rewound: bool  # the message last shown is gone: the session was rewound elsewhere


class ChatSession:
    def __init__(
        self, settings: Settings, db: Database, store: SessionStore, providers: ProviderCache
    ) -> None:
        self.settings = settings
        self.db = db
        self.store = store
        self.providers = providers
        self.agent = Agent(
            store,
            providers,
            AgentConfig(
                auto_compact_tokens=settings.auto_compact_tokens,
                heartbeat_seconds=settings.turn_heartbeat_seconds,
            ),
        )
        self.operator = operator_external_id()
        self.actor = Actor(None, admin=True)
        self.session: SessionInfo | None = None
        self.shown: str | None = None  # the last message this terminal printed
        self._sent: StoredMessage | None = None  # the user message of the latest turn

    @classmethod
    async def open(cls, settings: Settings, target: str | None) -> ChatSession:
        """Resolve ``target`` (a session id, a Slack permalink, or None for a new session).

        Raises ``UsageError`` for something that is neither, ``AgentSessionNotFound`` for an
        id or link that names no session, ``DatabaseError`` when the database cannot be used.
        """
        session_id = _session_id(target) if target is not None else None
        db = create_database(
            settings.database_url, synchronous_commit=settings.postgres_synchronous_commit
        )
        store = SessionStore(
            db,
            staleness_seconds=settings.turn_lock_staleness_seconds,
            temporary_ttl_hours=settings.temporary_agent_session_time_to_live_hours,
        )
        chat = cls(settings, db, store, ProviderCache(settings))
        try:
            await upgrade(db)
            user_id = await store.get_or_create_user(chat.operator, "local operator")
            chat.actor = Actor(user_id, admin=True)
            if target is not None and session_id is None:
                session_id = await session_for_permalink(db, target)
            if session_id is not None:
                chat.session = await store.get_session(session_id)
        except BaseException:
            await chat.close()
            raise
        return chat

    async def close(self) -> None:
        await self.providers.aclose()
        await self.db.dispose()

    @property
    def session_id(self) -> int | None:
        return None if self.session is None else self.session.id

    async def owner(self) -> str | None:
        """Who owns the session when it is not this operator (None when it is, or nobody)."""
        if self.session is None or self.session.user_id in (None, self.actor.user_id):
            return None
        assert self.session.user_id is not None
        return await self.store.user_external_id(self.session.user_id) or (
            f"user #{self.session.user_id}"
        )

    async def permalink(self, session_id: int | None = None) -> str | None:
        target = session_id if session_id is not None else self.session_id
        return None if target is None else await permalink_of_session(self.db, target)

    # -- reading ------------------------------------------------------------------------------

    async def projected(self) -> list[StoredMessage]:
        """What the model sees (the latest checkpoint and what follows); now shown."""
        if self.session is None:
            return []
        history = await self.store.history(self.session.id)
        # The projection ends at the tail it was read with: what was printed is what was seen.
        self.shown = history[-1].message_id if history else None
        return history

    async def unseen(self) -> Unseen:
        """What was added (or changed) since this terminal last showed the session; now shown."""
        if self.session is None:
            return Unseen([], False)
        sid = self.session.id
        tail = await self.store.tail(sid)
        tail_id = tail.message_id if tail else None
        if tail_id == self.shown:
            return Unseen([], False)
        found = await self.store.find_message(self.shown) if self.shown else None
        if self.shown is not None and (found is None or found[0] != sid):
            start = tail.position - REFRESH_LAST if tail else -1
            result = Unseen(await self.store.messages(sid, after_position=start), True)
        else:
            after = found[1].position if found else -1
            result = Unseen(await self.store.messages(sid, after_position=after), False)
        self.shown = result.messages[-1].message_id if result.messages else tail_id
        return result

    async def is_busy(self) -> bool:
        return self.session is not None and await self.store.is_turn_active(self.session.id)

    async def listing(self) -> tuple[list[StoredMessage], set[str]]:
        """The whole transcript and which of its messages carry a sandbox snapshot."""
        if self.session is None:
            return [], set()
        sid = self.session.id
        return await self.store.messages(sid), await messages_with_snapshots(self.db, sid)

    # -- a turn -------------------------------------------------------------------------------

    async def send(self, text: str, on_event: OnEvent) -> TurnResult:
        """One turn. Raises ``AgentSessionBusy`` / ``AgentSessionStale`` before anything is
        written; the events say when the user message is in the transcript (``TurnStarted``)."""
        if self.session is None:
            self.session, _ = await self.store.get_or_create_session(
                PROJECT,
                f"{self.operator.removeprefix('cli:')}/{uuid.uuid4()}",
                user_id=self.actor.user_id,
                title=text,
            )
        self._sent = None

        async def noted(event: AgentEvent) -> None:
            if isinstance(event, TurnStarted):
                self._sent = event.user
            await on_event(event)

        result = await self.agent.run_turn(
            self.session.id,
            user_message=user_message(text, surface="terminal", author=self.operator),
            last_message_id=self.shown,
            on_event=noted,
        )
        if result.answer is not None:
            self.shown = result.answer.message_id
        return result

    async def after_interruption(self) -> None:
        """A turn of ours stopped after its message was added (Ctrl-C, a lost lock): what it
        printed was its message and the partial answer kept right after it. Anything later came
        from elsewhere once the lock was free, and the watcher prints it."""
        if self.session is None or self._sent is None:
            return
        after = await self.store.messages(self.session.id, after_position=self._sent.position)
        ours = after[0] if after and after[0].role == "assistant" else None
        self.shown = ours.message_id if ours is not None else self._sent.message_id

    # -- transcript operations ----------------------------------------------------------------

    async def _at(self, position: int) -> StoredMessage:
        if self.session is None:
            raise MessageNotFound(f"no message at position {position}")
        found = await self.store.messages(self.session.id, after_position=position - 1)
        if not found or found[0].position != position:
            raise MessageNotFound(f"no message at position {position}")
        return found[0]

    async def rewind(self, position: int) -> TruncateResult:
        target = await self._at(position)
        assert self.session is not None
        result = await self.store.truncate(self.session.id, target.message_id, self.actor)
        self.shown = result.tail_message_id
        return result

    async def fork(self, position: int) -> BranchResult:
        target = await self._at(position)
        assert self.session is not None
        return await self.store.branch(
            self.session.id,
            target.message_id,
            user_id=self.actor.user_id,
            project_name=PROJECT,
            project_session_id=f"{self.operator.removeprefix('cli:')}/{uuid.uuid4()}",
        )

    async def compact(self, focus: str | None) -> StoredMessage:
        assert self.session is not None
        return await self.agent.compact(self.session.id, self.actor, focus=focus)


def _session_id(target: str) -> int | None:
    """A session id, or None for something that must be a permalink."""
    value = target.strip()
    if value.isdigit():
        return int(value)
    if looks_like_link(value):
        return None
    raise UsageError(
        f"SESSION must be a session id (as `slack-agent sessions list` prints it) or the Slack "
        f"permalink of a message in its thread, not {target!r}"
    )

"""One terminal's hold on a session: the terminal's translation onto the conversation API.

No terminal I/O here and no storage: the core runtime and the conversation API, exactly as
the Slack side uses them. The terminal keeps its view of the session in memory (the last
message it printed); every turn passes it as ``last_message_id``, so the core refuses a send
into a session that moved on elsewhere (stale) before any model call.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from core.conversation import (
    Actor,
    ApprovalRecord,
    Arrival,
    Attachments,
    BeforeTurn,
    Began,
    Choice,
    Conversation,
    Conversations,
    DecisionRecorded,
    DecisionRefused,
    Forked,
    MemoryView,
    Payer,
    Renderer,
    Rewound,
    SessionInfo,
    StoredMessage,
    TurnEnd,
    TurnEvent,
    Unseen,
)
from core.conversation.places import SLACK_PROJECT, SLACK_SURFACE, TERMINAL_PROJECT
from core.errors import MessageNotFound, UsageError
from core.runtime import Runtime, Settings, operator_external_id
from terminal.permalinks import (
    looks_like_link,
    permalink_of_session,
    session_for_permalink,
)

PROJECT = TERMINAL_PROJECT  # project_session_id is "<login>/<uuid>"


class ChatSession:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.conversations: Conversations = runtime.conversations(PROJECT)
        # The Slack surface's threads, read to follow a permalink and to name a fork's thread.
        self.slack: Conversations = runtime.conversations(SLACK_PROJECT, surface=SLACK_SURFACE)
        self.operator = operator_external_id()
        self.actor = Actor(None, admin=True)
        self.conversation: Conversation | None = None
        self.view = MemoryView()  # the last message this terminal printed (the stale guard)

    @classmethod
    async def open(cls, settings: Settings, target: str | None) -> ChatSession:
        """Resolve ``target`` (a session id, a Slack permalink, or None for a new session).

        Raises ``UsageError`` for something that is neither, ``AgentSessionNotFound`` for an
        id or link that names no session, ``DatabaseError`` when the database cannot be used.
        """
        session_id = _session_id(target) if target is not None else None
        runtime = await Runtime.open(settings)
        chat = cls(runtime)
        try:
            chat.actor = await chat.conversations.person(
                chat.operator, admin=True, display_name="local operator"
            )
            if target is not None and session_id is None:
                session_id = await session_for_permalink(chat.slack, target)
            if session_id is not None:
                chat.conversation = await chat.conversations.get(session_id, view=chat.view)
        except BaseException:
            await chat.close()
            raise
        return chat

    async def close(self) -> None:
        await self.runtime.close()

    @property
    def session_id(self) -> int | None:
        return None if self.conversation is None else self.conversation.id

    @property
    def session(self) -> SessionInfo | None:
        return None if self.conversation is None else self.conversation.session

    async def owner(self) -> str | None:
        """Who owns the session when it is not this operator (None when it is, or nobody)."""
        if self.conversation is None:
            return None
        if self.conversation.session.user_id in (None, self.actor.user_id):
            return None
        return await self.conversation.owner()

    async def permalink(self, session_id: int | None = None) -> str | None:
        """The permalink of the session's Slack thread, when it has one."""
        target = session_id if session_id is not None else self.session_id
        return None if target is None else await permalink_of_session(self.slack, target)

    # -- reading ------------------------------------------------------------------------------

    async def projected(self) -> list[StoredMessage]:
        """What the model sees (the latest checkpoint and what follows); now shown."""
        return [] if self.conversation is None else await self.conversation.projected()

    async def unseen(self) -> Unseen:
        """What was added (or changed) since this terminal last showed the session; now shown."""
        return Unseen([], False) if self.conversation is None else await self.conversation.unseen()

    async def is_busy(self) -> bool:
        return self.conversation is not None and await self.conversation.is_busy()

    async def listing(self) -> tuple[list[StoredMessage], set[str]]:
        """The whole transcript and which of its messages carry a sandbox snapshot."""
        if self.conversation is None:
            return [], set()
        return await self.conversation.listing()

    # -- a turn -------------------------------------------------------------------------------

    async def send(self, text: str, renderer: Renderer) -> TurnEnd:
        """One turn through the conversation door: answered (or ended as the door says), or
        refused before anything was written (busy, stale with what the terminal had not
        shown, now shown). The first message of a new session makes the session."""
        conversation = self.conversation
        arrival = Arrival(
            self.operator,
            text,
            key=None if conversation is not None else self._new_key(),
            session_id=None if conversation is None else conversation.id,
            view=self.view,
            admin=True,
            title=text,
            metadata={"surface": "terminal", "author": self.operator},
            payer=Payer(self.operator),
        )
        return await self.conversations.answer(arrival, _Holding(self, renderer))

    async def after_interruption(self) -> None:
        """A turn of ours stopped after its message was added (Ctrl-C, a lost lock)."""
        if self.conversation is not None:
            await self.conversation.after_interruption()

    # -- tool calls waiting for a person -------------------------------------------------------

    async def pending_approval(self) -> ApprovalRecord | None:
        """The call the session waits on a person for (posted here or in Slack)."""
        return None if self.conversation is None else await self.conversation.pending_approval()

    async def decide(
        self,
        approval_id: str | None,
        approve: bool,
        renderer: Renderer,
        *,
        reason: str | None = None,
    ) -> TurnEnd | DecisionRefused:
        """``/approve`` or ``/deny`` the call this terminal printed (the terminal is the local
        operator, an admin), with what the person said (``reason``): one decision wins,
        wherever it is made, and it is carried out here, as a turn."""
        if self.conversation is None or approval_id is None:
            return DecisionRefused("unknown")
        choice = Choice(
            approval_id, self.operator, approve, admin=True, by=self.operator, reason=reason
        )
        decided = await self.conversations.decide(
            choice, _Holding(self, renderer), payer=Payer(self.operator), view=self.view
        )
        assert not isinstance(decided, DecisionRecorded)  # a renderer carries it out here
        return decided

    async def left_behind(self) -> ApprovalRecord | None:
        """A decision on this session that the process making it never carried out (a client
        killed right after ``/approve``), once older than the staleness window."""
        desk = self.conversations.approvals
        if self.conversation is None or desk is None:
            return None
        found = await desk.left_behind(
            self.settings.turn_lock_staleness_seconds, session_id=self.conversation.id
        )
        return found[0] if found else None

    async def carry_out(self, record: ApprovalRecord, renderer: Renderer) -> TurnEnd:
        """Carry out a decision left behind, here (the claim, the stale guard and
        ``start_running`` keep the call to one run, whoever else picks it up)."""
        assert self.conversation is not None
        arrival = Arrival(
            self.operator,
            session_id=self.conversation.id,
            view=self.view,
            approval=record.id,
            payer=Payer(record.decided_by or self.operator),
        )
        return await self.conversations.answer(arrival, _Holding(self, renderer))

    # -- transcript operations ----------------------------------------------------------------

    async def rewind(self, position: int) -> tuple[Rewound, tuple[str, ...]]:
        """The rewind, and the MCP calls in what left that it could not undo."""
        conversation, target = await self._at(position)
        plan = await conversation.rewind_plan(target.message_id)
        done = await conversation.rewind(target.message_id, self.actor)
        return done, () if plan is None else plan.outside

    async def fork(self, position: int) -> Forked:
        conversation, target = await self._at(position)
        return await conversation.fork(target.message_id, self.actor, self._new_key())

    async def compact(self, focus: str | None) -> StoredMessage:
        assert self.conversation is not None
        return await self.conversation.compact(self.actor, focus=focus)

    async def _at(self, position: int) -> tuple[Conversation, StoredMessage]:
        if self.conversation is None:
            raise MessageNotFound(f"no message at position {position}")
        return self.conversation, await self.conversation.at_position(position)

    def _new_key(self) -> str:
        return f"{self.operator.removeprefix('cli:')}/{uuid.uuid4()}"


class _Holding:
    """The terminal's renderer, holding on to the conversation a first message made."""

    def __init__(self, chat: ChatSession, inner: Renderer) -> None:
        self._chat = chat
        self._inner = inner

    async def prepare(self, before: BeforeTurn) -> Attachments:
        return await self._inner.prepare(before)

    async def event(self, event: TurnEvent) -> None:
        if isinstance(event, Began) and self._chat.conversation is None:
            self._chat.conversation = event.conversation
        await self._inner.event(event)

    async def finish(self, end: TurnEnd) -> Sequence[str]:
        return await self._inner.finish(end)

    async def abandoned(self, error: BaseException) -> None:
        await self._inner.abandoned(error)


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

"""What goes into a turn and what comes out of the conversation API, as plain values.

Refusals a surface renders as part of its normal flow are values here (``Busy``, ``Stale``,
``AlreadyAnswered``, ``OverBudget``), not exceptions: every surface branches on them the same
way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.agent.accounting import Payer
from core.agent.loop import AgentEvent, TurnResult
from core.conversation.views import Unseen
from core.errors import AgentSessionBudgetExceeded
from core.records import StoredMessage
from core.storage.approvals import ApprovalRecord


@dataclass(frozen=True)
class TurnRequest:
    """A person's message for a turn, as a surface received it.

    ``message_id``: the id the surface derives for it (Slack: from the message's coordinates,
    so a retry can never store it twice); None for a new one. ``ref``: the surface's own name
    for the message (a Slack message's key), remembered so the message can be found from the
    surface later. ``metadata``: who and where, kept on the stored message. ``resume``: the
    message was received by a replica that died or stopped, so it may already be in the
    transcript, or answered; the transcript decides. ``sent_anyway``: the person was told the
    session was in use elsewhere and chose to send, so a session that moved on meanwhile is
    shown to them (``Refreshed``) and the message goes, without a second question.
    ``payer``: whose budgets the turn draws on (the person and their workspace); ``None``
    only a deployment-wide budget applies. ``author``: the person who wrote it (a call the
    model asks approval for is recorded as theirs; None: shown as the owner's).
    """

    text: str
    message_id: str | None = None
    ref: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    context: str | None = None
    files: Mapping[str, bytes] | None = None
    resume: bool = False
    sent_anyway: bool = False
    payer: Payer | None = None
    author: str | None = None


@dataclass(frozen=True)
class Answered:
    """The turn ran (its answer may be partial: ``result.error``)."""

    result: TurnResult


@dataclass(frozen=True)
class Busy:
    """The session's lock is held elsewhere; nothing was written."""


@dataclass(frozen=True)
class Stale:
    """The session moved on since the surface last showed it; the message was not added. The
    view now shows the current tail: ``unseen`` is what the surface must show the person."""

    unseen: Unseen


@dataclass(frozen=True)
class AlreadyAnswered:
    """A resumed message that the transcript shows answered (``answer``, when it is the next
    message) or overtaken: nothing runs again. Through the door (``Conversations.answer``):
    ``shown``, whether a surface recorded showing the answer whole, and ``waiting``, the tool
    call the conversation waits on (its card may never have been posted)."""

    answer: StoredMessage | None
    shown: bool = True
    waiting: ApprovalRecord | None = None


@dataclass(frozen=True)
class OverBudget:
    """The payer is over a spending limit: nothing was written and no model was called.
    ``refusal`` names the limit (``limit``, ``describe``-able values) and ``resets_at``."""

    refusal: AgentSessionBudgetExceeded


TurnOutcome = Answered | Busy | Stale | AlreadyAnswered | OverBudget


@dataclass(frozen=True)
class Refreshed:
    """Emitted before a turn sent anyway: what changed elsewhere, for the surface to show."""

    unseen: Unseen


@dataclass(frozen=True)
class PickingUp:
    """Emitted before a resumed turn answers a message a dead turn left unanswered."""


ConversationEvent = AgentEvent | Refreshed | PickingUp
OnConversationEvent = Callable[[ConversationEvent], Awaitable[None]]


@dataclass(frozen=True)
class RewindPlan:
    """What a rewind to a message would do, for the surface's confirmation."""

    leaving: int  # messages that would leave the conversation
    to_a_question: bool  # the target itself goes and comes back as a draft
    # MCP calls that went out in the leaving messages: a rewind cannot undo what they did
    # outside the conversation (each as ``tool {arguments}``, shortened).
    outside: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rewound:
    deleted: int
    draft: str | None
    draft_metadata: Mapping[str, Any]  # who wrote the withdrawn message (its ``metadata``)
    # The surface's replies that stood for messages now gone: (ref, the text they showed).
    withdrawn_replies: list[tuple[str, str]]

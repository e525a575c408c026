"""The one door every surface answers through: what arrived and a renderer in, one outcome out.

A surface (Slack, the terminal, the HTTP API) differs from another only in how it shows a
turn: a Slack reply streaming into a thread, lines in a terminal, a UI message stream over HTTP.
Everything else is the same for all of them and lives here once: who the person is, which
conversation the message belongs to (made if needed), the turn with its stale guard and resume
rules, the "shown" bookkeeping afterwards, and the folding of every way a turn can end (returned
refusals, a lost lock, an interruption, a failed model request) into one closed union,
``TurnEnd``. A surface branches on that union and on nothing else.

The renderer receives the turn's events in one shape (``TurnEvent``): a shell command and an
MCP call are both ``ToolBegan``/``ToolEnded``, so a surface writes one tool renderer.

Decisions on tool calls come through the same door (``decide``): who may decide, the decision
itself, and, for surfaces that carry it out in place (the terminal, the HTTP API), the turn that
runs the call. Slack carries its decisions out from a durable delivery record instead
(``answer`` with ``Arrival.approval``), so a click survives a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from core.agent.accounting import Payer
from core.agent.loop import (
    McpCallFinished,
    McpCallStarted,
    ModelCalled,
    ModelDone,
    Notice,
    TextChunk,
    ToolFinished,
    ToolStarted,
    TurnResult,
    TurnStarted,
)
from core.conversation.approvals import Decided, DecisionRefused
from core.conversation.outcomes import (
    AlreadyAnswered,
    Answered,
    Busy,
    ConversationEvent,
    OverBudget,
    PickingUp,
    Refreshed,
    Stale,
    TurnOutcome,
    TurnRequest,
)
from core.conversation.views import View
from core.errors import (
    AgentSessionBudgetExceeded,
    AgentSessionLockLost,
    SlackAgentError,
    TurnInterrupted,
)
from core.records import StoredMessage
from core.storage.approvals import ApprovalRecord

if TYPE_CHECKING:
    from core.conversation.conversations import Conversation, Conversations


# -- what arrives ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """What arrived at a surface for a turn: who, where, and what they said.

    Where: ``key`` (the surface's own name for the conversation, e.g. a Slack thread; made
    when there is none yet) or ``session_id`` (an existing session, any surface's). ``view``:
    where the surface keeps the last message it showed, when it keeps it itself (the terminal
    in memory, an HTTP client in its request's ``lastMessageId``); None uses the surface's
    tables (a Slack thread's). ``approval``: instead of a new message, carry out this recorded
    decision (``payer`` pays for it). ``viewer``: the key of what the person is looking at,
    whose note the renderer's ``prepare`` receives. The other fields are ``TurnRequest``'s.
    """

    person: str
    text: str = ""
    key: str | None = None
    session_id: int | None = None
    view: View | None = None
    admin: bool = False
    display_name: str | None = None
    title: str | None = None
    temporary: bool = False
    message_id: str | None = None
    ref: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, bytes] | None = None
    resume: bool = False
    sent_anyway: bool = False
    payer: Payer | None = None
    approval: str | None = None
    viewer: str | None = None


@dataclass(frozen=True)
class Choice:
    """A person's decision on a tool call that waits: ``approver_id`` is how a server's
    ``approvers`` name them (``T…:U…``; None when they cannot), ``by`` how the outcome names
    them."""

    approval_id: str
    person: str
    approve: bool
    admin: bool = False
    approver_id: str | None = None
    by: str | None = None
    # A surface that names its places: the request must be in a conversation whose key starts
    # with ``within`` (a Slack workspace's ``T…/``), else it is refused as unknown (a tampered
    # id, another workspace's); ``shown_at`` is where the person saw it (a card), kept as its
    # place when none is stored yet and the person may decide.
    within: str | None = None
    shown_at: str | None = None
    # What the person said with the decision (at most ``DECISION_REASON_MOST`` characters; a
    # surface refuses a longer one before deciding).
    reason: str | None = None


@dataclass(frozen=True)
class BeforeTurn:
    """Before the turn: ``fresh`` (the conversation has no message yet: a surface may add what
    came before the agent was called) and what the person is looking at (``Arrival.viewer``)."""

    conversation: Conversation
    fresh: bool
    viewing: dict[str, Any] | None


@dataclass(frozen=True)
class Attachments:
    """What the renderer gathered beside the message: notes the model reads with it, files
    copied into the sandbox."""

    context: str | None = None
    files: Mapping[str, bytes] | None = None


# -- what a turn shows, in one shape ---------------------------------------------------------------


@dataclass(frozen=True)
class Began:
    """The claim held; the person's message is in the transcript (``picked_up``: a turn a dead
    one left is answered from what it stored)."""

    conversation: Conversation
    user: StoredMessage | None
    picked_up: bool
    answer_id: str = ""  # the id the answer will be stored under


@dataclass(frozen=True)
class Said:
    text: str


ToolKind = Literal["shell", "mcp"]


@dataclass(frozen=True)
class ToolBegan:
    """A tool call goes out: ``label`` is what a person reads (the shell command, the MCP
    tool's name)."""

    call_id: str
    name: str
    kind: ToolKind
    label: str
    input: Mapping[str, Any]


@dataclass(frozen=True)
class ToolEnded:
    """A tool call came back. ``seconds``: the tool's own time (an MCP server's round trip;
    0 for the shell, which runs in-process), so a turn's own work can be told apart from it."""

    call_id: str
    name: str
    kind: ToolKind
    label: str
    ok: bool
    exit_code: int
    output: str
    error: str
    structured: Any = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Told:
    """Something the person is told once (a provider fallback, an automatic compaction)."""

    text: str


TurnEvent = (
    Began | Said | ToolBegan | ToolEnded | Told | Refreshed | PickingUp | ModelCalled | ModelDone
)


# -- how it ends -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failed:
    """The turn ran and failed part-way (a model error or time-out): the partial answer is
    kept, marked interrupted; ``code`` is the error's stable code."""

    result: TurnResult
    code: str


@dataclass(frozen=True)
class BudgetRanOut:
    """The payer crossed a limit while the turn ran: the model request in flight finished,
    then the turn stopped (the partial answer kept)."""

    result: TurnResult
    refusal: AgentSessionBudgetExceeded


@dataclass(frozen=True)
class LockLost:
    """Another replica took the session over (this one was cut off or paused); the partial
    answer was kept where the fencing allowed."""


@dataclass(frozen=True)
class Interrupted:
    """The person stopped the turn (a stop button, ``/stop``); the partial answer is kept."""


TurnEnd = (
    Answered
    | Failed
    | BudgetRanOut
    | LockLost
    | Interrupted
    | Busy
    | Stale
    | OverBudget
    | AlreadyAnswered
)


@dataclass(frozen=True)
class DecisionRecorded:
    """The decision is recorded; the surface carries it out its own way (Slack: a delivery).
    ``key``: its conversation's, when the choice named a place (``Choice.within``)."""

    record: ApprovalRecord
    key: str | None = None


class Renderer(Protocol):
    """A surface's half of a turn. ``finish`` shows how the turn ended and returns the
    surface's references for the answer it showed (a Slack reply's messages), which the door
    records so the answer is never shown twice. ``abandoned`` is told of an exception that
    ends the turn without an outcome (a database failure, a shutdown past its grace) before it
    propagates: a surface closes what it left open."""

    async def prepare(self, before: BeforeTurn) -> Attachments: ...

    async def event(self, event: TurnEvent) -> None: ...

    async def finish(self, end: TurnEnd) -> Sequence[str]: ...

    async def abandoned(self, error: BaseException) -> None: ...


class QuietRenderer:
    """A renderer that shows nothing: the base a surface overrides what it needs of."""

    async def prepare(self, before: BeforeTurn) -> Attachments:
        return Attachments()

    async def event(self, event: TurnEvent) -> None:
        return None

    async def finish(self, end: TurnEnd) -> Sequence[str]:
        return ()

    async def abandoned(self, error: BaseException) -> None:
        return None


# -- the door --------------------------------------------------------------------------------------


async def answer(conversations: Conversations, arrival: Arrival, renderer: Renderer) -> TurnEnd:
    """See ``Conversations.answer``."""
    conversation = await _conversation(conversations, arrival)
    if conversation is None:  # a decision on a conversation that is gone: nothing to do
        end = AlreadyAnswered(None)
        await renderer.finish(end)
        return end
    if arrival.approval is not None:
        request = TurnRequest(arrival.text)
    else:
        fresh = await conversation.is_empty() if arrival.key is not None else False
        viewing = await conversations.viewing(arrival.viewer) if arrival.viewer else None
        prepared = await renderer.prepare(BeforeTurn(conversation, fresh, viewing))
        request = TurnRequest(
            arrival.text,
            message_id=arrival.message_id,
            ref=arrival.ref,
            metadata=arrival.metadata,
            payer=arrival.payer,
            context=prepared.context,
            files=prepared.files if prepared.files is not None else arrival.files,
            resume=arrival.resume,
            sent_anyway=arrival.sent_anyway,
            author=arrival.person,
        )
    return await _run(conversation, arrival.approval, request, arrival.payer, renderer)


async def decide(
    conversations: Conversations,
    choice: Choice,
    renderer: Renderer | None,
    *,
    payer: Payer | None = None,
    view: View | None = None,
) -> TurnEnd | DecisionRefused | DecisionRecorded:
    """See ``Conversations.decide``."""
    desk = conversations.approvals
    if desk is None:
        return DecisionRefused("unknown")
    key = asked = None
    if choice.within is not None:
        asked = await desk.get(choice.approval_id)
        key = None if asked is None else await conversations.key_of(asked.session_id)
        if key is None or not key.startswith(choice.within):
            return DecisionRefused("unknown")
    # Who decides, looked up without making them a user: a refused decision writes nothing.
    actor = await conversations.known_person(choice.person, admin=choice.admin)
    decision = await desk.decide(
        choice.approval_id,
        actor,
        approver_id=choice.approver_id,
        approve=choice.approve,
        by=choice.by or choice.person,
        read=asked,
        reason=choice.reason,
    )
    shown = decision.record
    if choice.shown_at and shown is not None and shown.card_ref is None:
        allowed = not (isinstance(decision, DecisionRefused) and decision.reason == "not_allowed")
        if allowed:  # the surface that showed it died before keeping where: now it is known
            await desk.set_card(shown.id, choice.shown_at)
    if isinstance(decision, DecisionRefused):
        return dataclasses.replace(decision, key=key)
    assert isinstance(decision, Decided)
    if renderer is None:
        return DecisionRecorded(decision.record, key)
    conversation = await conversations.get(decision.session.id, view=view)
    request = TurnRequest("")
    return await _run(
        conversation, decision.record.id, request, payer or Payer(choice.person), renderer
    )


async def _conversation(conversations: Conversations, arrival: Arrival) -> Conversation | None:
    if arrival.session_id is not None:
        return await conversations.get(arrival.session_id, view=arrival.view)
    assert arrival.key is not None, "an arrival names its conversation by key or session id"
    if arrival.approval is not None:
        return await conversations.find(arrival.key)
    owner = await conversations.person(
        arrival.person, admin=arrival.admin, display_name=arrival.display_name
    )
    return await conversations.open(
        arrival.key,
        owner=owner,
        title=arrival.title,
        temporary=arrival.temporary,
        view=arrival.view,
    )


async def _run(
    conversation: Conversation,
    approval: str | None,
    request: TurnRequest,
    payer: Payer | None,
    renderer: Renderer,
) -> TurnEnd:
    picked_up = False

    async def on_event(event: ConversationEvent) -> None:
        nonlocal picked_up
        if isinstance(event, PickingUp):
            picked_up = True
        shaped = _shape(conversation, event, picked_up)
        if shaped is not None:
            await renderer.event(shaped)

    try:
        if approval is not None:
            outcome: TurnOutcome = await conversation.carry_out(approval, on_event, payer=payer)
        else:
            outcome = await conversation.take_turn(request, on_event)
    except AgentSessionLockLost:
        end: TurnEnd = LockLost()
    except TurnInterrupted:
        end = Interrupted()
    except (Exception, asyncio.CancelledError) as exc:
        await asyncio.shield(_quietly(renderer.abandoned(exc)))
        raise
    else:
        end = _fold(outcome)
        if isinstance(end, AlreadyAnswered) and end.answer is not None:
            shown = await conversation.was_shown(end.answer.message_id)
            end = AlreadyAnswered(end.answer, shown=shown, waiting=await _waiting(conversation))
        elif isinstance(end, AlreadyAnswered):
            end = AlreadyAnswered(None, waiting=await _waiting(conversation))
    refs = await renderer.finish(end)
    answer_ = _answer_of(end)
    if answer_ is not None:
        await conversation.showed(answer_.message_id, refs)
    elif isinstance(end, AlreadyAnswered) and end.answer is not None and not end.shown:
        for ref in refs:
            await conversation.noted(ref, end.answer.message_id, "reply")
    return end


async def _waiting(conversation: Conversation) -> ApprovalRecord | None:
    return await conversation.pending_approval()


async def _quietly(work: Any) -> None:
    try:
        await work
    except Exception:  # the surface's own clean-up failing must not hide the turn's error
        return None


def _fold(outcome: TurnOutcome) -> TurnEnd:
    if not isinstance(outcome, Answered):
        return outcome
    error = outcome.result.error
    if error is None:
        return outcome
    if isinstance(error, AgentSessionBudgetExceeded):
        return BudgetRanOut(outcome.result, error)
    return Failed(outcome.result, _code(error))


def _code(error: SlackAgentError) -> str:
    return error.code


def _answer_of(end: TurnEnd) -> StoredMessage | None:
    if isinstance(end, Answered | Failed | BudgetRanOut):
        return end.result.answer
    return None


def _shape(
    conversation: Conversation, event: ConversationEvent, picked_up: bool
) -> TurnEvent | None:
    """A turn's event in the one shape every renderer reads."""
    if isinstance(event, TurnStarted):
        return Began(conversation, event.user, picked_up, event.answer_id)
    if isinstance(event, TextChunk):
        return Said(event.text)
    if isinstance(event, ToolStarted):
        return ToolBegan(event.call_id, "shell", "shell", event.command, {"command": event.command})
    if isinstance(event, ToolFinished):
        result = event.result
        return ToolEnded(
            event.call_id,
            "shell",
            "shell",
            event.command,
            result.exit_code == 0,
            result.exit_code,
            result.stdout,
            result.stderr,
            {
                "stdout": result.stdout,
                "stderr": result.stderr,
                "exit_code": result.exit_code,
                "truncated": result.truncated,
            },
        )
    if isinstance(event, McpCallStarted):
        return ToolBegan(event.call_id, event.name, "mcp", event.name, event.arguments)
    if isinstance(event, McpCallFinished):
        done = event.outcome
        return ToolEnded(
            event.call_id,
            done.name,
            "mcp",
            done.name,
            done.ok,
            0 if done.ok else 1,
            done.text,
            "" if done.ok else done.text,
            done.structured if done.structured is not None else done.text,
            event.seconds,
        )
    if isinstance(event, Notice):
        return Told(event.text)
    if isinstance(event, Refreshed | PickingUp | ModelCalled | ModelDone):
        return event
    return None


__all__ = [
    "Arrival",
    "Attachments",
    "BeforeTurn",
    "Began",
    "BudgetRanOut",
    "Choice",
    "DecisionRecorded",
    "DecisionRefused",
    "Failed",
    "Interrupted",
    "LockLost",
    "QuietRenderer",
    "Renderer",
    "Said",
    "Told",
    "ToolBegan",
    "ToolEnded",
    "ToolKind",
    "TurnEnd",
    "TurnEvent",
    "answer",
    "decide",
]

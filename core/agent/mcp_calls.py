"""The agent loop's MCP tool calls: offer them beside the shell, run them, or stop for a person.

The loop hands every call whose name is ``mcp__<server>__<tool>`` here. A call either runs now
(a tool whose rule needs no approval, or one that ``precheck`` already refuses: an unknown name,
arguments that break the schema, a server that is down; those are tool results the model reads,
never a crashed turn), or it needs a person's decision: then it is not run, its part is stored in
the AI SDK's ``approval-requested`` state, and the turn ends there (``ApprovalNeeded``).

Kept apart from ``loop`` so the loop only routes: what a call part looks like in each state, and
the approval's bookkeeping, live here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from core.agent.turn import Turn
from core.messages import Message
from core.providers.base import ToolCall, ToolSpec
from core.providers.uimessages import Part, tool_call_part, tool_error_part
from core.storage.approvals import (
    DECISION_EXPIRED,
    ENDED,
    MAY_HAVE_RUN,
    NEW_MESSAGE,
    ApprovalRecord,
    Approvals,
)
from core.tools import McpTools, ToolOutcome, is_mcp_tool_name
from core.tools.names import server_of

# The AI SDK (v5) UIMessage tool-part states of a call that waits for, or got, a decision.
APPROVAL_REQUESTED = "approval-requested"
APPROVAL_RESPONDED = "approval-responded"
OUTPUT_DENIED = "output-denied"


@dataclass(frozen=True)
class McpCallStarted:
    """An MCP tool call goes to its server."""

    name: str
    server: str | None
    arguments: dict[str, Any]
    call_id: str = ""  # the model's id for the call (the UIMessage part's ``toolCallId``)


@dataclass(frozen=True)
class McpCallFinished:
    """An MCP tool call came back (``outcome.text`` is what the model reads); ``seconds`` is the
    tool's own time (the server's round trip), so our overhead can be told apart from it."""

    outcome: ToolOutcome
    seconds: float
    call_id: str = ""


@dataclass(frozen=True)
class ApprovalNeeded:
    """A call that waits for a person: the turn ends with its part in ``approval-requested``."""

    call: ToolCall
    server: str
    digest: str
    approvers: tuple[str, ...]


@dataclass(frozen=True)
class ApprovalRequest:
    """A call the turn stopped at: it runs only once a person approves it (``id``)."""

    id: str
    tool_name: str
    server: str
    arguments: dict[str, Any]


Emit = Callable[[Any], Awaitable[None]]
# How long an approved call waits for its server to connect in a process that just started.
SERVER_WAIT_SECONDS = 60.0

ONE_AT_A_TIME = (
    "This call was not run: an earlier call of this step waits for a person's approval; "
    "call it again once that is decided."
)
SENT_BEFORE = (
    "The call was sent to its server by a turn that stopped before recording the result; "
    "it may or may not have run, and it is not sent again."
)
MAY_HAVE_RUN_TEXT = (
    "The call was approved and sent to its server, but the conversation moved on before its "
    "result was recorded: it may have run. Do not assume it did not; check before calling it "
    "again."
)
# Outcomes of a call that went to its server and got no answer: it may have done its work.
UNANSWERED = frozenset({"timeout", "server_failed"})
UNANSWERED_TEXT = (
    "The call was sent, so it may have run: do not assume it did not; check before calling it "
    "again."
)
SUPERSEDED = "superseded: the conversation moved on before anyone decided."
APPROVED_NOT_RUN = (
    "superseded: it was approved, but the conversation moved on before it ran; it did not run."
)
EXPIRED = "expired: nobody decided in time."
DECISION_EXPIRED_TEXT = (
    "expired: it was approved but not carried out in time, so it did not run; ask again if "
    "it is still needed."
)
OVER_BUDGET_TEXT = (
    "not run: the person who approved it was over a usage budget when it was to run; ask "
    "again if it is still needed."
)
NOT_HERE = "it waited for a decision in another conversation (this one was forked from it)."
REWOUND = "the conversation was rewound past it."


def is_mcp_call(call: ToolCall) -> bool:
    return is_mcp_tool_name(call.name)


def offered(tools: McpTools | None) -> list[ToolSpec]:
    """What the model is offered from the MCP servers connected now (none without servers)."""
    return [] if tools is None else tools.specs()


def needs_approval(tools: McpTools | None, call: ToolCall) -> ApprovalNeeded | None:
    """The approval a call waits for, or None when it runs (or is refused) right away."""
    if tools is None or not tools.needs_approval(call.name):
        return None
    if tools.precheck(call.name, call.arguments) is not None:
        return None  # refused without a server: the model reads why, nobody is asked
    tool = tools.tool(call.name)
    assert tool is not None  # needs_approval is true only for a known tool
    return ApprovalNeeded(
        call, tool.server, tool.digest(call.arguments), tools.approvers(call.name)
    )


async def run(
    tools: McpTools | None, call: ToolCall, emit: Emit, *, approval: str | None = None
) -> tuple[Part, ToolOutcome]:
    """Run one call (``approval``: the digest a person approved) and the part that records it."""
    if tools is None:
        outcome = ToolOutcome(
            call.name, None, "unknown_tool", f"no MCP servers are configured ({call.name})"
        )
        return outcome_part(call, outcome), outcome
    tool = tools.tool(call.name)
    if tool is None and approval is not None:
        # An approved call carried out by a process whose server has not listed its tools yet
        # (just started): wait for it, as a call to a restarting server waits, not refuse.
        server = server_of(call.name)
        if server is not None and server in {s.name for s in tools.status()}:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SERVER_WAIT_SECONDS):
                    await tools.wait_for(server, "connected")
        tool = tools.tool(call.name)
    await emit(McpCallStarted(call.name, tool.server if tool else None, call.arguments, call.id))
    started = time.perf_counter()
    outcome = await tools.call(call.name, call.arguments, approval=approval)
    if outcome.kind in UNANSWERED:
        outcome = dataclasses.replace(outcome, text=f"{outcome.text}. {UNANSWERED_TEXT}")
    await emit(McpCallFinished(outcome, time.perf_counter() - started, call.id))
    return outcome_part(call, outcome), outcome


def outcome_part(call: ToolCall, outcome: ToolOutcome) -> Part:
    """``output-available`` with the result, or ``output-error`` with what went wrong (the
    server and the reason, already cut and redacted by the tool layer)."""
    base = tool_call_part(call)
    if outcome.ok:
        return {**base, "state": "output-available", "output": outcome.to_output()}
    return {**base, "state": "output-error", "errorText": outcome.text, "outcome": outcome.kind}


def requested_part(call: ToolCall, approval_id: str) -> Part:
    return {**tool_call_part(call), "state": APPROVAL_REQUESTED, "approval": {"id": approval_id}}


def denied_part(part: Part, reason: str, *, by: str | None = None) -> Part:
    """The call was not run: a person declined, or the request was superseded or expired."""
    approval = dict(part.get("approval") or {})
    approval.update(approved=False, reason=reason)
    if by is not None:
        approval["by"] = by
    return {**part, "state": OUTPUT_DENIED, "approval": approval}


def pending_parts(message: dict[str, Any]) -> list[Part]:
    """The parts of a stored message still waiting for a decision."""
    return [
        p
        for p in message.get("parts") or []
        if isinstance(p, dict) and p.get("state") == APPROVAL_REQUESTED
    ]


async def ask(
    approvals: Approvals,
    session_id: int,
    message_id: str,
    needed: ApprovalNeeded,
    waiting: ApprovalRequest | None,
    requested_by: str | None = None,
) -> tuple[Part, ApprovalRequest | None]:
    """Record the request for ``needed`` (the part that asks, and the request); a second call
    needing approval in the same step is not run (one decision at a time). ``requested_by``:
    whose message the model was answering, kept so a surface can say who asked."""
    call = needed.call
    if waiting is not None:
        return tool_error_part(call, ONE_AT_A_TIME), None
    approval_id = await approvals.request(
        session_id=session_id,
        message_id=message_id,
        tool_call_id=call.id,
        tool_name=call.name,
        server=needed.server,
        arguments=call.arguments,
        digest=needed.digest,
        approvers=needed.approvers,
        requested_by=requested_by,
    )
    request = ApprovalRequest(approval_id, call.name, needed.server, call.arguments)
    return requested_part(call, approval_id), request


async def settle_waiting(turn: Turn, history: list[Message], approvals: Approvals) -> list[Message]:
    """Requests still waiting when a new turn starts are closed and their parts rewritten as
    ``output-denied`` (superseded, expired, or a fork's copy of another conversation's), so
    the model reads why the call did not run and no card can start it any more."""
    settled = list(history)
    for index, message in enumerate(history):
        if not pending_parts(message):
            continue
        parts: list[Any] = []
        for part in message.get("parts") or []:
            if isinstance(part, dict) and part.get("state") == APPROVAL_REQUESTED:
                part = denied_part(part, await _close(part, turn.session_id, approvals))
            parts.append(part)
        rewritten = {**message, "parts": parts}
        await turn.store.rewrite(turn.lease, rewritten)
        settled[index] = rewritten
    return settled


async def _close(part: Part, session_id: int, approvals: Approvals) -> str:
    """End the request behind a part still asking (a new turn started), and what the model
    reads about it: never "did not run" for a call that was sent."""
    approval = part.get("approval")
    approval_id = approval.get("id") if isinstance(approval, dict) else None
    record = await approvals.get(approval_id) if isinstance(approval_id, str) else None
    if record is None or record.session_id != session_id:
        return NOT_HERE
    for _ in range(3):  # a request another replica moves meanwhile is read again
        said = await _end(record, approvals)
        if said is not None:
            return said
        current = await approvals.get(record.id)
        if current is None:
            return NOT_HERE
        record = current
    return ended_text(record)


async def _end(record: ApprovalRecord, approvals: Approvals) -> str | None:
    """Move ``record`` to its end state as a new message finds it, and what the model reads;
    None when it moved meanwhile."""
    if record.state in ENDED:
        return ended_text(record)
    if record.state == "pending" and record.overdue:
        moved = await approvals.close(record.id, "expired")
    elif record.state in ("pending", "approved"):
        moved = await approvals.close(record.id, "superseded", NEW_MESSAGE)
    elif record.state == "denied":
        moved = await approvals.end(record.id, before=("denied",), state="declined", reason=None)
    else:  # running: it went out, and the turn that sent it never recorded the result
        moved = await approvals.end(
            record.id, before=("running",), state="ran", reason=MAY_HAVE_RUN
        )
    return None if moved is None else ended_text(moved)


def ended_text(record: ApprovalRecord) -> str:
    """What the model reads about a request that ended without its call being carried out in
    this turn."""
    if record.state == "ran":
        return MAY_HAVE_RUN_TEXT
    if record.state == "declined":
        return f"{record.decided_by or 'a person'} declined it."
    if record.state == "refused":
        return OVER_BUDGET_TEXT
    if record.state == "rewound":
        return REWOUND
    if record.state == "expired":
        return DECISION_EXPIRED_TEXT if record.reason == DECISION_EXPIRED else EXPIRED
    if record.decided_by is not None and record.state == "superseded":
        return APPROVED_NOT_RUN
    return SUPERSEDED


async def decided_message(
    message: Message,
    record: ApprovalRecord,
    approvals: Approvals,
    tools: McpTools | None,
    emit: Emit,
) -> tuple[Message, Part]:
    """The message that asked, with the decided call's part carried out (returned too): the
    approved call's outcome (sent at most once), or ``output-denied`` saying who declined."""
    parts = list(message.get("parts") or [])
    index = next(
        (
            i
            for i, p in enumerate(parts)
            if isinstance(p, dict) and p.get("toolCallId") == record.tool_call_id
        ),
        None,
    )
    call = ToolCall(record.tool_call_id, record.tool_name, record.arguments)
    part: Part = parts[index] if index is not None else requested_part(call, record.id)
    decision = {"id": record.id, "approved": record.approved, "by": record.decided_by}
    if record.decision_reason:
        decision["reason"] = record.decision_reason  # what the decider said, as the AI SDK has it
    if record.state == "approved":
        if await approvals.start_running(record.id):
            done, _ = await run(tools, call, emit, approval=record.digest)
            record = dataclasses.replace(record, state="running")
        else:  # decided too long ago: the consent has lapsed (or it moved on meanwhile)
            await approvals.end(
                record.id, before=("approved",), state="expired", reason=DECISION_EXPIRED
            )
            record = await approvals.get(record.id) or record
            done = {}
    else:
        done = {}
    if record.state in ("running", "ran"):
        if not done:
            done = {**tool_call_part(call), "state": "output-error", "errorText": SENT_BEFORE}
        done = {**done, "approval": decision}
    elif record.declined:
        # The model reads this: who declined and, when they said, why (so it need not guess).
        who = record.decided_by or "a person"
        said = record.decision_reason
        done = denied_part(part, f"{who} declined it: {said}" if said else f"{who} declined it.")
        done["approval"] = {**done["approval"], "by": record.decided_by}
    else:
        done = denied_part(part, ended_text(record), by=record.decided_by)
    if index is None:
        parts.append(done)
    else:
        parts[index] = done
    return {**message, "parts": parts}, done

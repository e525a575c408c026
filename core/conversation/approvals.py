"""Deciding a tool call that waits for a person, the same way from every surface.

A surface shows a waiting request (``Conversation.pending_approval``), and when someone decides
it calls ``ApprovalDesk.decide`` once: who may decide, whether the request can still be decided,
and the decision itself (one conditional write, so of any number of clicks on any replicas one
decision wins) live here. Carrying the decision out is a turn (``Conversation.carry_out``): Slack
runs it from a delivery record, so it survives restarts and runs on exactly one replica; the
terminal runs it in place. A decision whose process died before carrying it out (the terminal
killed right after ``/approve``) is *left behind*: decided longer than the staleness window ago,
not carried out, its session free. Every ``serve`` replica looks for those (``left_behind``) and
carries them out (``Conversations.carry_out_left_behind``); the claim, the stale guard and
``start_running`` keep the call to at most one run, whoever else tries at the same moment.

Refusals are values with a stable ``reason`` a surface words in one line; nothing changes when a
decision is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core import metrics
from core.records import Actor, SessionInfo
from core.storage.approvals import COMPACTED, MOVED_ON, ApprovalRecord, Approvals
from core.storage.sessions import SessionStore
from core.tools import canonical_json, is_mcp_tool_name

RefusalReason = Literal[
    "unknown",  # no such request (a tampered or foreign id)
    "not_allowed",  # neither the owner, an admin, nor one of the server's approvers
    "expired",  # nobody decided within APPROVAL_TIMEOUT_SECONDS
    "superseded",  # a new message moved the conversation on
    "moved_on",  # the message that asked is no longer the conversation's last (a compaction)
    "rewound",  # the message that asked was taken out by a rewind
    "decided",  # someone decided already (``record.decided_by``)
]


@dataclass(frozen=True)
class Decided:
    """This decision was recorded; the surface carries it out (``Conversation.carry_out``)."""

    record: ApprovalRecord
    session: SessionInfo


@dataclass(frozen=True)
class DecisionRefused:
    """Nothing was decided. ``key``: the request's conversation, when the door read it (a
    surface that names its places asked with ``Choice.within``)."""

    reason: RefusalReason
    record: ApprovalRecord | None = None
    key: str | None = None


Decision = Decided | DecisionRefused


class ApprovalDesk:
    """The approval requests behind one surface's conversations."""

    def __init__(self, store: SessionStore, approvals: Approvals) -> None:
        self.store = store
        self.approvals = approvals

    async def get(self, approval_id: str) -> ApprovalRecord | None:
        if not _plausible(approval_id):
            return None
        return await self.approvals.get(approval_id)

    async def decide(
        self,
        approval_id: str,
        actor: Actor,
        *,
        approver_id: str | None,
        approve: bool,
        by: str,
        read: ApprovalRecord | None = None,
        reason: str | None = None,
    ) -> Decision:
        """``approver_id``: the person as a server's ``approvers`` name them (``T…:U…``);
        ``by``: how the outcome names them; ``read``: the request as the caller just read it
        (not read again; the decision itself is conditional on its state, so nothing older
        can win); ``reason``: what they said with it (kept with the decision, shown with it,
        and read by the model when they declined)."""
        record = (
            read if read is not None and read.id == approval_id else await self.get(approval_id)
        )
        if record is None:
            return DecisionRefused("unknown")
        session = await self.store.get_session(record.session_id)
        allowed = (
            actor.admin
            or (actor.user_id is not None and actor.user_id == session.user_id)
            or (approver_id is not None and approver_id in record.approvers)
        )
        if not allowed:
            return DecisionRefused("not_allowed", record)
        settled = await self.settle(record)
        if settled is not None:
            return settled
        decided = await self.approvals.decide(record.id, approve=approve, by=by, reason=reason)
        if decided is None:  # moved on between the read and the write: say how
            current = await self.approvals.get(record.id)
            return await self.settle(current) or DecisionRefused("decided", current)
        metrics.APPROVALS_DECIDED.labels("approved" if approve else "denied").inc()
        return Decided(decided, session)

    async def settle(self, record: ApprovalRecord | None) -> DecisionRefused | None:
        """Why ``record`` can no longer be decided (closing it if it just became so), or None
        while it waits."""
        if record is None:
            return DecisionRefused("unknown")
        if record.state == "superseded" and record.reason in (MOVED_ON, COMPACTED):
            return DecisionRefused("moved_on", record)
        if record.state in ("expired", "superseded", "rewound"):
            return DecisionRefused(record.state, record)  # type: ignore[arg-type]
        if record.state != "pending":
            return DecisionRefused("decided", record)
        if record.overdue:
            closed = await self.approvals.close(record.id, "expired")
            return DecisionRefused("expired", closed or record)
        tail = await self.store.tail(record.session_id)
        if tail is not None and tail.message_id == record.message_id:
            return None
        # Not the conversation's last message any more: taken out by a rewind, or followed by
        # something (a compaction's checkpoint, a new message whose turn has not settled it
        # yet). Either way the call can no longer run where it was asked.
        located = await self.store.find_message(record.message_id)
        if located is None or located[0] != record.session_id:
            closed = await self.approvals.close(record.id, "rewound")
            return DecisionRefused("rewound", closed or record)
        closed = await self.approvals.close(record.id, "superseded", MOVED_ON)
        return DecisionRefused("moved_on", closed or record)

    async def set_card(self, approval_id: str, card_ref: str) -> None:
        """Where a surface showed the request, to show its outcome there later."""
        await self.approvals.set_card(approval_id, card_ref)

    async def cards_behind(self) -> list[ApprovalRecord]:
        """Shown requests whose state moved on since (overdue ones expired first)."""
        return await self.approvals.cards_behind()

    async def card_shown(self, approval_id: str, shown: str, now: str) -> bool:
        """The card moves from showing ``shown`` to ``now``: True for one caller."""
        return await self.approvals.card_shown(approval_id, shown, now)

    async def left_behind(
        self, older_than_seconds: float, *, session_id: int | None = None
    ) -> list[ApprovalRecord]:
        """Decisions nobody is carrying out: decided over ``older_than_seconds`` ago (a process
        that decided and lives claims its turn at once, and a turn it runs keeps its session
        busy), not carried out, on a session with no turn running."""
        found = await self.approvals.left_behind(older_than_seconds, session_id=session_id)
        if not found:
            return []
        busy = await self.store.active_among({r.session_id for r in found})
        return [r for r in found if r.session_id not in busy]

    async def waiting_among(self, tails: Mapping[int, str]) -> dict[int, ApprovalRecord]:
        """``waiting_in`` for many sessions at once, given each one's last message id."""
        waiting: dict[int, ApprovalRecord] = {}
        for record in await self.approvals.pending_among(sorted(tails)):
            if not record.overdue and tails.get(record.session_id) == record.message_id:
                waiting[record.session_id] = record  # oldest first: the newest one stays
        return waiting

    async def waiting_in(self, session_id: int) -> ApprovalRecord | None:
        """The request the session waits on now: pending, not overdue, and asked by the
        session's last message (anything later supersedes it at the next turn)."""
        found = await self.approvals.of_session(session_id, states=("pending",))
        if not found:
            return None
        tail = await self.store.tail(session_id)
        for record in reversed(found):
            if not record.overdue and tail is not None and tail.message_id == record.message_id:
                return record
        return None


# Outcomes of calls that reached their server (a refusal before sending changed nothing).
_SENT = frozenset({"ok", "tool_error", "timeout", "server_failed", "protocol_error", None})
SHOWN_ARGUMENTS = 120


def calls_outside(message: Mapping[str, Any]) -> list[str]:
    """The MCP calls in a stored message that went out to their servers (``tool {args}``):
    what a rewind or a fork cannot undo."""
    found: list[str] = []
    for part in message.get("parts") or []:
        if not isinstance(part, dict):
            continue
        kind = str(part.get("type", ""))
        name = kind.removeprefix("tool-")
        if not kind.startswith("tool-") or not is_mcp_tool_name(name):
            continue
        state = part.get("state")
        sent = state == "output-available" or (
            state == "output-error" and part.get("outcome") in _SENT
        )
        if sent:
            shown = canonical_json(part.get("input") or {})
            if len(shown) > SHOWN_ARGUMENTS:
                shown = shown[: SHOWN_ARGUMENTS - 1] + "…"
            found.append(f"{name} {shown}")
    return found


def _plausible(approval_id: str) -> bool:
    """An id this product made (32 hex digits): anything else is refused before any query."""
    return len(approval_id) == 32 and all(c in "0123456789abcdef" for c in approval_id)

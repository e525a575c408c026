"""Compaction: a structured checkpoint written by a summariser, stored as a synthetic message.

The summariser is passed in (the model that writes checkpoints belongs to the agent runtime), so
this module only knows the checkpoint's shape, how it is rendered for the model, and how it is
stored: a user-role message with ``is_compaction_message = true`` whose metadata keeps the
sections, so the next compaction can update the previous checkpoint instead of re-reading what it
replaced. Compaction takes the turn lock like a turn (SPEC §7).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import AgentSessionAlreadyCompact, AgentSessionForbidden
from core.messages import Message, user_message
from core.records import Actor, StoredMessage
from core.store import ANY_TAIL, SessionStore
from core.turn import Turn, run_turn

SECTIONS: tuple[str, ...] = (
    "objectives",
    "constraints",
    "decisions",
    "completed_work",
    "active_work",
    "blockers",
    "next_steps",
    "important_details",
)


@dataclass(frozen=True)
class Checkpoint:
    sections: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.sections) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown checkpoint section(s): {', '.join(sorted(unknown))}")

    def items(self, section: str) -> list[str]:
        return list(self.sections.get(section, []))


Summariser = Callable[
    [Sequence[StoredMessage], Checkpoint | None, str | None], Awaitable[Checkpoint]
]


def render_checkpoint(checkpoint: Checkpoint) -> str:
    """The text the model reads in place of the history the checkpoint replaced."""
    lines = ["<checkpoint>"]
    for section in SECTIONS:
        lines.append(f"<{section}>")
        lines.extend(f"- {item}" for item in checkpoint.items(section))
        lines.append(f"</{section}>")
    lines.append("</checkpoint>")
    return "\n".join(lines)


def checkpoint_message(checkpoint: Checkpoint, *, focus: str | None = None) -> Message:
    meta: dict[str, Any] = {"compaction": {"sections": checkpoint.sections, "focus": focus}}
    return user_message(render_checkpoint(checkpoint), **meta)


def parse_checkpoint(message: StoredMessage) -> Checkpoint | None:
    if not message.is_compaction_message:
        return None
    sections = message.message.get("metadata", {}).get("compaction", {}).get("sections", {})
    return Checkpoint({k: list(v) for k, v in sections.items() if k in SECTIONS})


async def write_checkpoint(
    turn: Turn, summariser: Summariser, *, focus: str | None = None
) -> StoredMessage:
    """Compact inside a turn the caller already holds (auto-compaction before a model call)."""
    history = await turn.history()
    if not history:
        raise AgentSessionAlreadyCompact(f"session {turn.session_id} is empty; nothing to compact")
    if history[-1].is_compaction_message:
        raise AgentSessionAlreadyCompact(f"session {turn.session_id} already ends in a checkpoint")
    previous = parse_checkpoint(history[0])
    checkpoint = await summariser(history, previous, focus)
    (stored,) = await turn.append([checkpoint_message(checkpoint, focus=focus)], compaction=True)
    return stored


async def compact(
    store: SessionStore,
    session_id: int,
    actor: Actor,
    summariser: Summariser,
    *,
    focus: str | None = None,
    heartbeat_seconds: float = 15.0,
) -> StoredMessage:
    """Compact a session on request (owner or admin), holding the turn lock throughout."""
    session = await store.get_session(session_id)
    if not actor.may_manage(session.user_id):
        raise AgentSessionForbidden(
            f"only the session's owner or an admin may compact session {session_id}"
        )
    async with run_turn(
        store,
        session_id,
        user_message=None,
        last_message_id=ANY_TAIL,
        heartbeat_seconds=heartbeat_seconds,
    ) as turn:
        stored = await write_checkpoint(turn, summariser, focus=focus)
        await turn.finish()
    return stored

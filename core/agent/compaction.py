"""Compaction: a structured checkpoint written by a summariser, stored as a synthetic message.

The summariser is passed in (the model that writes checkpoints belongs to the agent runtime), so
this module only knows how a checkpoint (``core.checkpoint``) is written and stored: a user-role
message with ``is_compaction_message = true`` whose metadata keeps the
sections, so the next compaction can update the previous checkpoint instead of re-reading what it
replaced. Compaction takes the turn lock like a turn.
"""

from __future__ import annotations

from core.agent.turn import Turn, run_turn
from core.checkpoint import (
    SECTIONS,
    Checkpoint,
    Summariser,
    checkpoint_message,
    parse_checkpoint,
    render_checkpoint,
)
from core.errors import AgentSessionAlreadyCompact, AgentSessionForbidden
from core.records import ANY_TAIL, Actor, StoredMessage
from core.storage.sessions import SessionStore
from core.storage.usage import Reservation


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
    reservation: Reservation | None = None,
) -> StoredMessage:
    """Compact a session on request (owner or admin), holding the turn lock throughout.
    ``reservation``: the budget check the claim runs (compaction's model call counts)."""
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
        reservation=reservation,
    ) as turn:
        stored = await write_checkpoint(turn, summariser, focus=focus)
        await turn.finish()
    return stored


__all__ = [
    "SECTIONS",
    "Checkpoint",
    "Summariser",
    "checkpoint_message",
    "compact",
    "parse_checkpoint",
    "render_checkpoint",
    "write_checkpoint",
]

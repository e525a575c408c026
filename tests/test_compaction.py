"""Compaction with a summariser passed in: lock, checkpoint shape, update, refusals."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from core.agent.compaction import Checkpoint, compact, parse_checkpoint, render_checkpoint
from core.agent.summariser import model_summariser
from core.checkpoint import CHECKPOINT_REQUEST, SECTIONS, parse_checkpoint_text
from core.errors import AgentSessionAlreadyCompact, AgentSessionBusy, AgentSessionForbidden
from core.messages import message_text, user_message
from core.providers import OfflineProvider
from core.records import Actor, StoredMessage
from core.storage.sessions import SessionStore
from tests.helpers import add_exchange, new_session


class RecordingSummariser:
    """Writes a checkpoint from what it is shown, and remembers what it was shown."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], Checkpoint | None, str | None]] = []

    async def __call__(
        self, history: Sequence[StoredMessage], previous: Checkpoint | None, focus: str | None
    ) -> Checkpoint:
        self.calls.append(([message_text(m.message) for m in history], previous, focus))
        done = previous.items("completed_work") if previous else []
        done += [message_text(m.message) for m in history if m.role == "assistant"]
        return Checkpoint(
            {
                "objectives": ["ship the report"],
                "completed_work": done,
                "important_details": ["path /srv/reports/q3.csv", "budget 4,200 EUR"],
            }
        )


async def test_compact__stores_checkpoint_that_projection_starts_from(store: SessionStore) -> None:
    owner, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    summariser = RecordingSummariser()
    stored = await compact(store, session.id, Actor(owner), summariser, focus="the report")
    assert stored.is_compaction_message
    assert stored.role == "user"
    text = message_text(stored.message)
    assert text.startswith("<checkpoint>")
    assert "<next_steps>" in text
    assert "- path /srv/reports/q3.csv" in text
    assert "- budget 4,200 EUR" in text
    assert summariser.calls[0][0] == ["question 0", "answer 0", "question 1", "answer 1"]
    assert summariser.calls[0][2] == "the report"
    history = await store.history(session.id)
    assert [m.message_id for m in history] == [stored.message_id]
    assert not await store.is_turn_active(session.id)


async def test_compact__updates_the_previous_checkpoint(store: SessionStore) -> None:
    owner, session = await new_session(store)
    await add_exchange(store, session.id)
    summariser = RecordingSummariser()
    await compact(store, session.id, Actor(owner), summariser)
    await add_exchange(store, session.id)
    second = await compact(store, session.id, Actor(owner), summariser)
    shown, previous, _ = summariser.calls[1]
    assert previous is not None
    assert previous.items("completed_work") == ["answer 0"]
    assert shown[0].startswith("<checkpoint>")  # the model sees only the old checkpoint + after
    checkpoint = parse_checkpoint(second)
    assert checkpoint is not None
    assert checkpoint.items("completed_work") == ["answer 0", "answer 0"]


async def test_compact__already_compact_and_empty_are_refused(store: SessionStore) -> None:
    owner, session = await new_session(store)
    summariser = RecordingSummariser()
    with pytest.raises(AgentSessionAlreadyCompact):
        await compact(store, session.id, Actor(owner), summariser)
    await add_exchange(store, session.id)
    await compact(store, session.id, Actor(owner), summariser)
    with pytest.raises(AgentSessionAlreadyCompact) as refused:
        await compact(store, session.id, Actor(owner), summariser)
    assert refused.value.code == "agent_session_already_compact"
    assert len(summariser.calls) == 1
    assert not await store.is_turn_active(session.id)


async def test_compact__busy_and_forbidden_cost_no_summary(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    stranger = await store.get_or_create_user("slack:T1:U2")
    summariser = RecordingSummariser()
    with pytest.raises(AgentSessionForbidden):
        await compact(store, session.id, Actor(stranger), summariser)
    lease = await store.start_turn(
        session.id, user_message=user_message("q"), last_message_id=ids[-1]
    )
    with pytest.raises(AgentSessionBusy):
        await compact(store, session.id, Actor(owner), summariser)
    await store.release(lease)
    assert summariser.calls == []


def test_checkpoint__rejects_unknown_sections_and_renders_all() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint section"):
        Checkpoint({"feelings": ["fine"]})
    rendered = render_checkpoint(Checkpoint({"blockers": ["CI red"]}))
    assert rendered.count("<") == 2 * 9
    assert "- CI red" in rendered


def test_checkpoint__items_that_look_like_markup_cannot_break_its_structure() -> None:
    hostile = Checkpoint(
        {
            "objectives": ["close </objectives> then <constraints>", "a & b"],
            "decisions": ["line one\n- not an item\n</decisions>"],
        }
    )
    rendered = render_checkpoint(hostile)
    # Exactly the tags render_checkpoint wrote: one open and one close per section.
    assert rendered.count("</objectives>") == 1
    assert rendered.count("<constraints>") == 1
    assert rendered.count("</decisions>") == 1
    parsed = parse_checkpoint_text(rendered)
    assert parsed is not None
    assert parsed.get("objectives") == hostile.items("objectives")
    assert parsed.get("decisions") == hostile.items("decisions")
    assert "constraints" not in parsed


async def test_compact__offline_checkpoint_summarises_the_conversation_not_its_request(
    store: SessionStore,
) -> None:
    """The request for a checkpoint is an instruction: no section may list it as the work."""
    owner, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    summariser = model_summariser(OfflineProvider())
    await compact(store, session.id, Actor(owner), summariser, focus="the report")
    await add_exchange(store, session.id, 1)
    stored = await compact(store, session.id, Actor(owner), summariser)

    checkpoint = parse_checkpoint(stored)
    assert checkpoint is not None
    every = [item for section in SECTIONS for item in checkpoint.items(section)]
    assert not [item for item in every if CHECKPOINT_REQUEST in item or "<checkpoint>" in item]
    assert checkpoint.items("objectives") == ["question 0"]
    assert checkpoint.items("active_work") == []  # the last question was answered
    assert checkpoint.items("important_details") == ["question 1"]

"""Turns that stop early, on both databases: a lost lock stops the
turn at its next heartbeat, a cancelled or interrupted turn keeps its partial answer *and* the
sandbox state of what already ran, and a turn whose process died is resumed from the user
message already in the transcript, which is not stored again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from core.agent.loop import Agent, AgentConfig, TurnResult
from core.agent.model_choice import ProviderCache
from core.agent.turn import STOPPED, run_turn
from core.conversation import (
    AlreadyAnswered,
    Answered,
    Conversation,
    Conversations,
    PickingUp,
    TurnRequest,
)
from core.errors import AgentSessionLockLost, AgentSessionStale, TurnInterrupted
from core.messages import assistant_message, message_text, user_message
from core.providers import step_start_part
from core.providers.streaming import HttpOptions, RetryPolicy
from core.settings import Settings
from core.storage.engine import Database
from core.storage.feedback import Feedback
from core.storage.sessions import SessionStore
from core.storage.snapshots import load_state
from standins.openai import GatedModel
from tests.helpers import age_lock, new_session, shell_output, take_over
from tests.providers_fixtures import RecordingSleep


@pytest.fixture
async def caches() -> AsyncIterator[list[ProviderCache]]:
    made: list[ProviderCache] = []
    yield made
    for cache in made:
        await cache.aclose()


def agent(
    store: SessionStore, caches: list[ProviderCache], model: GatedModel | None, **config: float
) -> Agent:
    settings = (
        Settings(model_provider="openai", openai_api_key="sk-test", openai_base_url=model.base_url)
        if model is not None
        else Settings(model_provider="offline")
    )
    caches.append(
        ProviderCache(settings, http=HttpOptions(retry=RetryPolicy(sleep=RecordingSleep())))
    )
    return Agent(store, caches[-1], AgentConfig(auto_compact_tokens=0, **config))


async def ask(agent: Agent, session_id: int, text: str) -> TurnResult:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
    )


async def test_lost_lock__the_turn_stops_at_its_next_heartbeat_not_when_the_model_ends(
    store: SessionStore, replica: SessionStore, db: Database, caches: list[ProviderCache]
) -> None:
    _, session = await new_session(store)
    async with GatedModel(early="partial words") as model:
        running = asyncio.create_task(
            ask(agent(store, caches, model, heartbeat_seconds=0.05), session.id, "long one")
        )
        await asyncio.wait_for(model.arrived.wait(), 20)
        # Another replica takes the lock over (as if this turn had stalled past the window).
        thief = await take_over(db, session.id)
        await replica.append(thief, [user_message("mine now")])
        with pytest.raises(AgentSessionLockLost):
            await asyncio.wait_for(running, 20)
        # It stopped while the model was still writing: the stream was dropped, not finished.
        assert not model.gate.is_set()
        model.gate.set()
        for _ in range(200):
            if model.dropped:
                break
            await asyncio.sleep(0.02)
        assert model.dropped == 1
    await replica.finish(thief, [assistant_message("the new owner's answer")])
    texts = [message_text(m.message) for m in await store.messages(session.id)]
    assert texts == ["long one", "mine now", "the new owner's answer"]


async def test_cancelled_turn__keeps_partial_answer_and_the_sandbox_state_of_what_ran(
    store: SessionStore, db: Database, caches: list[ProviderCache]
) -> None:
    _, session = await new_session(store)
    async with GatedModel(early="half an answer", command="echo kept > kept.txt") as model:
        running = asyncio.create_task(ask(agent(store, caches, model), session.id, "do it"))
        await asyncio.wait_for(model.arrived.wait(), 20)  # the command ran; the answer waits
        running.cancel("shutdown")
        with pytest.raises(asyncio.CancelledError):
            await running
    _, answer = await store.messages(session.id)
    assert answer.message["metadata"]["interrupted"] is True
    assert answer.message["metadata"]["interrupted_by"] == "shutdown"
    assert "half an answer" in message_text(answer.message)
    assert any(p.get("type", "").startswith("tool-") for p in answer.message["parts"])
    assert not await store.is_turn_active(session.id)  # released at once, not left to go stale
    assert await load_state(db, session.id) is not None
    offline = agent(store, caches, None)
    kept = await ask(offline, session.id, "$ cat kept.txt")
    assert shell_output(kept.answer) == "kept\n"  # what cat printed in the sandbox


async def test_interrupt__ends_the_turn_with_turn_interrupted_and_keeps_the_partial_answer(
    store: SessionStore,
) -> None:
    _, session = await new_session(store)
    with pytest.raises(TurnInterrupted) as stopped:  # noqa: PT012 (the turn's whole life)
        async with run_turn(
            store, session.id, user_message=user_message("q"), last_message_id=None
        ) as turn:
            turn.partial = assistant_message("so far")
            asyncio.get_running_loop().call_soon(turn.interrupt, "stopped")
            await asyncio.sleep(30)
    assert stopped.value.reason == "stopped"
    _, answer = await store.messages(session.id)
    assert answer.message["metadata"]["interrupted_by"] == "stopped"
    assert not await store.is_turn_active(session.id)


async def test_resume__answers_the_user_message_already_stored_without_storing_it_again(
    store: SessionStore, replica: SessionStore, db: Database, caches: list[ProviderCache]
) -> None:
    _, session = await new_session(store)
    # A turn whose process (``replica``) died right after its claim: the user message is the
    # tail, and the lock goes stale.
    dead = await replica.start_turn(
        session.id, user_message=user_message("are you there?"), last_message_id=None
    )
    assert dead.tail is not None
    await age_lock(db, session.id, 120)
    result = await agent(store, caches, None).run_turn(
        session.id, user_message=None, last_message_id=dead.tail.message_id
    )
    assert result.user is not None
    assert result.user.message_id == dead.tail.message_id
    messages = await store.messages(session.id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert "are you there?" in message_text(messages[1].message)
    # Once answered, resuming it again is refused: something follows it now.
    with pytest.raises(AgentSessionStale):
        await agent(store, caches, None).run_turn(
            session.id, user_message=None, last_message_id=dead.tail.message_id
        )


async def _interrupted_empty(
    store: SessionStore,
    conversations: Conversations,
    interrupted_by: str | None,
    error: dict[str, str] | None = None,
) -> tuple[Conversation, str]:
    """A conversation whose turn stopped (``interrupted_by``) before its model said anything:
    the user message, then an interrupted answer holding only ``step-start``."""
    person = await conversations.person("cli:someone")
    conversation = await conversations.open("k1", owner=person)
    lease = await store.start_turn(
        conversation.id, user_message=user_message("are you there?"), last_message_id=None
    )
    assert lease.tail is not None
    metadata: dict[str, object] = {"interrupted": True}
    if interrupted_by is not None:
        metadata["interrupted_by"] = interrupted_by
    if error is not None:
        metadata["error"] = error
    empty = {**assistant_message(""), "parts": [step_start_part()], "metadata": metadata}
    await store.finish(lease, [empty])
    return conversation, lease.tail.message_id


@pytest.mark.parametrize("interrupted_by", ["shutdown", "lock_lost", "database_unreachable"])
async def test_resume__an_answer_that_said_nothing_does_not_answer_the_message(
    store: SessionStore, db: Database, caches: list[ProviderCache], interrupted_by: str
) -> None:
    """The message is answered after it, once; the model never sees the empty answer (the
    offline model quotes the message it answers)."""
    conversations = Conversations(store, agent(store, caches, None), Feedback(db), project="t")
    conversation, message_id = await _interrupted_empty(store, conversations, interrupted_by)
    events: list[object] = []

    async def seen(event: object) -> None:
        events.append(event)

    request = TurnRequest("are you there?", message_id=message_id, resume=True)
    outcome = await conversation.take_turn(request, seen)
    assert isinstance(outcome, Answered)
    assert isinstance(events[0], PickingUp)
    messages = await store.messages(conversation.id)
    assert [m.role for m in messages] == ["user", "assistant", "assistant"]
    assert outcome.result.answer is not None
    assert outcome.result.answer.message_id == messages[2].message_id
    assert "are you there?" in message_text(messages[2].message)
    again = await conversation.take_turn(request)  # a second retry: answered now, by that one
    assert isinstance(again, AlreadyAnswered)
    assert again.answer is not None
    assert again.answer.message_id == messages[2].message_id
    assert len(await store.messages(conversation.id)) == 3


@pytest.mark.parametrize(
    ("interrupted_by", "error"),
    [(STOPPED, None), (None, {"code": "model_provider_timeout", "message": "sent nothing"})],
    ids=["the person's stop", "a model error"],
)
async def test_resume__an_empty_answer_the_person_was_shown_stays_the_answer(
    store: SessionStore,
    db: Database,
    caches: list[ProviderCache],
    interrupted_by: str | None,
    error: dict[str, str] | None,
) -> None:
    """Their own stop, or the model's failure (said in the thread), is the answer: the message
    is not answered again."""
    conversations = Conversations(store, agent(store, caches, None), Feedback(db), project="t")
    conversation, message_id = await _interrupted_empty(store, conversations, interrupted_by, error)
    request = TurnRequest("are you there?", message_id=message_id, resume=True)
    outcome = await conversation.take_turn(request)
    assert isinstance(outcome, AlreadyAnswered)
    assert [m.role for m in await store.messages(conversation.id)] == ["user", "assistant"]


async def test_stop__requested_on_another_replica_stops_the_running_turn(
    store: SessionStore, replica: SessionStore, db: Database, caches: list[ProviderCache]
) -> None:
    _, session = await new_session(store)
    # Nothing runs: a stop changes nothing.
    assert await replica.request_stop(session.id) is False
    async with GatedModel(early="so far", command="echo ran > ran.txt") as model:
        running = asyncio.create_task(ask(agent(store, caches, model), session.id, "long job"))
        await asyncio.wait_for(model.arrived.wait(), 20)
        # The stop neither waits for nor takes the lock: the turn is still running here.
        assert await replica.request_stop(session.id) is True
        with pytest.raises(TurnInterrupted) as stopped:
            await asyncio.wait_for(running, 20)
        assert not model.gate.is_set()  # it stopped before the model finished
    assert stopped.value.reason == "stopped"
    _, answer = await store.messages(session.id)
    assert answer.message["metadata"]["interrupted_by"] == "stopped"
    assert "so far" in message_text(answer.message)
    assert not await store.is_turn_active(session.id)
    assert await load_state(db, session.id) is not None  # the command's sandbox state is kept
    # The stop was for that turn only: the next one runs to its end.
    offline = agent(store, caches, None)
    ran = await ask(offline, session.id, "$ cat ran.txt")
    assert shell_output(ran.answer) == "ran\n"  # what cat printed in the sandbox

"""The agent loop end to end: real providers over HTTP to local wire-format servers, the real
bashkit sandbox, the real store on both databases."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from core.agent.loop import Agent, AgentConfig, AgentEvent, Notice, TextChunk, ToolFinished
from core.agent.model_choice import ProviderCache
from core.errors import AgentSessionBusy, AgentSessionStale
from core.messages import message_text, user_message
from core.providers.streaming import HttpOptions, RetryPolicy
from core.records import Actor
from core.settings import Settings
from core.storage.custom_providers import (
    CustomProviderSpec,
    add_custom_provider,
    delete_custom_provider,
)
from core.storage.sessions import SessionStore
from standins import anthropic, openai
from standins.anthropic import AnthropicStandIn
from standins.openai import OpenAIStandIn
from standins.scripted import SseReply
from tests.helpers import new_session, shell_output
from tests.providers_fixtures import RecordingSleep


@pytest.fixture
async def openai_server() -> AsyncIterator[OpenAIStandIn]:
    async with OpenAIStandIn() as server:
        yield server


@pytest.fixture
async def anthropic_server() -> AsyncIterator[AnthropicStandIn]:
    async with AnthropicStandIn() as server:
        yield server


def http() -> HttpOptions:
    return HttpOptions(retry=RetryPolicy(sleep=RecordingSleep()))


AgentFactory = Callable[..., Agent]


@pytest.fixture
async def agent_for() -> AsyncIterator[AgentFactory]:
    """Agents whose providers (and their HTTP clients) are closed after the test."""
    caches: list[ProviderCache] = []

    def make(store: SessionStore, settings: Settings, **config: Any) -> Agent:
        caches.append(ProviderCache(settings, http=http()))
        return Agent(store, caches[-1], AgentConfig(**config))

    yield make
    for cache in caches:
        await cache.aclose()


def openai_settings(server: OpenAIStandIn, **extra: Any) -> Settings:
    return Settings(
        model_provider="openai",
        openai_api_key="sk-test",
        openai_base_url=server.base_url,
        model_name="fake-model",
        **extra,
    )


class Events:
    def __init__(self) -> None:
        self.seen: list[AgentEvent] = []

    async def __call__(self, event: AgentEvent) -> None:
        self.seen.append(event)

    def text(self) -> str:
        return "".join(e.text for e in self.seen if isinstance(e, TextChunk))


async def turn(agent: Agent, session_id: int, text: str, events: Events | None = None) -> Any:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
        on_event=events,
    )


async def test_turn__tool_call_runs_in_the_sandbox_and_streams(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(
        openai.tool_call_reply(
            [("call_1", "shell", {"command": "echo hello > note.txt && cat note.txt"})]
        ),
        openai.text_reply("The file ", "says hello."),
    )
    agent = agent_for(store, openai_settings(openai_server))
    events = Events()
    result = await turn(agent, session.id, "write a note", events)
    assert result.error is None
    assert result.text == "The file says hello."
    assert events.text() == "The file says hello."
    finished = [e for e in events.seen if isinstance(e, ToolFinished)]
    assert [(e.command, e.result.stdout) for e in finished] == [
        ("echo hello > note.txt && cat note.txt", "hello\n")
    ]
    stored = (await store.messages(session.id))[-1].message
    kinds = [part["type"] for part in stored["parts"]]
    assert kinds == ["step-start", "tool-shell", "step-start", "text"]
    assert stored["parts"][1]["state"] == "output-available"
    assert stored["parts"][1]["output"]["stdout"] == "hello\n"
    # The second request carried the tool result back to the model.
    second = openai_server.requests[1].body["messages"]
    assert second[-1]["role"] == "tool"
    assert "hello" in second[-1]["content"]
    after = await store.get_session(session.id)
    assert (after.model_provider, after.model_name) == ("openai", "fake-model")
    assert not after.is_turn_active


async def test_turn__anthropic_tool_use_end_to_end(
    store: SessionStore, anthropic_server: AnthropicStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    anthropic_server.push(
        anthropic.tool_use_reply([("toolu_1", "shell", {"command": "printf 42"})]),
        anthropic.text_reply("It printed 42."),
    )
    settings = Settings(
        model_provider="anthropic",
        anthropic_api_key="key",
        anthropic_base_url=anthropic_server.url,
    )
    result = await turn(agent_for(store, settings), session.id, "print 42")
    assert result.error is None
    assert result.text == "It printed 42."
    tool_result = anthropic_server.requests[1].body["messages"][-1]["content"][0]
    assert tool_result["type"] == "tool_result"
    assert "42" in tool_result["content"]


async def test_refused_turns__never_reach_the_provider(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    agent = agent_for(store, openai_settings(openai_server))
    lease = await store.start_turn(
        session.id, user_message=user_message("hold"), last_message_id=None
    )
    with pytest.raises(AgentSessionBusy):
        await turn(agent, session.id, "while busy")
    await store.release(lease)
    with pytest.raises(AgentSessionStale):
        await agent.run_turn(session.id, user_message=user_message("stale"), last_message_id=None)
    assert openai_server.requests == []


async def test_provider_failure__partial_output_kept_interrupted_and_lock_released(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(SseReply(openai.text_frames("Half of an ans"), cut=True))
    result = await turn(agent_for(store, openai_settings(openai_server)), session.id, "go")
    assert result.error is not None
    assert result.error.code.startswith("model_provider")
    stored = (await store.messages(session.id))[-1].message
    assert stored["metadata"]["interrupted"] is True
    assert stored["metadata"]["error"]["code"] == result.error.code
    assert message_text(stored) == "Half of an ans"
    assert not await store.is_turn_active(session.id)


async def test_provider_failure__server_errors_are_retried_then_reported(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(*(openai.error_reply(503) for _ in range(5)))
    result = await turn(agent_for(store, openai_settings(openai_server)), session.id, "go")
    assert result.error is not None
    assert len(openai_server.requests) == RetryPolicy().max_attempts
    assert [m.role for m in await store.messages(session.id)] == ["user", "assistant"]
    assert not await store.is_turn_active(session.id)


async def test_tool_rounds__are_capped_and_the_last_round_offers_no_tools(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    call = [("c", "shell", {"command": "true"})]
    openai_server.push(
        openai.tool_call_reply(call),
        openai.tool_call_reply(call),
        openai.text_reply("Giving up on tools."),
    )
    agent = agent_for(store, openai_settings(openai_server), max_tool_rounds=2)
    result = await turn(agent, session.id, "loop")
    assert result.text == "Giving up on tools."
    assert [("tools" in r.body) for r in openai_server.requests] == [True, True, False]


async def test_custom_provider__used_then_fallback_after_deletion_said_once(
    store: SessionStore,
    openai_server: OpenAIStandIn,
    monkeypatch: pytest.MonkeyPatch,
    agent_for: AgentFactory,
) -> None:
    monkeypatch.setenv("TEAM_LLM_KEY", "sk-team")
    _, session = await new_session(store)
    await add_custom_provider(
        store.db,
        CustomProviderSpec(
            "team-llm", "openai", openai_server.base_url, "TEAM_LLM_KEY", "team-model"
        ),
    )
    agent = agent_for(store, Settings(model_provider="team-llm"))
    openai_server.push(openai.text_reply("from the team model"))
    first = await turn(agent, session.id, "hi")
    assert first.text == "from the team model"
    assert openai_server.requests[0].headers["authorization"] == "Bearer sk-team"
    stamped = await store.get_session(session.id)
    assert (stamped.model_provider, stamped.custom_provider_id is not None) == ("team-llm", True)

    assert await delete_custom_provider(store.db, "team-llm")
    assert (await store.get_session(session.id)).custom_provider_deleted
    events = Events()
    second = await turn(agent, session.id, "still there?", events)
    assert "team-llm" in second.notices[0]
    assert "offline" in second.notices[0]
    assert [e.text for e in events.seen if isinstance(e, Notice)] == list(second.notices)
    assert second.text.startswith("[offline stand-in]")
    third = await turn(agent, session.id, "and now?")
    assert third.notices == ()
    assert len(openai_server.requests) == 1


async def test_compact__model_writes_the_checkpoint_with_a_forced_tool_call(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    owner, session = await new_session(store)
    openai_server.push(openai.text_reply("Deployed build 4812 to staging."))
    agent = agent_for(store, openai_settings(openai_server))
    await turn(agent, session.id, "deploy 4812 to staging, never to prod")
    sections = {
        "objectives": ["deploy build 4812"],
        "constraints": ["never deploy to prod"],
        "decisions": [],
        "completed_work": ["build 4812 on staging"],
        "active_work": [],
        "blockers": [],
        "next_steps": ["watch staging"],
        "important_details": ["build 4812"],
    }
    openai_server.push(openai.tool_call_reply([("cp", "write_checkpoint", sections)]))
    stored = await agent.compact(session.id, Actor(owner), focus="the deploy")
    request = openai_server.requests[-1].body
    assert request["tool_choice"] == {"type": "function", "function": {"name": "write_checkpoint"}}
    assert "the deploy" in request["messages"][-1]["content"]
    assert stored.is_compaction_message
    assert "- never deploy to prod" in message_text(stored.message)
    history = await store.history(session.id)
    assert [m.message_id for m in history] == [stored.message_id]


async def test_auto_compaction__checkpoint_goes_before_the_new_user_message(
    store: SessionStore, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    agent = agent_for(store, Settings(model_provider="offline"), auto_compact_tokens=60)
    await turn(agent, session.id, "remember the build number 4812 please")
    result = await turn(agent, session.id, "what next?")
    assert result.compacted
    history = await store.history(session.id)
    assert history[0].is_compaction_message
    assert [message_text(m.message) for m in history[1:2]] == ["what next?"]
    assert [m.role for m in history] == ["user", "user", "assistant"]
    assert "4812" in message_text(history[0].message)


async def test_sandbox__rewind_and_fork_bring_back_the_files(
    store: SessionStore, agent_for: AgentFactory
) -> None:
    owner, session = await new_session(store)
    agent = agent_for(store, Settings(model_provider="offline"))
    first = await turn(agent, session.id, "$ echo one > state.txt")
    await turn(agent, session.id, "$ echo two > state.txt")
    latest = await turn(agent, session.id, "$ cat state.txt")
    assert shell_output(latest.answer.message) == "two\n"  # the tool result, not the answer

    fork = await store.branch(session.id, first.answer.message_id, user_id=owner)
    forked = await turn(agent, fork.session.id, "$ cat state.txt")
    assert shell_output(forked.answer.message) == "one\n"

    await store.truncate(session.id, first.answer.message_id, Actor(owner))
    rewound = await turn(agent, session.id, "$ cat state.txt")
    assert shell_output(rewound.answer.message) == "one\n"

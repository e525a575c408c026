"""MCP tools in the agent loop: a real notes MCP server (the SDK, over stdio), the offline model
calling it by its documented message form, the real store on both databases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from core.agent.loop import Agent, AgentConfig, AgentEvent, McpCallFinished, McpCallStarted
from core.agent.model_choice import ProviderCache
from core.messages import user_message
from core.providers.uimessages import ui_to_chat
from core.runtime import Runtime
from core.settings import Settings
from core.storage.sessions import SessionStore
from core.tools import McpTools
from standins.otlp import OtlpReceiver
from tests.helpers import new_session
from tests.mcp_support import notes, notes_entry, running, write_config

# Every test starts the notes MCP server as a process (stdio): outside the developer's quick
# subset, like every test that starts real processes (README, *The tests*).
pytestmark = pytest.mark.slow


@pytest.fixture
async def tools(tmp_path: Path) -> AsyncIterator[McpTools]:
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as started:
        yield started


@pytest.fixture
async def agent(store: SessionStore, tools: McpTools) -> AsyncIterator[Agent]:
    providers = ProviderCache(Settings(model_provider="offline"))
    yield Agent(store, providers, AgentConfig(), tools=tools)
    await providers.aclose()


class Seen:
    def __init__(self) -> None:
        self.events: list[AgentEvent] = []

    async def __call__(self, event: AgentEvent) -> None:
        self.events.append(event)


def tool_parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in message["parts"] if str(p.get("type", "")).startswith("tool-")]


async def ask(agent: Agent, session_id: int, text: str, seen: Seen | None = None) -> Any:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
        on_event=seen,
    )


async def test_agent__read_only_mcp_tool_runs_without_asking(
    agent: Agent, store: SessionStore, tmp_path: Path
) -> None:
    (tmp_path / "notes.json").write_text(json.dumps({"plan": "ship on friday"}))
    _, session = await new_session(store)
    seen = Seen()
    result = await ask(agent, session.id, 'mcp__notes__read_note {"title": "plan"}', seen)
    assert result.error is None
    (part,) = tool_parts(result.answer.message)
    assert part["type"] == "tool-mcp__notes__read_note"
    assert part["state"] == "output-available"
    assert part["output"]["outcome"] == "ok"
    assert "ship on friday" in part["output"]["text"]
    # the model read the result and answered, saying how the call ended (the part holds it)
    assert '`mcp__notes__read_note {"title": "plan"}` answered' in result.text
    started = [e for e in seen.events if isinstance(e, McpCallStarted)]
    finished = [e for e in seen.events if isinstance(e, McpCallFinished)]
    assert [e.name for e in started] == ["mcp__notes__read_note"]
    assert finished[0].outcome.ok
    assert finished[0].seconds >= 0


async def test_agent__mcp_tools_are_offered_beside_the_shell(agent: Agent) -> None:
    names = [spec.name for spec in agent.tools.specs()] if agent.tools else []
    assert "mcp__notes__add_note" in names
    assert "mcp__notes__read_note" in names


async def test_agent__arguments_that_break_the_schema_are_a_tool_error(
    agent: Agent, store: SessionStore, tmp_path: Path
) -> None:
    _, session = await new_session(store)
    result = await ask(agent, session.id, 'mcp__notes__read_note {"name": 3}')
    (part,) = tool_parts(result.answer.message)
    assert part["state"] == "output-error"
    assert part["outcome"] == "invalid_arguments"
    assert "input schema" in part["errorText"]
    # Replayed to the model as an error result, so it can correct itself.
    chat = ui_to_chat([result.answer.message])
    assert any(getattr(m, "is_error", False) for m in chat)


async def test_agent__a_failing_tool_is_a_result_and_the_turn_answers(
    agent: Agent, store: SessionStore
) -> None:
    _, session = await new_session(store)
    result = await ask(agent, session.id, 'mcp__notes__fault {"kind": "error"}')
    assert result.error is None
    assert result.answer is not None
    (part,) = tool_parts(result.answer.message)
    assert part["state"] == "output-error"
    assert part["outcome"] == "tool_error"


async def test_agent__a_call_sent_and_never_answered_may_have_run(
    agent: Agent, store: SessionStore
) -> None:
    """The server died during the call: the model reads that it may have run (it was sent),
    never only that it failed."""
    _, session = await new_session(store)
    result = await ask(agent, session.id, 'mcp__notes__fault {"kind": "crash"}')
    (part,) = tool_parts(result.answer.message)
    assert part["outcome"] == "server_failed"
    assert "may have run" in part["errorText"]


async def test_agent__a_huge_result_is_cut_with_a_note(agent: Agent, store: SessionStore) -> None:
    _, session = await new_session(store)
    result = await ask(agent, session.id, 'mcp__notes__fault {"kind": "huge"}')
    (part,) = tool_parts(result.answer.message)
    assert part["output"]["truncated"] is True
    assert "[cut: the result was" in part["output"]["text"]


async def test_agent__a_call_needing_approval_is_not_run_without_one(
    agent: Agent, store: SessionStore, tmp_path: Path
) -> None:
    _, session = await new_session(store)
    result = await ask(agent, session.id, 'mcp__notes__add_note {"title": "a", "text": "b"}')
    (part,) = tool_parts(result.answer.message)
    assert part["state"] in ("approval-requested", "output-error")
    assert notes(tmp_path) == {}  # nothing was written


async def test_runtime__starts_with_a_server_that_will_not_start_and_stops_it(
    tmp_path: Path, database_url: str
) -> None:
    config = write_config(
        tmp_path,
        {
            "notes": notes_entry(tmp_path),
            "broken": {"command": str(tmp_path / "no-such-server")},
        },
    )
    settings = Settings(database_url=database_url, mcp_config=config, model_provider="offline")
    runtime = await Runtime.open(settings)
    try:
        assert runtime.tools is not None
        assert runtime.agent.tools is runtime.tools
        states = {s.name: s.state for s in runtime.tools.status()}
        assert set(states) == {"notes", "broken"}
    finally:
        await runtime.close()
    assert {s.state for s in runtime.tools.status()} == {"closed"}


async def test_runtime__without_servers_offers_only_the_shell(database_url: str) -> None:
    runtime = await Runtime.open(Settings(database_url=database_url, mcp_config=""))
    try:
        assert runtime.tools is None
        assert runtime.agent.tools is None
    finally:
        await runtime.close()


async def test_runtime__a_tool_result_holding_the_bot_token_reaches_no_one(
    tmp_path: Path, database_url: str
) -> None:
    """A read-only tool steered into returning the Slack token (here: written into the server's
    own configuration, which the file never marks as a secret): the model, the stored answer
    (what the thread and the task card show) and the exported trace get its name instead."""
    token = "xoxb-1111-2222-the-real-bot-token"
    entry = notes_entry(tmp_path, env={"LEAKED": token})
    async with OtlpReceiver() as collector:
        settings = Settings(
            database_url=database_url,
            mcp_config=write_config(tmp_path, {"notes": entry}),
            model_provider="offline",
            slack_bot_token=token,
            otel_exporter_otlp_traces_endpoint=collector.endpoint,
            _env_file=None,  # type: ignore[call-arg]
        )
        runtime = await Runtime.open(settings)
        try:
            assert runtime.tools is not None
            _, session = await new_session(runtime.storage.sessions)
            call = 'mcp__notes__fault {"kind": "echo", "name": "LEAKED"}'
            result = await ask(runtime.agent, session.id, call)
            stored = await runtime.storage.sessions.messages(session.id)
            assert await asyncio.to_thread(runtime.tracer.force_flush, 10.0)
            async with asyncio.timeout(30):
                await collector.wait_for(spans=2)
        finally:
            await runtime.close()
        exported = json.dumps([(s.name, s.attributes) for s in collector.spans], default=str)
    assert result.error is None
    (part,) = tool_parts(result.answer.message)
    assert "LEAKED=${SLACK_BOT_TOKEN}" in part["output"]["text"]  # the model read the name
    assert token not in result.text
    assert token not in json.dumps([m.message for m in stored])
    assert "${SLACK_BOT_TOKEN}" in exported
    assert token not in exported

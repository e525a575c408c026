"""A turn whose lease's last confirmation is past the safe share of the window sends nothing
more (§6.12), even when a stall (a paused process, a suspended host, a blocked loop) lets the
turn's task run before the heartbeat task that would stop it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from core.agent.loop import Agent, AgentConfig, AgentEvent, ModelCalled
from core.agent.mcp_calls import McpCallStarted
from core.agent.model_choice import ProviderCache
from core.errors import DatabaseUnreachable
from core.messages import user_message
from core.settings import Settings
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from standins import openai
from standins.openai import OpenAIStandIn
from tests.helpers import new_session
from tests.mcp_support import calls_timed, notes, notes_entry, running

# Starts the notes MCP server as a process (stdio): outside the quick subset (README).
pytestmark = pytest.mark.slow

STALENESS = 2.0
HEARTBEAT = 0.5


def stall() -> None:
    """Block the event loop (as SIGSTOP, a suspend or a long synchronous call would) until the
    lease's last confirmation is older than the safe share of the window, whatever it was."""
    time.sleep(STALENESS)  # > TURN_SAFE_SHARE x STALENESS, even right after a renewal


class StallOn:
    """An ``on_event`` that stalls the loop at the ``nth`` event of a type, and records all."""

    def __init__(self, kind: type, nth: int = 1) -> None:
        self.kind, self.nth = kind, nth
        self.events: list[AgentEvent] = []

    async def __call__(self, event: AgentEvent) -> None:
        self.events.append(event)
        if isinstance(event, self.kind) and sum(isinstance(e, self.kind) for e in self.events) == (
            self.nth
        ):
            stall()


async def test_stall_before_an_mcp_call__the_call_is_never_sent(
    db: Database, tmp_path: Path
) -> None:
    store = SessionStore(db, staleness_seconds=STALENESS)
    _, session = await new_session(store)
    providers = ProviderCache(Settings(model_provider="offline"))
    servers = {"notes": notes_entry(tmp_path, approval="never")}
    async with running(tmp_path, servers) as tools:
        agent = Agent(store, providers, AgentConfig(heartbeat_seconds=HEARTBEAT), tools=tools)
        sent_before = calls_timed("notes")
        on_event = StallOn(McpCallStarted)
        with pytest.raises(DatabaseUnreachable):
            await agent.run_turn(
                session.id,
                user_message=user_message('mcp__notes__add_note {"title": "t", "text": "x"}'),
                last_message_id=None,
                on_event=on_event,
            )
        assert calls_timed("notes") == sent_before  # nothing went to the server
        listed = await tools.call("mcp__notes__list_notes", {})  # and it is alive and well
    await providers.aclose()
    assert any(isinstance(e, McpCallStarted) for e in on_event.events)
    assert notes(tmp_path) == {}
    assert listed.ok
    assert listed.text == '{"result":[]}'


async def test_stall_before_a_model_request__the_request_is_never_sent(db: Database) -> None:
    store = SessionStore(db, staleness_seconds=STALENESS)
    _, session = await new_session(store)
    async with OpenAIStandIn() as model:
        model.push(
            openai.tool_call_reply([("call_1", "shell", {"command": "echo one"})]),
            openai.text_reply("done"),
        )
        settings = Settings(
            model_provider="openai", openai_api_key="sk-test", openai_base_url=model.base_url
        )
        providers = ProviderCache(settings)
        agent = Agent(store, providers, AgentConfig(heartbeat_seconds=HEARTBEAT))
        with pytest.raises(DatabaseUnreachable):
            await agent.run_turn(
                session.id,
                user_message=user_message("run it"),
                last_message_id=None,
                on_event=StallOn(ModelCalled, nth=2),
            )
        await providers.aclose()
        assert len(model.requests) == 1  # the request after the tool's result was never sent

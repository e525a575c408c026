"""A server's answer is bounded in bytes before anything parses it, over stdio and HTTP: a
100 MB answer ends its call as an error naming the limit, leaves the server connected, and
leaves the replica's other turns and leases running (their locks are never lost)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from core.agent.loop import Agent, AgentConfig, TurnResult
from core.agent.model_choice import ProviderCache
from core.messages import user_message
from core.settings import Settings
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from core.tools.stdio import MAX_MESSAGE_BYTES
from standins.mcp_notes import NotesHttpServer
from tests.helpers import new_session, shell_output
from tests.mcp_support import notes_entry, running

# Starts MCP servers as processes: outside the developer's quick subset (README).
pytestmark = pytest.mark.slow

HUGE = 100_000_000  # characters of the answer: 100 MB on the wire
# A lock window short enough that a loop stalled for most of it would stop the turns.
STALENESS = 4.0
HEARTBEAT = 1.0
LIMIT = f"{MAX_MESSAGE_BYTES:,} bytes"


async def ask(agent: Agent, session_id: int, text: str) -> TurnResult:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
    )


def tool_part(result: TurnResult) -> dict[str, Any]:
    assert result.answer is not None
    (part,) = [p for p in result.answer.message["parts"] if p["type"].startswith("tool-")]
    return part


async def test_stdio__a_100_mb_answer_is_a_tool_error_and_the_replica_keeps_its_turns(
    db: Database, tmp_path: Path
) -> None:
    store = SessionStore(db, staleness_seconds=STALENESS)
    providers = ProviderCache(Settings(model_provider="offline"))
    async with running(tmp_path, {"notes": notes_entry(tmp_path, timeout=30)}) as tools:
        agent = Agent(store, providers, AgentConfig(heartbeat_seconds=HEARTBEAT), tools=tools)
        _, flooded = await new_session(store)
        _, other = await new_session(store)
        huge = asyncio.create_task(
            ask(agent, flooded.id, f'mcp__notes__fault {{"kind": "huge", "size": {HUGE}}}')
        )
        others: list[TurnResult] = []
        while not huge.done():  # another conversation's turns, one after another meanwhile
            others.append(await ask(agent, other.id, f"$ echo turn {len(others)}"))
        flooded_result = await huge  # not DatabaseUnreachable: its lease held throughout
        after = await tools.call("mcp__notes__list_notes", {})
    await providers.aclose()
    part = tool_part(flooded_result)
    assert part["state"] == "output-error"
    assert LIMIT in part["errorText"]
    assert "notes" in part["errorText"]
    assert others, "no other turn ran while the answer arrived"
    assert all(
        r.error is None and shell_output(r.answer) == f"turn {i}\n" for i, r in enumerate(others)
    )
    assert after.ok  # the server stayed connected


async def test_http__a_100_mb_answer_is_a_tool_error_and_the_server_stays(
    tmp_path: Path,
) -> None:
    env = {"MCP_NOTES_FAULTS": "1", "MCP_NOTES_FILE": str(tmp_path / "notes.json")}
    with NotesHttpServer(env=env) as server:
        async with running(tmp_path, {"web": {"url": server.url}}) as tools:
            huge = await tools.call("mcp__web__fault", {"kind": "huge", "size": HUGE})
            after = await tools.call("mcp__web__list_notes", {})
    assert not huge.ok
    assert LIMIT in huge.text
    assert after.ok

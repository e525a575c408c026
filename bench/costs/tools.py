"""What an MCP tool call and an approval cost us, beside the tool's own time.

Real parts: the runtime built from settings, the offline model (a deterministic stand-in, so no
model time is measured), the notes MCP server of ``standins.mcp_notes`` over stdio, the
conversation door as every surface calls it. Three figures, in ms:

- ``turn_without_tool``: a turn whose model answers in words (the baseline);
- ``mcp_call_overhead``: a turn whose model calls a read-only MCP tool, minus the tool's own round
  trip (``McpCallFinished.seconds``: the SDK's request to the server and its answer) and minus
  the baseline's median: what offering, checking, recording and replaying a call adds (the
  extra model step included, which the offline model makes nearly free);
- ``approval_round_trip``: a turn that stops at a call needing approval (request recorded, lock
  released), the decision (one conditional write), and the turn that carries it out and
  continues, minus the tool's own round trip: our own work through an approval and back;
- ``approval_click_to_call``: of that, what issue 35 names the round trip, from the click (the
  decision handed to the door, as a surface hands it) to the approved call going out to its
  server (the door's ``ToolBegan``, emitted as the request is sent): the decision's checks and
  write, the claim, the request moved to running, the history loaded. Read against
  ``turn_without_tool`` (``approval_click_to_call_in_plain_turns``: the two medians' ratio).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from bench.common import summarize
from core.conversation import (
    Answered,
    Arrival,
    Choice,
    Conversations,
    Payer,
    QuietRenderer,
    ToolBegan,
    ToolEnded,
    TurnEnd,
    TurnEvent,
)
from core.records import Actor
from core.runtime import Runtime
from core.settings import Settings
from standins.mcp_notes import stdio_entry

READ = 'mcp__notes__read_note {"title": "plan"}'
ADD = 'mcp__notes__add_note {"title": "plan", "text": "ship on friday"}'
CONNECT_SECONDS = 120.0
PERSON = "bench:tools"


@contextlib.asynccontextmanager
async def _runtime(database_url: str | None) -> AsyncIterator[Runtime]:
    with tempfile.TemporaryDirectory(prefix="slack-agent-bench-tools-") as tmp:
        config = Path(tmp) / "mcp.json"
        entry = stdio_entry({"MCP_NOTES_FILE": str(Path(tmp) / "notes.json")})
        config.write_text(json.dumps({"mcpServers": {"notes": entry}}))
        settings = Settings(
            database_url=database_url or f"sqlite+aiosqlite:///{tmp}/bench.db",
            model_provider="offline",
            mcp_config=str(config),
            auto_compact_tokens=0,
        )
        runtime = await Runtime.open(settings)
        try:
            assert runtime.tools is not None
            async with asyncio.timeout(CONNECT_SECONDS):
                await runtime.tools.wait_for("notes", "connected")
            yield runtime
        finally:
            await runtime.close()


class _ToolTime(QuietRenderer):
    """A turn rendered nowhere; what it keeps is the tool's own round trips, when the first
    call went out and the ending."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.first_call_at: float | None = None  # perf_counter
        self.end: TurnEnd | None = None

    async def event(self, event: TurnEvent) -> None:
        if isinstance(event, ToolBegan) and self.first_call_at is None:
            self.first_call_at = time.perf_counter()
        if isinstance(event, ToolEnded):
            self.seconds += event.seconds

    async def finish(self, end: TurnEnd) -> Sequence[str]:
        self.end = end
        return ()


async def _turn(conversations: Conversations, key: str, text: str) -> tuple[float, float, Any]:
    """One answer through the door, as a surface asks for it: elapsed, tool time, the result."""
    tool = _ToolTime()
    started = time.perf_counter()
    end = await conversations.answer(Arrival(PERSON, text, key=key, payer=Payer(PERSON)), tool)
    elapsed = time.perf_counter() - started
    assert isinstance(end, Answered), end
    return elapsed, tool.seconds, end.result


async def bench_tools(database_url: str | None, *, quick: bool = False) -> dict[str, Any]:
    n = 20 if quick else 100
    async with _runtime(database_url) as runtime:
        conversations = runtime.conversations(f"bench-tools-{os.getpid()}")
        baseline: list[float] = []
        with_call: list[float] = []
        round_trip: list[float] = []
        click_to_call: list[float] = []
        await _turn(conversations, "warm-0", READ)  # the first call pays imports and caches
        for i in range(n):
            elapsed, _, _ = await _turn(conversations, f"plain-{i}", "hello")
            baseline.append(elapsed)
            elapsed, tool_seconds, _ = await _turn(conversations, f"read-{i}", READ)
            with_call.append(elapsed - tool_seconds)
        median = sorted(baseline)[len(baseline) // 2]
        for i in range(n):
            key = f"ask-{i}"
            started = time.perf_counter()
            elapsed, _, result = await _turn(conversations, key, ADD)
            assert result.approval is not None
            # The decision and its carrying out: one call, as the terminal and the API make it.
            tool = _ToolTime()
            choice = Choice(result.approval.id, PERSON, approve=True, by=PERSON)
            clicked = time.perf_counter()
            outcome = await conversations.decide(choice, tool, payer=Payer(PERSON))
            assert isinstance(outcome, Answered), outcome
            assert tool.first_call_at is not None  # the approved call went out
            round_trip.append(time.perf_counter() - started - tool.seconds)
            click_to_call.append(tool.first_call_at - clicked)
        # The database may be a real one: the bench's sessions go (their requests with them).
        admin = Actor(None, admin=True)
        for session in await runtime.storage.sessions.list_sessions(
            project_name=conversations.project, limit=10 * n
        ):
            await runtime.storage.sessions.delete_session(session.id, admin)
    return {
        "turn_without_tool": summarize(baseline),
        "turn_with_mcp_call_excluding_tool": summarize(with_call),
        # Each turn with a call against the baseline's median (can be below 0: noise).
        "mcp_call_overhead": summarize([s - median for s in with_call]),
        "approval_round_trip": summarize(round_trip),
        "approval_click_to_call": summarize(click_to_call),
        "approval_click_to_call_in_plain_turns": round(
            sorted(click_to_call)[len(click_to_call) // 2] / median, 2
        ),
    }

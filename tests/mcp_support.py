"""Helpers of the MCP tests: a config file written as an operator would, tools over real servers."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from core.tools import Backoff, McpTools, load_mcp_config
from standins.mcp_notes import stdio_entry

# Fast enough that a test waiting for a restart does not wait long; still exponential.
FAST = Backoff(initial=0.05, maximum=0.5)
# Generous: the machine is shared and a Python MCP server takes a second or two to start.
READY_SECONDS = 60.0


def notes_entry(tmp_path: Path, *, faults: bool = True, **extra: Any) -> dict[str, Any]:
    env = {"MCP_NOTES_FILE": str(tmp_path / "notes.json")}
    if faults:
        env["MCP_NOTES_FAULTS"] = "1"
    env.update(extra.pop("env", {}))
    return stdio_entry(env, **extra)


def write_config(tmp_path: Path, servers: Mapping[str, Any]) -> str:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return str(path)


def notes_config(tmp_path: Path) -> str:
    """The ``MCP_CONFIG`` of one notes server writing ``tmp_path``'s notes file: what the
    approval tests' runtimes and processes read."""
    return write_config(tmp_path, {"notes": notes_entry(tmp_path)})


@asynccontextmanager
async def running(
    tmp_path: Path, servers: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
) -> AsyncIterator[McpTools]:
    """The servers started from a config file, every first attempt made; closed afterwards."""
    config = load_mcp_config(write_config(tmp_path, servers), environ=environ or os.environ)
    async with McpTools(config, backoff=FAST) as tools:
        async with asyncio.timeout(READY_SECONDS):
            await tools.wait_ready()
        yield tools


def notes(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "notes.json"
    return json.loads(path.read_text()) if path.exists() else {}


def calls_counted(server: str, tool: str, outcome: str) -> float:
    labels = {"server": server, "tool": tool, "outcome": outcome}
    return REGISTRY.get_sample_value("slack_agent_mcp_tool_calls_total", labels) or 0.0


def calls_timed(server: str) -> float:
    labels = {"server": server}
    return REGISTRY.get_sample_value("slack_agent_mcp_tool_call_seconds_count", labels) or 0.0


def alive(pid: int) -> bool:
    """Whether a process of that id exists (a zombie counts: it was never reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True

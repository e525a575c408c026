"""``slack-agent tools``: what the agent would be offered, as an operator checks it.

It starts every server as ``serve`` would, waits for each one's first answer (at most its
timeout), prints each server (its state, and why when it is not connected) and each tool with its
approval rule, then stops them all. Nothing it prints carries an expanded ``${VAR}``.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress

from core.settings import Settings
from core.tools.config import McpConfig, load_mcp_config, with_known_secrets
from core.tools.connection import startup_seconds
from core.tools.server import ServerStatus
from core.tools.toolbox import McpTools

# Beyond the servers' own timeouts: a first attempt is bounded by them, this is the margin.
READY_MARGIN_SECONDS = 5.0


async def tools_report(settings: Settings) -> str:
    config = with_known_secrets(load_mcp_config(settings.mcp_config), settings.secret_values())
    if config.path is None:
        where = (
            "MCP_CONFIG is empty"
            if settings.mcp_config is not None
            else ("MCP_CONFIG is unset and there is no ./mcp.json")
        )
        return f"no MCP servers configured ({where})"
    async with McpTools(config) as tools:
        longest = max((startup_seconds(s) for s in config.servers), default=0.0)
        with suppress(TimeoutError):
            async with asyncio.timeout(longest + READY_MARGIN_SECONDS):
                await tools.wait_ready()
        return format_report(config, tools.status())


def format_report(config: McpConfig, statuses: list[ServerStatus]) -> str:
    lines = [f"MCP servers in {config.path}:" if statuses else f"no MCP servers in {config.path}"]
    for status in statuses:
        lines.append("")
        lines.append(f"{status.name}  ({status.transport}: {status.target})")
        lines.append(f"  state: {_state(status)}")
        approvers = ", ".join(status.approvers) or "none besides the owner and admins"
        lines.append(f"  approval: {status.approval}; approvers: {approvers}")
        if status.tools:
            width = max(len(t.name) for t in status.tools)
            for tool in status.tools:
                hint = " (read-only)" if tool.read_only else ""
                lines.append(f"  {tool.name:<{width}}  {tool.rule}{hint}")
        elif status.state == "connected":
            lines.append("  (the server offers no tools)")
        elif status.state != "disabled":
            lines.append("  (its tools are absent until it answers)")
    return "\n".join(lines)


def _state(status: ServerStatus) -> str:
    if status.state == "connected":
        return f"connected, {len(status.tools)} tools offered"
    if status.state == "starting":
        return "starting (no answer yet)"
    if status.state == "disabled":
        return "disabled"
    return f"{status.state}: {status.reason}"

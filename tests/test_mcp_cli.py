"""``slack-agent tools`` as an operator runs it: a real process, real servers, one line for a
broken file, and no expanded secret anywhere in what it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from standins.processes import free_port
from tests.mcp_support import notes_entry
from tests.test_cli import cli, one_line_error

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

SECRET = "cli-secret-0c4d2b9e8f71"


def test_tools__no_configuration() -> None:
    result = cli("tools")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "no MCP servers configured (MCP_CONFIG is unset and there is no ./mcp.json)"
    )


def test_tools__servers_states_and_rules(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/mcp?key=${{CLI_TOKEN}}"
    servers = {
        "notes": notes_entry(tmp_path, faults=False, approvers=["T0123:U0456"]),
        "remote": {"url": url, "headers": {"Authorization": "Bearer ${CLI_TOKEN}"}},
        "old": {"command": "old-server", "disabled": True},
        "gone": {"command": str(tmp_path / "no-such-server"), "approval": "always"},
    }
    (tmp_path / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    result = cli("tools", CLI_TOKEN=SECRET)  # ./mcp.json, the default
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"MCP servers in {tmp_path / 'mcp.json'}:"
    notes_at = lines.index(next(line for line in lines if line.startswith("notes  (stdio: ")))
    assert lines[notes_at + 1 : notes_at + 6] == [
        "  state: connected, 3 tools offered",
        "  approval: unless_read_only; approvers: T0123:U0456",
        "  mcp__notes__add_note    asks for approval",
        "  mcp__notes__list_notes  runs without asking (read-only)",
        "  mcp__notes__read_note   runs without asking (read-only)",
    ]
    remote_at = lines.index(f"remote  (http: {url})")
    assert lines[remote_at + 1].startswith("  state: failed: cannot be reached (ConnectError")
    assert lines[remote_at + 3] == "  (its tools are absent until it answers)"
    old_at = lines.index("old  (stdio: old-server)")
    assert lines[old_at + 1] == "  state: disabled"
    gone_at = next(i for i, line in enumerate(lines) if line.startswith("gone  (stdio: "))
    assert lines[gone_at + 1 : gone_at + 3] == [
        "  state: failed: cannot be started (No such file or directory)",
        "  approval: always; approvers: none besides the owner and admins",
    ]
    assert SECRET not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_tools__malformed_configuration_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "servers.json"
    path.write_text(
        json.dumps({"mcpServers": {"notes": {"command": "x", "env": {"K": "${NOPE}"}}}})
    )
    result = cli("tools", MCP_CONFIG=str(path))
    assert one_line_error(result) == (
        f"slack-agent: config_invalid: MCP_CONFIG {path}: server 'notes': env.K: ${{NOPE}} "
        "is not set in the environment"
    )

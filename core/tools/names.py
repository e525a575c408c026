"""How an MCP tool is named to the model: ``mcp__<server>__<tool>``.

Both model APIs accept tool names of letters, digits, ``_`` and ``-`` up to 64 characters. A
server name is therefore letters and digits with single ``-`` or ``_`` between them (so the
``__`` after it is unambiguous), and a tool name's other characters (MCP allows ``.``) become
``_``. A tool whose full name would still be too long is not offered (the server's log line says
so) rather than cut, since two cut names could collide.
"""

from __future__ import annotations

import re

PREFIX = "mcp__"
MAX_NAME_LENGTH = 64
MAX_SERVER_NAME_LENGTH = 32
SERVER_NAME = re.compile(r"[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*")
_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9_-]")


def server_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a server's name in ``mcp__<server>__<tool>``, or None."""
    if not SERVER_NAME.fullmatch(name):
        return (
            "a server name must be letters and digits with single - or _ between them "
            "(it becomes part of the tool names mcp__<server>__<tool>)"
        )
    if len(name) > MAX_SERVER_NAME_LENGTH:
        return f"a server name is at most {MAX_SERVER_NAME_LENGTH} characters"
    return None


def offered_name(server: str, tool: str) -> str | None:
    """The name the model calls ``tool`` of ``server`` by, or None if it would be too long."""
    name = f"{PREFIX}{server}__{_NOT_ALLOWED.sub('_', tool)}"
    return name if len(name) <= MAX_NAME_LENGTH and tool else None


def is_mcp_tool_name(name: str) -> bool:
    """Whether a tool call in a transcript went to an MCP server (rewind names such calls)."""
    return name.startswith(PREFIX)


def server_of(name: str) -> str | None:
    """The server part of an offered name (``mcp__notes__add_note`` → ``notes``), or None."""
    if not is_mcp_tool_name(name):
        return None
    server, sep, tool = name[len(PREFIX) :].partition("__")
    return server if sep and tool and SERVER_NAME.fullmatch(server) else None

"""``${VAR}`` in the MCP servers' file, and keeping what it expands to out of every text we emit.

An operator names a secret by reference (``"Authorization": "Bearer ${GITHUB_TOKEN}"``); the
value lives only in the environment and in the connection that needs it. Everything we show
(config objects' repr, ``slack-agent tools``, log lines) uses the unexpanded form, and a
``Redactor`` replaces any expanded value that still finds its way into a text (a library's error
message quoting a URL, a server echoing its token) by its ``${VAR}`` name.

The ``Redactor`` itself lives in ``core.redaction`` (the log set-up uses it too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from core.redaction import MIN_SECRET_LENGTH, RedactingFilter, Redactor

__all__ = ["MIN_SECRET_LENGTH", "WATCHED_LOGGERS", "RedactingFilter", "Redactor", "expand"]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand(value: str, environ: Mapping[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """``value`` with every ``${VAR}`` (or ``${VAR:-default}``) replaced from ``environ``.

    Returns the expanded text and the ``(value, "${VAR}")`` pairs it took from the environment.
    Raises ``ValueError`` with the problem (an unset variable, a malformed reference); a ``$``
    not followed by ``{`` is literal.
    """
    out: list[str] = []
    used: list[tuple[str, str]] = []
    rest = value
    while (start := rest.find("${")) >= 0:
        out.append(rest[:start])
        end = rest.find("}", start)
        if end < 0:
            raise ValueError(f"{rest[start:]!r} has no closing brace")
        body = rest[start + 2 : end]
        name, sep, default = body.partition(":-")
        if not _NAME.fullmatch(name):
            raise ValueError(f"${{{body}}} does not name an environment variable")
        if name in environ:
            out.append(environ[name])
            used.append((environ[name], f"${{{name}}}"))
        elif sep:
            out.append(default)
        else:
            raise ValueError(f"${{{name}}} is not set in the environment")
        rest = rest[end + 1 :]
    out.append(rest)
    return "".join(out), used


# Loggers that may quote a URL, a header line or a server's output (see RedactingFilter): the
# SDK's, its HTTP client's, and ours (whose lines are built from redacted text already).
WATCHED_LOGGERS = (
    "slack-agent.mcp",
    "client",
    "httpx2",
    "mcp.client.client",
    "mcp.client.stdio",
    "mcp.client.streamable_http",
    "mcp.os.posix.utilities",
    "mcp.shared.dispatcher",
    "mcp.shared.jsonrpc_dispatcher",
)

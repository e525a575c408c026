"""``${VAR}`` in the MCP servers' file, and keeping what it expands to out of every text we emit.

An operator names a secret by reference (``"Authorization": "Bearer ${GITHUB_TOKEN}"``); the
value lives only in the environment and in the connection that needs it. Everything we show
(config objects' repr, ``slack-agent tools``, log lines) uses the unexpanded form, and a
``Redactor`` replaces any expanded value that still finds its way into a text (a library's error
message quoting a URL, a server echoing its token) by its ``${VAR}`` name.

Values shorter than ``MIN_SECRET_LENGTH`` are not redacted: no credential is that short, and
replacing every ``1`` or ``true`` in a tool's output would mangle ordinary text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

MIN_SECRET_LENGTH = 8
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


class Redactor:
    """Replaces secret values by the ``${VAR}`` that named them, longest value first (so a value
    containing another is replaced whole)."""

    __slots__ = ("_pairs",)

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        unique = {value: name for value, name in pairs if len(value) >= MIN_SECRET_LENGTH}
        self._pairs = sorted(unique.items(), key=lambda pair: -len(pair[0]))

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def __repr__(self) -> str:
        return f"Redactor({len(self._pairs)} values, not shown)"

    def merged(self, pairs: Iterable[tuple[str, str]]) -> Redactor:
        """This redactor and ``pairs`` (e.g. ``Settings.secret_values``): a value both name
        keeps the name this one gave it."""
        return Redactor([*pairs, *self._pairs])

    def redact(self, text: str) -> str:
        for value, name in self._pairs:
            if value in text:
                text = text.replace(value, name)
        return text

    def contains_secret(self, text: str) -> bool:
        return any(value in text for value, _ in self._pairs)


class RedactingFilter(logging.Filter):
    """Rewrites a log record whose message or traceback would show a secret.

    Attached to the loggers of the MCP SDK and its HTTP client while servers run: they log
    endpoint URLs and request lines at debug level, and a URL may carry a key.
    """

    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.redactor.contains_secret(message):
            record.msg, record.args = self.redactor.redact(message), None
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            if self.redactor.contains_secret(text):
                # Formatters print ``exc_text`` when set; dropping ``exc_info`` keeps a formatter
                # that formats the exception itself from printing the unredacted one.
                record.exc_text, record.exc_info = self.redactor.redact(text), None
        return True


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

"""Keeping secret values out of every text the product emits: a ``Redactor`` replaces each
known value by its name (``${SLACK_BOT_TOKEN}``), and ``RedactingFilter`` applies one to log
records. Kept at the bottom of ``core`` so the log set-up (``core.logs``) and the MCP tools
(``core.tools.secrets``, which adds the ``${VAR}``s of ``mcp.json``) share it.

Values shorter than ``MIN_SECRET_LENGTH`` are not redacted: no credential is that short, and
replacing every ``1`` or ``true`` in a tool's output would mangle ordinary text.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

MIN_SECRET_LENGTH = 8


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

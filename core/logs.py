"""Logging set up once at the entry point: LOG_LEVEL, and LOG_FORMAT text or one JSON per line."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from datetime import UTC, datetime

from core.redaction import RedactingFilter, Redactor


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, ensure_ascii=False)


def configure_logging(
    level: str = "INFO", fmt: str = "text", secrets: Iterable[tuple[str, str]] = ()
) -> None:
    """``secrets``: ``(value, name)`` pairs (``Settings.secret_values``) no line may show: a
    library's error quoting a URL with its password, a server's stderr echoing a token."""
    handler = logging.StreamHandler(sys.stderr)
    redactor = Redactor(secrets)
    if redactor:
        handler.addFilter(RedactingFilter(redactor))
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic narrates every migration step at INFO; operators need only its warnings.
    logging.getLogger("alembic").setLevel(max(root.level, logging.WARNING))

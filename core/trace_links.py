"""``TRACE_URL_TEMPLATE``: a link from a finished reply to its trace in the tracing back end.

The template is a URL with ``{trace_id}`` where the trace's id goes, as 32 lowercase hex digits
(how OTLP back ends such as Phoenix, Jaeger and Tempo show it). Nothing else may be
substituted, so a typo (``{traceid}``) stops start-up instead of making every link broken.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any, Final

from core.errors import ConfigError

FIELD = "trace_id"
# Where an answer keeps its turn's trace id (``metadata.trace_id``, 32 hex digits).
TRACE_ID: Final = "trace_id"
_HEX_ID: Final = re.compile(r"[0-9a-f]{32}")


def check_url_template(template: str) -> None:
    """``ConfigError`` naming ``TRACE_URL_TEMPLATE`` unless it is a URL with ``{trace_id}``."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ConfigError(f"TRACE_URL_TEMPLATE: {template!r} is not a template: {exc}") from None
    if fields != {FIELD}:
        other = sorted(fields - {FIELD})
        reason = f"unknown field {{{other[0]}}}" if other else "it has no {trace_id}"
        raise ConfigError(f"TRACE_URL_TEMPLATE: {template!r}: {reason}; put {{trace_id}} in it")
    if not template.startswith(("http://", "https://")):
        raise ConfigError(f"TRACE_URL_TEMPLATE: {template!r} is not an http(s) URL")


def trace_url(template: str | None, trace_id: int) -> str | None:
    """The link for ``trace_id`` (OTel's integer form), or ``None`` without a template."""
    if template is None:
        return None
    return template.format(trace_id=format(trace_id, "032x"))


def stored_trace_url(template: str | None, metadata: Mapping[str, Any]) -> str | None:
    """The link for a stored answer (``metadata``: its message's), or ``None`` without a
    template or a recorded trace. The template is the one configured now, so a link follows
    the tracing back end when it moves."""
    trace_id = metadata.get(TRACE_ID)
    if not isinstance(trace_id, str) or not _HEX_ID.fullmatch(trace_id):
        return None
    return trace_url(template, int(trace_id, 16))

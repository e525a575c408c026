"""UIMessages (the Vercel AI SDK shape ``{id, role, parts[], metadata}``) and the ids they carry.

The transcript stores messages in this shape so any client that speaks it can read a session
without a translation layer; these helpers are the only place that builds or reads them.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

Message = dict[str, Any]

# Namespace for ids derived from Slack coordinates: the same Slack message always maps to the
# same UUID, so a retried delivery can never be stored twice.
_SLACK_NAMESPACE = uuid.UUID("5a1c7a9e-6f2b-4d7e-9a43-8f1c2b3d4e5f")


def new_message_id() -> str:
    """A version 7 UUID: time-ordered, so a session's new messages land at the right edge of
    the ``message_id`` index instead of at random places in it (fewer pages touched per insert,
    on both databases)."""
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & (2**48 - 1)) << 80 | 0x7 << 76 | (rand >> 68) << 64 | 0b10 << 62
    value |= rand & (2**62 - 1)
    return str(uuid.UUID(int=value))


def slack_message_id(team_id: str, channel_id: str, ts: str) -> str:
    return str(uuid.uuid5(_SLACK_NAMESPACE, f"{team_id}/{channel_id}/{ts}"))


def text_message(
    role: str, text: str, *, message_id: str | None = None, **metadata: Any
) -> Message:
    return {
        "id": message_id or new_message_id(),
        "role": role,
        "parts": [{"type": "text", "text": text}],
        "metadata": metadata,
    }


def user_message(text: str, *, message_id: str | None = None, **metadata: Any) -> Message:
    return text_message("user", text, message_id=message_id, **metadata)


def assistant_message(text: str, *, message_id: str | None = None, **metadata: Any) -> Message:
    return text_message("assistant", text, message_id=message_id, **metadata)


def message_text(message: Message) -> str:
    """The concatenated text parts: what a person would read of the message."""
    parts = message.get("parts", ())
    if len(parts) == 1:  # most messages: one part; this runs for every message of a history
        part = parts[0]
        if not (isinstance(part, dict) and part.get("type") == "text"):
            return ""
        text = part.get("text", "")
        if type(text) is str:
            return text
    return "".join(
        [
            part.get("text", "")
            for part in parts
            if isinstance(part, dict) and part.get("type") == "text"
        ]
    )


def said_anything(message: Message) -> bool:
    """The message holds more than the markers of model calls begun (text, a tool call...)."""
    return any(part.get("type") != "step-start" for part in message.get("parts") or [])


def with_new_id(message: Message) -> Message:
    """A copy with a fresh id (forks break identity with their source)."""
    return {**message, "id": new_message_id()}


def shorten(text: str, limit: int = 80) -> str:
    """Titles: first line, whitespace folded, cut on a word boundary with an ellipsis (and no
    NUL, which a database column cannot hold)."""
    line = " ".join(text.replace("\x00", "").strip().split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 1].rsplit(" ", 1)[0] or line[: limit - 1]
    return cut + "…"

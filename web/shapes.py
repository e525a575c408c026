"""What the API says, in the shapes of docs/http-api.md: sessions, UIMessages, cursors.

A stored message is already an AI SDK UIMessage (``{id, role, parts, metadata}``); the API
adds to its ``metadata`` what a client shows beside it (who wrote it, a checkpoint, the trace
link) and leaves the parts as they are, so ``useChat`` renders a loaded transcript and a
streamed answer alike.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from core.conversation import (
    ApprovalRecord,
    Place,
    SessionInfo,
    StoredMessage,
    argument_lines,
    place,
    stored_trace_url,
)
from web.errors import bad_request


def when(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat().replace("+00:00", "Z")


def place_json(where: Place) -> dict[str, Any]:
    return {"kind": where.kind, "surface": where.surface, "url": where.url}


def session_json(
    session: SessionInfo,
    *,
    owner: str | None,
    owner_name: str | None,
    last_message_id: str | None,
    waiting: ApprovalRecord | None,
    approval_timeout_seconds: float,
    active: bool | None = None,
) -> dict[str, Any]:
    return {
        "id": session.id,
        "title": session.title,
        "createdAt": when(session.created_at),
        "updatedAt": when(session.updated_at),
        "place": place_json(place(session)),
        "owner": {"person": owner, "name": owner_name},
        "temporary": session.expires_at is not None,
        "isActive": session.is_turn_active if active is None else active,
        "lastMessageId": last_message_id,
        "pendingApproval": None
        if waiting is None
        # Who asked: the author of the message the model was answering; a request written
        # before that was kept (migration 0008) is shown as the owner's, as it was then.
        else approval_json(waiting, waiting.requested_by or owner, approval_timeout_seconds),
    }


def approval_json(
    record: ApprovalRecord, requested_by: str | None, timeout_seconds: float
) -> dict[str, Any]:
    return {
        "approvalId": record.id,
        "toolCallId": record.tool_call_id,
        "toolName": record.tool_name,
        "server": record.server,
        "input": record.arguments,
        # What a person reads before approving: every argument, nothing cut, characters that
        # would hide or reorder text written as escapes (as Slack's card and the terminal show).
        "shown": argument_lines(record.arguments),
        "requestedBy": requested_by,
        "expiresAt": when(record.requested_at + timedelta(seconds=timeout_seconds)),
    }


_USAGE_NAMES = {
    "input_tokens": "inputTokens",
    "output_tokens": "outputTokens",
    "cached_tokens": "cachedTokens",
    "cost_usd": "costUsd",
}


def metadata_json(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A stored message's metadata as the API names it: ``usage`` in the contract's words
    (``inputTokens``, ``outputTokens``, ``costUsd``, …)."""
    metadata = dict(stored)
    usage = metadata.get("usage")
    if isinstance(usage, Mapping):
        metadata["usage"] = {_USAGE_NAMES.get(k, k): v for k, v in usage.items()}
    return metadata


def ui_message(
    stored: StoredMessage,
    *,
    team: str | None,
    created_at: datetime | None = None,
    trace_template: str | None = None,
) -> dict[str, Any]:
    """A stored message as the API shows it (``team``: the Slack workspace of the session, to
    name a Slack author as a person; ``trace_template``: ``TRACE_URL_TEMPLATE``, for an
    answer's link to its trace)."""
    message = stored.message
    metadata = metadata_json(message.get("metadata") or {})
    if created_at is not None:
        metadata["createdAt"] = when(created_at)
    author = metadata.get("author")
    slack_user = metadata.get("slack_user")
    if not isinstance(author, str) and isinstance(slack_user, str) and team is not None:
        author = f"slack:{team}:{slack_user}"
    metadata["author"] = author if isinstance(author, str) else None
    metadata["checkpoint"] = stored.is_compaction_message
    metadata["interrupted"] = bool(metadata.get("interrupted"))
    trace_url = stored_trace_url(trace_template, metadata)
    if trace_url is not None:
        metadata["traceUrl"] = trace_url
    return {
        "id": stored.message_id,
        "role": message.get("role"),
        "parts": list(message.get("parts") or []),
        "metadata": metadata,
    }


def cursor(value: Mapping[str, Any]) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(value)).decode().rstrip("=")


def read_cursor(value: str | None) -> dict[str, Any] | None:
    """A cursor this API handed out; a 400 for anything else."""
    if not value:
        return None
    try:
        decoded = orjson.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (binascii.Error, ValueError, orjson.JSONDecodeError):
        raise bad_request("cursor: not a cursor this API gave out") from None
    if not isinstance(decoded, dict):
        raise bad_request("cursor: not a cursor this API gave out")
    return decoded


def read_limit(value: str | None, default: int, most: int) -> int:
    if value is None or value == "":
        return default
    try:
        limit = int(value)
    except ValueError:
        raise bad_request(f"limit: {value!r} is not a whole number") from None
    if not 1 <= limit <= most:
        raise bad_request(f"limit: must be between 1 and {most}")
    return limit


def read_datetime(value: object) -> datetime:
    if not isinstance(value, str):
        raise bad_request("cursor: not a cursor this API gave out")
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise bad_request("cursor: not a cursor this API gave out") from None

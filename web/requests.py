"""Reading a request: its JSON body, its session id; and answering JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from web.errors import ApiError, bad_request, not_found

MAX_BODY_BYTES = 1 << 20
TITLE_MOST = 255


async def unknown(request: web.Request) -> web.StreamResponse:
    raise not_found("endpoint")


def session_id_of(request: web.Request) -> int:
    raw = request.match_info["id"]
    if not raw.isdigit() or len(raw) > 18:
        raise not_found("session")
    return int(raw)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object (400 otherwise; 413 past the listener's size limit)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise ApiError(413, "too_large", "the request body is over 1 MiB")
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise bad_request("the body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def read_title(body: Mapping[str, Any], *, required: bool) -> str | None:
    title = body.get("title")
    if title is None and not required:
        return None
    if not isinstance(title, str) or not title.strip():
        raise bad_request("title: a non-empty string")
    if len(title) > TITLE_MOST:
        raise bad_request(f"title: at most {TITLE_MOST} characters")
    return title.strip()


def json_response(value: Any, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(value), status=status, content_type="application/json")

"""Reading Slack's payloads without trusting their shape.

Slack sends well-formed JSON, but a request that passed the signature check can still hold a
value of the wrong type anywhere (a bug upstream, a replay with a tampered body and a leaked
secret, a future format). Every field the app reads goes through these, so a wrong type is an
``InvalidRequest`` (a 400, nothing written) rather than a crash halfway through a handler.
"""

from __future__ import annotations

from typing import Any

from core.errors import InvalidRequest


def obj(value: Any, what: str) -> dict[str, Any]:
    """An object that must be there."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} is not an object")
    return value


def optional_obj(value: Any, what: str) -> dict[str, Any]:
    """An object that may be absent (an empty one then)."""
    return {} if value is None else obj(value, what)


def string(value: Any, what: str) -> str | None:
    """A string that may be absent; anything else is malformed."""
    if value is None or isinstance(value, str):
        return value
    raise InvalidRequest(f"{what} is not a string")


def nested_string(container: Any, *path: str) -> str | None:
    """``container[path[0]][path[1]]…`` as an optional string (``body.user.id``)."""
    value: Any = container
    for i, key in enumerate(path):
        value = optional_obj(value, ".".join(path[:i]) or "payload").get(key)
    return string(value, ".".join(path))

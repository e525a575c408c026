"""The API's one error shape: ``{"code": …, "message": one line}``, with a status per code.

Handlers raise ``ApiError`` (or let one of the core's errors through, mapped here by its
class), and ``guarded`` answers it as JSON. Anything else is logged and answered 500 with
``internal_error``: a client never sees a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from core.conversation import refused_budget
from core.errors import (
    AgentSessionAlreadyCompact,
    AgentSessionBudgetExceeded,
    AgentSessionBusy,
    AgentSessionForbidden,
    AgentSessionNotFound,
    DatabaseError,
    DatabaseValueRefused,
    DuplicateMessage,
    InvalidMessage,
    InvalidRequest,
    MessageNotFound,
    SlackAgentError,
    UsageError,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    """A 4xx (or 5xx) answered as JSON; ``extra``: the code's own fields (``unseen``, …)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})
        self.extra = extra

    def response(self) -> web.Response:
        body = {"code": self.code, "message": self.message, **self.extra}
        return web.json_response(body, status=self.status, headers=self.headers)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "bad_request", message)


def not_found(what: str = "session") -> ApiError:
    return ApiError(404, "not_found", f"no such {what}")


def from_core(exc: SlackAgentError) -> ApiError:
    """The core's error as the API says it (the same code for the same meaning)."""
    if isinstance(exc, AgentSessionNotFound):
        return not_found("session")
    if isinstance(exc, MessageNotFound):
        return not_found("message")
    if isinstance(exc, AgentSessionForbidden):
        return ApiError(403, "forbidden", exc.message)
    if isinstance(exc, AgentSessionBusy):
        return ApiError(409, "agent_session_busy", "a turn is running on this session")
    if isinstance(exc, DuplicateMessage):
        return ApiError(409, exc.code, "a message with this id is stored already")
    if isinstance(exc, AgentSessionAlreadyCompact):
        return ApiError(409, exc.code, exc.message)
    if isinstance(exc, AgentSessionBudgetExceeded):
        return over_budget(exc)
    if isinstance(exc, InvalidMessage):
        return ApiError(422, "unprocessable", exc.message)
    if isinstance(exc, InvalidRequest | UsageError):
        return bad_request(exc.message)
    if isinstance(exc, DatabaseValueRefused):  # before DatabaseError: sent again, refused again
        return ApiError(400, exc.code, exc.message)
    if isinstance(exc, DatabaseError):
        return ApiError(503, "unavailable", "the database did not answer; try again")
    return ApiError(500, exc.code, exc.message)


def over_budget(exc: AgentSessionBudgetExceeded) -> ApiError:
    return ApiError(
        409,
        "agent_session_budget_exceeded",
        refused_budget(exc).describe(),
        limit=exc.limit,
        resetsAt=exc.resets_at.isoformat(),
    )


def guarded(handler: Handler) -> Handler:
    """``handler`` answering every failure in the API's error shape."""

    async def guard(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except SlackAgentError as exc:
            return from_core(exc).response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(413, "too_large", "the request body is over 1 MiB").response()
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return ApiError(500, "internal_error", "the request failed; see the log").response()

    return guard

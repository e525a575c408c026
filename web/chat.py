"""A turn over HTTP: ``chat``, ``tool_approvals`` and ``stop``.

The turn goes through the conversation door like any surface's (``Conversations.answer``,
``decide``) on the turns' loop; its renderer (``UIMessageStream``) writes to a ``Pipe`` that
this request reads. The response opens only when the turn began (its lock held, the message
stored): a refusal before that (busy, stale, over budget, decided already) is a plain 409
with its code, and nothing was written and no model called. A client that goes away does not
stop its turn (``stop`` does); the answer is in the transcript when it comes back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from core.conversation import (
    DECISION_REASON_MOST,
    AlreadyAnswered,
    Arrival,
    Busy,
    Choice,
    DecisionRecorded,
    DecisionRefused,
    MemoryView,
    OverBudget,
    Stale,
    TurnEnd,
    message_text,
)
from web.auth import Caller
from web.errors import ApiError, bad_request, not_found, over_budget
from web.loops import ENDED, OPENED, Pipe
from web.requests import json_response, read_json, session_id_of
from web.ui_stream import HEADERS, UIMessageStream

if TYPE_CHECKING:
    from web.api import WebApi

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
MESSAGE_MOST = 100_000  # characters of one message


def refusal(end: TurnEnd | DecisionRefused | DecisionRecorded) -> ApiError | None:
    """How a turn that never began is answered (None: it began, the stream says the rest)."""
    if isinstance(end, Busy):
        return ApiError(409, "agent_session_busy", "a turn is running on this session")
    if isinstance(end, Stale):
        return ApiError(
            409,
            "agent_session_messages_stale",
            "the session has messages this client has not seen; load them and send again",
            unseen=len(end.unseen.messages),
        )
    if isinstance(end, OverBudget):
        return over_budget(end.refusal)
    if isinstance(end, AlreadyAnswered):  # a retry of a message stored and answered already
        return ApiError(
            409, "agent_session_message_duplicate", "a message with this id was answered already"
        )
    if isinstance(end, DecisionRefused):
        record = end.record
        if end.reason == "unknown":
            return not_found("approval")
        if end.reason == "not_allowed":
            return ApiError(403, "forbidden", "only the person who asked or an admin decides")
        return ApiError(
            409,
            "tool_approval_already_decided",
            f"the call is {record.state if record else end.reason} already",
            decision=record.state if record else end.reason,
            decidedBy=record.decided_by if record else None,
            reason=record.decision_reason if record else None,
        )
    return None


class Chat:
    def __init__(self, api: WebApi) -> None:
        self.api = api

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        body = await read_json(request)
        text, message_id, last = _chat_body(body)

        async def turn(caller: Caller, renderer: UIMessageStream) -> ApiError | None:
            await self.api.conversation(caller, session_id)  # 404 unless theirs to see
            end = await self.api.conversations.answer(
                Arrival(
                    caller.person,
                    text,
                    session_id=session_id,
                    view=MemoryView(last),
                    admin=caller.admin,
                    display_name=caller.name,
                    message_id=message_id,
                    metadata={"surface": "web", "author": caller.person},
                    payer=caller.payer,
                ),
                renderer,
            )
            return refusal(end)

        return await self._streamed(request, session_id, turn, limited=True)

    async def tool_approvals(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)
        body = await read_json(request)
        approval_id = body.get("approvalId")
        approved = body.get("approved")
        if not isinstance(approval_id, str) or not approval_id:
            raise bad_request("approvalId: a string")
        if not isinstance(approved, bool):
            raise bad_request("approved: true or false")
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise bad_request("reason: a string")
        # Kept with the decision and read by the model: bounded, refused whole (nothing
        # decided) rather than cut, so what is kept is what the person wrote.
        reason = reason.strip() if reason else None
        if reason is not None and len(reason) > DECISION_REASON_MOST:
            raise bad_request(f"reason: at most {DECISION_REASON_MOST} characters")

        async def turn(caller: Caller, renderer: UIMessageStream) -> ApiError | None:
            await self.api.conversation(caller, session_id)
            desk = self.api.conversations.approvals
            record = None if desk is None else await desk.get(approval_id)
            if record is None or record.session_id != session_id:
                raise not_found("approval")
            end = await self.api.conversations.decide(
                Choice(
                    approval_id,
                    caller.person,
                    approved,
                    admin=caller.admin,
                    approver_id=caller.approver_id,
                    by=caller.person,
                    reason=reason or None,
                ),
                renderer,
                payer=caller.payer,
            )
            return refusal(end)

        return await self._streamed(request, session_id, turn, limited=False)

    async def stop(self, request: web.Request) -> web.StreamResponse:
        session_id = session_id_of(request)

        async def work(caller: Caller) -> dict[str, Any]:
            await self.api.conversation(caller, session_id)
            return {"stopped": await self.api.conversations.stop_session(session_id)}

        return json_response(await self.api.on_turns(request, work), status=202)

    # -- a turn streamed across loops -----------------------------------------------------------

    async def _streamed(
        self,
        request: web.Request,
        session_id: int,
        turn: Callable[[Caller, UIMessageStream], Awaitable[ApiError | None]],
        *,
        limited: bool,
    ) -> web.StreamResponse:
        api = self.api
        if api.closing:
            raise ApiError(503, "unavailable", "this replica is stopping; send it again")
        pipe = Pipe()
        renderer = UIMessageStream(pipe)

        async def work(caller: Caller) -> concurrent.futures.Future[ApiError | None]:
            if len(api.running) >= api.settings.max_concurrent_turns:
                raise ApiError(
                    503,
                    "unavailable",
                    "this replica runs as many web turns as it may; send it again",
                    headers={"Retry-After": "1"},
                )
            if limited:
                wait = api.chats.take(caller.person)
                if wait is not None:
                    raise ApiError(
                        429,
                        "rate_limited",
                        "too many chats; wait a moment",
                        headers={"Retry-After": str(int(wait))},
                        retryAfter=int(wait),
                    )

            async def run() -> ApiError | None:
                return await turn(caller, renderer)

            future = api.turns.start(run)
            api.running.add(future)
            future.add_done_callback(api.running.discard)
            # (On the turns' loop, which owns the summaries: the polls see the turn's end.)
            future.add_done_callback(lambda _: api.summaries.drop(session_id))
            future.add_done_callback(lambda _: pipe.end())
            return future

        # Who is asking (and their limit) first: the turn starts only for someone it may.
        future = await api.on_turns(request, work)
        first = await pipe.get()
        if first is ENDED:  # refused, or failed, before the turn began
            if future.cancelled():
                raise ApiError(503, "unavailable", "this replica is stopping; send it again")
            failed = future.exception()
            if failed is not None:
                raise failed
            refused = future.result()
            raise refused or ApiError(500, "internal_error", "the turn ended without an answer")
        assert first is OPENED
        response = web.StreamResponse(status=200, headers=HEADERS)
        await response.prepare(request)
        gone = False
        while True:
            item = await pipe.get()
            if item is ENDED:
                break
            if gone or not isinstance(item, bytes):
                continue
            try:
                await response.write(item)
            except (ConnectionError, RuntimeError):
                gone = True  # the turn goes on; its answer is in the transcript
        if not gone:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write_eof()
        return response


def _chat_body(body: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    """The new message's text and id, and the last message the client saw.

    Two shapes: ``{"message": "text" | UIMessage, "lastMessageId"}``, or what the AI SDK's
    ``DefaultChatTransport`` sends (``{id, messages, trigger, messageId}``), the new message
    last of ``messages``; there the last message the client saw is ``lastMessageId`` when
    given, else the message before the new one (the answers it streamed carry the stored ids).
    """
    if "messages" in body:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages: a non-empty list of UIMessages")
        trigger = body.get("trigger", "submit-message")
        if trigger != "submit-message":
            raise bad_request(f"trigger: only submit-message (not {trigger!r}); truncate first")
        message = messages[-1]
        if "lastMessageId" in body:
            last = _last_id(body.get("lastMessageId"))
        else:
            before = messages[-2] if len(messages) > 1 else None
            last = before.get("id") if isinstance(before, Mapping) else None
            last = last if isinstance(last, str) else None
    elif "message" in body:
        message = body.get("message")
        if "lastMessageId" not in body:
            raise bad_request("lastMessageId: required (null on an empty session)")
        last = _last_id(body.get("lastMessageId"))
    else:
        raise bad_request("message: required")
    if isinstance(message, str):
        text, message_id = message, None
    elif isinstance(message, Mapping):
        if message.get("role", "user") != "user":
            raise bad_request("message.role: user")
        parts = message.get("parts")
        if not isinstance(parts, list):
            raise bad_request("message.parts: a list")
        text = message_text({"parts": [p for p in parts if isinstance(p, dict)]})
        given = message.get("id")
        message_id = given if isinstance(given, str) and UUID.fullmatch(given) else None
    else:
        raise bad_request("message: a string or a UIMessage")
    if not text.strip():
        raise bad_request("message: no text")
    if len(text) > MESSAGE_MOST:
        raise ApiError(413, "too_large", f"the message is over {MESSAGE_MOST} characters")
    return text, message_id, last


def _last_id(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request("lastMessageId: a string or null")
    return value

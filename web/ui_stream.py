"""A turn shown as a Vercel AI SDK UI message stream: the HTTP API's renderer.

The ``ai`` npm package's clients (``useChat`` over ``DefaultChatTransport``) read an answer as
server-sent events, one JSON chunk each (``uiMessageChunkSchema``), under the header
``x-vercel-ai-ui-message-stream: v1`` and ending with ``data: [DONE]``. This renderer writes
the conversation door's events as those chunks: ``start`` (with the id the answer is stored
under, so the client's next ``lastMessageId`` matches the transcript), ``start-step``, the text
as ``text-start``/``text-delta``/``text-end``, every tool call (shell and MCP alike) as
``tool-input-available`` then ``tool-output-available`` or ``tool-output-error``, a call that
waits on a person as ``tool-approval-request``, and ``finish``.

The response is opened only when the turn starts: a refusal (busy, stale, over budget) comes
before that and is answered as a plain 409 with its code, so a refused request never shows a
half-open stream. The renderer runs on the turns' loop and writes to a ``Sink`` (``web.loops.
Pipe``), which the request's handler reads on its own loop: ``open`` once the turn began, then
the bytes of each event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import orjson

from core.conversation import (
    Answered,
    Began,
    BudgetRanOut,
    Failed,
    Interrupted,
    LockLost,
    QuietRenderer,
    Said,
    Told,
    ToolBegan,
    ToolEnded,
    TurnEnd,
    TurnEvent,
)
from web.shapes import metadata_json

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "x-vercel-ai-ui-message-stream": "v1",
    "X-Accel-Buffering": "no",  # proxies pass each chunk on as it comes
}


class Sink(Protocol):
    """Where the stream goes: ``open`` once (the response may start), then its bytes. Both
    return at once (a turn never waits on a client)."""

    def open(self) -> None: ...

    def write(self, data: bytes) -> None: ...


class UIMessageStream(QuietRenderer):
    """One answer streamed to one HTTP client."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.started = False
        self._text: str | None = None  # the id of the text part being written
        self._parts = 0
        self._step_open = False

    async def event(self, event: TurnEvent) -> None:
        if isinstance(event, Began):
            await self._open(event.answer_id)
        elif isinstance(event, Said):
            if self._text is None:
                self._text = self._next_id("text")
                await self._send({"type": "text-start", "id": self._text})
            await self._send({"type": "text-delta", "id": self._text, "delta": event.text})
        elif isinstance(event, ToolBegan):
            await self._end_text()
            await self._send(
                {
                    "type": "tool-input-available",
                    "toolCallId": event.call_id or self._next_id("call"),
                    "toolName": event.name,
                    "input": dict(event.input),
                }
            )
        elif isinstance(event, ToolEnded):
            if event.ok or event.kind == "shell":
                chunk: dict[str, Any] = {
                    "type": "tool-output-available",
                    "toolCallId": event.call_id,
                    "output": event.structured,
                }
            else:
                chunk = {
                    "type": "tool-output-error",
                    "toolCallId": event.call_id,
                    "errorText": event.error or event.output,
                }
            await self._send(chunk)
        elif isinstance(event, Told):
            await self._send({"type": "data-notice", "data": {"text": event.text}})

    async def finish(self, end: TurnEnd) -> Sequence[str]:
        if not self.started:
            return ()  # refused before the turn started: the handler answers with the code
        await self._end_text()
        metadata: dict[str, Any] = {}
        reason = "stop"
        if isinstance(end, Answered | Failed | BudgetRanOut):
            result = end.result
            if result.approval is not None:
                await self._approval_request(result.answer, result.approval.id)
                reason = "tool-calls"
            answer = result.answer
            if answer is not None:
                stored = answer.message.get("metadata")
                if isinstance(stored, Mapping):
                    metadata.update(metadata_json(stored))
            if result.trace_url is not None:
                metadata["traceUrl"] = result.trace_url
        if isinstance(end, Failed):
            await self._send({"type": "error", "errorText": end.code})
            reason = "error"
        elif isinstance(end, BudgetRanOut):
            await self._send({"type": "error", "errorText": end.refusal.code})
            reason = "length"
        elif isinstance(end, LockLost | Interrupted):
            reason = "other"
            metadata["interrupted"] = True
        if self._step_open:
            await self._send({"type": "finish-step"})
            self._step_open = False
        finish: dict[str, Any] = {"type": "finish", "finishReason": reason}
        if metadata:
            finish["messageMetadata"] = metadata
        await self._send(finish)
        self._write(b"data: [DONE]\n\n")
        return ()

    async def abandoned(self, error: BaseException) -> None:
        """A failure the turn did not survive (the database): the client is told in the
        stream's own terms, and the stream is closed properly."""
        if not self.started:
            return
        await self._end_text()
        await self._send({"type": "error", "errorText": getattr(error, "code", "internal_error")})
        await self._send({"type": "finish", "finishReason": "error"})
        self._write(b"data: [DONE]\n\n")

    # -- writing --------------------------------------------------------------------------------

    async def _open(self, message_id: str) -> None:
        if not self.started:
            self.started = True
            self._sink.open()
            start: dict[str, Any] = {"type": "start"}
            if message_id:
                start["messageId"] = message_id
            await self._send(start)
        await self._send({"type": "start-step"})
        self._step_open = True

    async def _approval_request(self, answer: Any, approval_id: str) -> None:
        """The call the turn stopped at: its input, then the request for a person's decision
        (the stored part's ``toolCallId``, so the client's part and the transcript agree)."""
        parts = answer.message.get("parts") if answer is not None else None
        for part in parts or []:
            if not isinstance(part, Mapping):
                continue
            approval = part.get("approval")
            if not isinstance(approval, Mapping) or approval.get("id") != approval_id:
                continue
            call_id = str(part.get("toolCallId", ""))
            await self._send(
                {
                    "type": "tool-input-available",
                    "toolCallId": call_id,
                    "toolName": str(part.get("type", "")).removeprefix("tool-"),
                    "input": part.get("input") or {},
                }
            )
            await self._send(
                {"type": "tool-approval-request", "approvalId": approval_id, "toolCallId": call_id}
            )
            return

    async def _end_text(self) -> None:
        if self._text is not None:
            await self._send({"type": "text-end", "id": self._text})
            self._text = None

    def _next_id(self, kind: str) -> str:
        self._parts += 1
        return f"{kind}-{self._parts}"

    async def _send(self, chunk: Mapping[str, Any]) -> None:
        self._write(b"data: " + orjson.dumps(chunk) + b"\n\n")

    def _write(self, data: bytes) -> None:
        if self.started:
            self._sink.write(data)

"""Stored UIMessages to the neutral conversation format, and the tool parts the agent loop stores.

Tool use is stored the way the Vercel AI SDK (v5) stores it, so a client that speaks UIMessage
renders our transcripts as they are. One assistant UIMessage holds a whole turn, possibly several
model steps; each tool invocation is a single part that carries both the call and its outcome:

    {"type": "step-start"}                                   a new model call begins
    {"type": "text", "text": "..."}
    {"type": "tool-shell", "toolCallId": "call_1", "state": "output-available",
     "input": {"command": "ls"}, "output": {...} or "..."}
    {"type": "tool-shell", "toolCallId": "call_1", "state": "output-error",
     "input": {"command": "ls"}, "errorText": "..."}
    {"type": "tool-shell", "toolCallId": "call_1", "state": "input-available",
     "input": {"command": "ls"}}                             called, never answered (interrupted)
    {"type": "tool-mcp__notes__add_note", "toolCallId": "call_2", "state": "approval-requested",
     "input": {...}, "approval": {"id": "..."}}              waits for a person's decision
    {..., "state": "output-denied", "approval": {"id": "...", "approved": false,
     "reason": "..."}}                                       declined, superseded or expired

The tool's name is the part type after ``tool-``; ``{"type": "dynamic-tool", "toolName": ...}``
parts are read the same way. Reasoning, file, source and data parts are not sent to the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from core.messages import Message
from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
)

# A stored call without an outcome (the turn died between call and result) still has to be
# answered: both APIs reject a tool call that no result follows.
INTERRUPTED_TOOL_RESULT = "The tool call was interrupted before it returned a result."
NOT_RUN = "This call was not run:"
NOT_DECIDED = "nobody decided on it."

Part = dict[str, Any]


def step_start_part() -> Part:
    return {"type": "step-start"}


def text_part(text: str) -> Part:
    return {"type": "text", "text": text}


def tool_call_part(call: ToolCall) -> Part:
    """The part to store as soon as the model asked, so an interruption keeps the call."""
    return {
        "type": f"tool-{call.name}",
        "toolCallId": call.id,
        "state": "input-available",
        "input": call.arguments,
    }


def tool_output_part(call: ToolCall, output: Any) -> Part:
    return {**tool_call_part(call), "state": "output-available", "output": output}


def tool_error_part(call: ToolCall, error_text: str) -> Part:
    return {**tool_call_part(call), "state": "output-error", "errorText": error_text}


def _tool_name(part: Part) -> str | None:
    kind = part.get("type")
    if kind == "dynamic-tool":
        name = part.get("toolName")
        return name if isinstance(name, str) else None
    if isinstance(kind, str) and kind.startswith("tool-"):
        return kind.removeprefix("tool-")
    return None


def _result_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    return json.dumps(output, ensure_ascii=False, sort_keys=True)


def _tool_result(part: Part, call: ToolCall) -> ToolResult:
    state = part.get("state")
    if state == "output-available":
        return ToolResult(call.id, call.name, _result_text(part.get("output")))
    if state == "output-error":
        return ToolResult(call.id, call.name, str(part.get("errorText", "")), is_error=True)
    if state in ("output-denied", "approval-requested", "approval-responded"):
        # A call that waited for a person's decision and was not run (declined, superseded,
        # expired, or a copy in a fork): the model reads why.
        approval = part.get("approval")
        reason = approval.get("reason") if isinstance(approval, dict) else None
        why = reason if isinstance(reason, str) and reason else NOT_DECIDED
        return ToolResult(call.id, call.name, f"{NOT_RUN} {why}", is_error=True)
    return ToolResult(call.id, call.name, INTERRUPTED_TOOL_RESULT, is_error=True)


def _assistant_steps(parts: Iterable[Any]) -> list[ChatMessage]:
    """One assistant message per model step, each followed by the results of its calls.

    A step ends at ``step-start``, or where text follows a tool part (the model must have seen
    the result to continue), so transcripts written without ``step-start`` also replay in order.
    """
    out: list[ChatMessage] = []
    texts: list[str] = []
    tools: list[tuple[Part, ToolCall]] = []

    def flush() -> None:
        text = "".join(texts)
        if text or tools:
            out.append(AssistantMessage(text, tuple(call for _, call in tools)))
            out.extend(_tool_result(part, call) for part, call in tools)
        texts.clear()
        tools.clear()

    for part in parts:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind == "step-start":
            flush()
        elif kind == "text":
            if tools:
                flush()
            texts.append(str(part.get("text", "")))
        else:
            name = _tool_name(part)
            call_id = part.get("toolCallId")
            arguments = part.get("input")
            # A call whose input never finished streaming was never made: nothing to replay.
            if name and isinstance(call_id, str) and isinstance(arguments, dict):
                tools.append((part, ToolCall(call_id, name, arguments)))
    flush()
    return out


def _text_of(parts: Iterable[Any]) -> str:
    return "".join(
        str(part.get("text", ""))
        for part in parts
        if isinstance(part, dict) and part.get("type") == "text"
    )


# How a user message's ``metadata.context`` is laid out before the person's words.
CONTEXT_MARK = "[Context]\n"
MESSAGE_MARK = "\n[Message]\n"


def person_words(text: str) -> str:
    """A user turn's text without the context laid out before it (what the person wrote)."""
    if text.startswith(CONTEXT_MARK):
        return text.rpartition(MESSAGE_MARK)[2] if MESSAGE_MARK in text else ""
    return text


def ui_to_chat(messages: Iterable[Message], *, system: str | None = None) -> list[ChatMessage]:
    """The conversation a provider is given for a projected history (oldest first)."""
    out: list[ChatMessage] = [SystemMessage(system)] if system else []
    for message in messages:
        role = message.get("role")
        parts = message.get("parts") or []
        if role == "assistant":
            out.extend(_assistant_steps(parts))
            continue
        text = _text_of(parts)
        context = (message.get("metadata") or {}).get("context")
        if role == "user" and isinstance(context, str) and context:
            # What the surface knew around the person's words (the thread before the agent
            # was mentioned, files put in the sandbox, what they are looking at): kept beside
            # the message, so drafts and titles stay the person's own words.
            text = (
                f"{CONTEXT_MARK}{context}{MESSAGE_MARK}{text}" if text else CONTEXT_MARK + context
            )
        if not text:
            continue
        out.append(SystemMessage(text) if role == "system" else UserMessage(text))
    return out

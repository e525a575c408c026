"""Stored UIMessages (AI SDK v5 parts) to the neutral conversation, and the SSE line parser."""

from __future__ import annotations

from collections.abc import AsyncIterator

from core.messages import Message, assistant_message, user_message
from core.providers import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    step_start_part,
    text_part,
    tool_call_part,
    tool_error_part,
    tool_output_part,
    ui_to_chat,
)
from core.providers.sse import ServerSentEvent, iter_sse
from core.providers.uimessages import INTERRUPTED_TOOL_RESULT

LS = ToolCall("call_1", "shell", {"command": "ls"})
CAT = ToolCall("call_2", "shell", {"command": "cat a.txt"})


def _assistant(*parts: dict[str, object]) -> Message:
    return {"id": "a", "role": "assistant", "parts": list(parts), "metadata": {}}


def test_tool_parts__have_the_ai_sdk_shape() -> None:
    assert tool_call_part(LS) == {
        "type": "tool-shell",
        "toolCallId": "call_1",
        "state": "input-available",
        "input": {"command": "ls"},
    }
    assert tool_output_part(LS, {"stdout": "a.txt\n"})["state"] == "output-available"
    assert tool_output_part(LS, {"stdout": "a.txt\n"})["output"] == {"stdout": "a.txt\n"}
    assert tool_error_part(LS, "boom") == {
        **tool_call_part(LS),
        "state": "output-error",
        "errorText": "boom",
    }


def test_ui_to_chat__text_messages_and_the_system_prompt() -> None:
    stored = [user_message("hi"), assistant_message("hello"), user_message("bye")]

    assert ui_to_chat(stored, system="Be brief.") == [
        SystemMessage("Be brief."),
        UserMessage("hi"),
        AssistantMessage("hello"),
        UserMessage("bye"),
    ]


def test_ui_to_chat__a_multi_step_turn_becomes_calls_results_and_the_final_answer() -> None:
    stored = [
        user_message("what is in a.txt?"),
        _assistant(
            step_start_part(),
            text_part("Looking."),
            tool_output_part(LS, {"stdout": "a.txt\n", "exit_code": 0}),
            step_start_part(),
            tool_error_part(CAT, "permission denied"),
            step_start_part(),
            {"type": "reasoning", "text": "private"},
            text_part("It is unreadable."),
        ),
    ]

    assert ui_to_chat(stored) == [
        UserMessage("what is in a.txt?"),
        AssistantMessage("Looking.", (LS,)),
        ToolResult("call_1", "shell", '{"exit_code": 0, "stdout": "a.txt\\n"}'),
        AssistantMessage("", (CAT,)),
        ToolResult("call_2", "shell", "permission denied", is_error=True),
        AssistantMessage("It is unreadable."),
    ]


def test_ui_to_chat__text_after_a_tool_part_starts_a_new_step_without_step_start() -> None:
    stored = [_assistant(tool_output_part(LS, "a.txt"), text_part("Done."))]

    assert ui_to_chat(stored) == [
        AssistantMessage("", (LS,)),
        ToolResult("call_1", "shell", "a.txt"),
        AssistantMessage("Done."),
    ]


def test_ui_to_chat__unanswered_call_gets_an_interrupted_result_half_streamed_is_dropped() -> None:
    streaming = {
        "type": "tool-shell",
        "toolCallId": "call_9",
        "state": "input-streaming",
        "input": '{"comm',
    }
    stored = [_assistant(text_part("Running."), tool_call_part(LS), streaming)]

    assert ui_to_chat(stored) == [
        AssistantMessage("Running.", (LS,)),
        ToolResult("call_1", "shell", INTERRUPTED_TOOL_RESULT, is_error=True),
    ]


def test_ui_to_chat__dynamic_tools_system_messages_and_empty_messages() -> None:
    dynamic = {
        "type": "dynamic-tool",
        "toolName": "search",
        "toolCallId": "d1",
        "state": "output-available",
        "input": {"q": "x"},
        "output": "found",
    }
    stored: list[Message] = [
        {"id": "s", "role": "system", "parts": [text_part("Rules.")], "metadata": {}},
        {"id": "u", "role": "user", "parts": [{"type": "file", "url": "data:,"}], "metadata": {}},
        _assistant(dynamic),
        _assistant(),
    ]

    assert ui_to_chat(stored) == [
        SystemMessage("Rules."),
        AssistantMessage("", (ToolCall("d1", "search", {"q": "x"}),)),
        ToolResult("d1", "search", "found"),
    ]


async def _lines(*lines: str) -> AsyncIterator[str]:
    for line in lines:
        yield line


async def test_iter_sse__events_comments_multiline_data_and_an_unterminated_tail() -> None:
    lines = _lines(
        ": keep-alive",
        "event: message_start",
        'data: {"a":',
        "data: 1}",
        "",
        "",
        "data:[DONE]",
        "id: 7",
        "",
        "data: cut off",
    )

    events = [event async for event in iter_sse(lines)]

    assert events == [
        ServerSentEvent("message_start", '{"a":\n1}'),
        ServerSentEvent(None, "[DONE]"),
    ]

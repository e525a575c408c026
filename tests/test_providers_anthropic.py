"""The Messages API client against a local server speaking the streaming wire format."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from core.errors import ModelProviderBadResponse, ModelProviderUnavailable
from core.providers import (
    AnthropicProvider,
    AssistantMessage,
    Finish,
    HttpOptions,
    RetryPolicy,
    SystemMessage,
    TextDelta,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)
from tests.fake_anthropic import (
    FakeAnthropic,
    event,
    message_end,
    message_start,
    text_block,
    text_reply,
    tool_block,
    tool_use_reply,
)
from tests.providers_fixtures import RecordingSleep, SseReply, collect, text_of

SHELL = ToolSpec(
    "shell",
    "Run a command in the sandbox.",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)
CHECKPOINT = ToolSpec("write_checkpoint", "Write the checkpoint.")


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
async def server() -> AsyncIterator[FakeAnthropic]:
    async with FakeAnthropic() as fake:
        yield fake


@pytest.fixture
async def provider(
    server: FakeAnthropic, sleep: RecordingSleep
) -> AsyncIterator[AnthropicProvider]:
    http = HttpOptions(retry=RetryPolicy(sleep=sleep))
    client = AnthropicProvider(api_key="sk-ant-test", base_url=server.base_url, http=http)
    yield client
    await client.aclose()


async def test_stream__text_arrives_in_deltas_and_ends_with_usage(
    server: FakeAnthropic, provider: AnthropicProvider
) -> None:
    server.push(text_reply("Hel", "lo, ", "world"))

    events = await collect(
        provider, [SystemMessage("Be brief."), SystemMessage("Be kind."), UserMessage("hi")]
    )

    assert events == [
        TextDelta("Hel"),
        TextDelta("lo, "),
        TextDelta("world"),
        Finish("stop", Usage(15, 9), "end_turn"),
    ]
    (request,) = server.requests
    assert request.path == "/v1/messages"
    assert request.headers["x-api-key"] == "sk-ant-test"
    assert request.headers["anthropic-version"] == "2023-06-01"
    assert request.body == {
        "model": provider.default_model,
        "max_tokens": provider.max_tokens,
        "system": "Be brief.\n\nBe kind.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": True,
    }


async def test_stream__tool_use_blocks_are_assembled_from_json_deltas(
    server: FakeAnthropic, provider: AnthropicProvider
) -> None:
    server.push(
        tool_use_reply(
            [
                ("toolu_a", "shell", {"command": "ls -la /tmp", "note": "first"}),
                ("toolu_b", "shell", {"command": "echo 'two words'"}),
            ],
            text="Let me look.",
        )
    )

    events = await collect(provider, [UserMessage("look around")], [SHELL], model="claude-x")

    assert text_of(events) == "Let me look."
    assert [e for e in events if isinstance(e, ToolCall)] == [
        ToolCall("toolu_a", "shell", {"command": "ls -la /tmp", "note": "first"}),
        ToolCall("toolu_b", "shell", {"command": "echo 'two words'"}),
    ]
    assert events[-1] == Finish("tool_calls", Usage(15, 9), "tool_use")
    body = server.requests[0].body
    assert body["model"] == "claude-x"
    assert body["tools"] == [
        {
            "name": "shell",
            "description": "Run a command in the sandbox.",
            "input_schema": SHELL.parameters,
        }
    ]
    assert "tool_choice" not in body


async def test_stream__forced_tool_choice_is_sent_as_a_tool_choice_of_type_tool(
    server: FakeAnthropic, provider: AnthropicProvider
) -> None:
    server.push(tool_use_reply([("toolu_c", "write_checkpoint", {"objectives": ["ship it"]})]))

    events = await collect(
        provider, [UserMessage("compact")], [SHELL, CHECKPOINT], tool_choice="write_checkpoint"
    )

    assert events[0] == ToolCall("toolu_c", "write_checkpoint", {"objectives": ["ship it"]})
    assert server.requests[0].body["tool_choice"] == {"type": "tool", "name": "write_checkpoint"}


async def test_request__tool_results_and_the_next_user_text_share_one_user_turn(
    server: FakeAnthropic, provider: AnthropicProvider
) -> None:
    server.push(text_reply("ok"))
    calls = (
        ToolCall("toolu_1", "shell", {"command": "false"}),
        ToolCall("toolu_2", "shell", {"command": "true"}),
    )
    history = [
        UserMessage("$ false; true"),
        AssistantMessage("", calls),
        ToolResult("toolu_1", "shell", "exit 1", is_error=True),
        ToolResult("toolu_2", "shell", ""),
        UserMessage("and now?"),
    ]

    await collect(provider, history, [SHELL])

    assert server.requests[0].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "$ false; true"}]},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "shell",
                    "input": {"command": "false"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "shell",
                    "input": {"command": "true"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "exit 1",
                    "is_error": True,
                },
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": ""},
                {"type": "text", "text": "and now?"},
            ],
        },
    ]


async def test_stream__unknown_events_and_blocks_are_skipped(
    server: FakeAnthropic, provider: AnthropicProvider
) -> None:
    thinking = {"type": "thinking", "thinking": ""}
    server.push(
        SseReply(
            [
                message_start(),
                event("content_block_start", index=0, content_block=thinking),
                event(
                    "content_block_delta",
                    index=0,
                    delta={"type": "thinking_delta", "thinking": "hmm"},
                ),
                event("content_block_stop", index=0),
                event("some_future_event", detail=1),
                *text_block(1, "answer"),
                *message_end("end_turn"),
            ]
        )
    )

    events = await collect(provider, [UserMessage("q")])

    assert events == [TextDelta("answer"), Finish("stop", Usage(15, 9), "end_turn")]


async def test_stream__overloaded_error_event_before_output_is_retried(
    server: FakeAnthropic, provider: AnthropicProvider, sleep: RecordingSleep
) -> None:
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    server.push(SseReply([message_start(), event("error", error=overloaded)]), text_reply("fine"))

    events = await collect(provider, [UserMessage("q")])

    assert text_of(events) == "fine"
    assert len(server.requests) == 2
    assert sleep.calls == [RetryPolicy().base_delay]


async def test_stream__error_event_after_text_is_not_retried_and_keeps_the_text(
    server: FakeAnthropic, provider: AnthropicProvider, sleep: RecordingSleep
) -> None:
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    server.push(
        SseReply(
            [
                message_start(),
                event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
                event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Par"}),
                event("error", error=overloaded),
            ]
        )
    )

    with pytest.raises(ModelProviderUnavailable, match="Overloaded") as info:
        await collect(provider, [UserMessage("q")])

    assert info.value.partial_text == "Par"
    assert len(server.requests) == 1
    assert sleep.calls == []


async def test_stream__tool_input_that_is_not_json_is_a_bad_response(
    server: FakeAnthropic, provider: AnthropicProvider
) -> None:
    broken = tool_block(0, "toolu_x", "shell", {"command": "ls"})
    broken[-2] = event(
        "content_block_delta", index=0, delta={"type": "input_json_delta", "partial_json": "}}"}
    )
    server.push(SseReply([message_start(), *broken, *message_end("tool_use")]))

    with pytest.raises(ModelProviderBadResponse, match="input of tool 'shell'"):
        await collect(provider, [UserMessage("ls")], [SHELL])

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
from standins.anthropic import (
    AnthropicStandIn,
    event,
    message_end,
    message_start,
    text_block,
    text_reply,
    tool_block,
    tool_use_reply,
)
from standins.scripted import SseReply
from tests.providers_fixtures import RecordingSleep, collect, text_of

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
async def server() -> AsyncIterator[AnthropicStandIn]:
    async with AnthropicStandIn() as fake:
        yield fake


@pytest.fixture
async def provider(
    server: AnthropicStandIn, sleep: RecordingSleep
) -> AsyncIterator[AnthropicProvider]:
    http = HttpOptions(retry=RetryPolicy(sleep=sleep))
    client = AnthropicProvider(api_key="sk-ant-test", base_url=server.base_url, http=http)
    yield client
    await client.aclose()


async def test_stream__text_arrives_in_deltas_and_ends_with_usage(
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    server.push(text_reply("Hel", "lo, ", "world"))

    events = await collect(
        provider, [SystemMessage("Be brief."), SystemMessage("Be kind."), UserMessage("hi")]
    )

    assert events == [
        TextDelta("Hel"),
        TextDelta("lo, "),
        TextDelta("world"),
        Usage(input_tokens=15, output_tokens=9, cached_tokens=0, cache_write_tokens=0),
        Finish("stop", "end_turn"),
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
    server: AnthropicStandIn, provider: AnthropicProvider
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
    assert events[-2:] == [Usage(15, 9, 0, 0), Finish("tool_calls", "tool_use")]
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
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    server.push(tool_use_reply([("toolu_c", "write_checkpoint", {"objectives": ["ship it"]})]))

    events = await collect(
        provider, [UserMessage("compact")], [SHELL, CHECKPOINT], tool_choice="write_checkpoint"
    )

    assert events[0] == ToolCall("toolu_c", "write_checkpoint", {"objectives": ["ship it"]})
    assert server.requests[0].body["tool_choice"] == {"type": "tool", "name": "write_checkpoint"}


async def test_request__tool_results_and_the_next_user_text_share_one_user_turn(
    server: AnthropicStandIn, provider: AnthropicProvider
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
    server: AnthropicStandIn, provider: AnthropicProvider
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

    assert events == [TextDelta("answer"), Usage(15, 9, 0, 0), Finish("stop", "end_turn")]


async def test_stream__overloaded_error_event_before_output_is_retried(
    server: AnthropicStandIn, provider: AnthropicProvider, sleep: RecordingSleep
) -> None:
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    server.push(SseReply([message_start(), event("error", error=overloaded)]), text_reply("fine"))

    events = await collect(provider, [UserMessage("q")])

    assert text_of(events) == "fine"
    assert len(server.requests) == 2
    assert sleep.calls == [RetryPolicy().base_delay]


async def test_stream__error_event_after_text_is_not_retried_and_keeps_the_text(
    server: AnthropicStandIn, provider: AnthropicProvider, sleep: RecordingSleep
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
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    broken = tool_block(0, "toolu_x", "shell", {"command": "ls"})
    broken[-2] = event(
        "content_block_delta", index=0, delta={"type": "input_json_delta", "partial_json": "}}"}
    )
    server.push(SseReply([message_start(), *broken, *message_end("tool_use")]))

    with pytest.raises(ModelProviderBadResponse, match="input of tool 'shell'"):
        await collect(provider, [UserMessage("ls")], [SHELL])


async def test_usage__cache_reads_and_writes_are_added_to_the_input_and_named_apart(
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    # The API's input_tokens is only the uncached part; ours is everything the model read.
    server.push(
        SseReply(
            [
                message_start(21, cache_read=1800, cache_write=188),
                *text_block(0, "hi"),
                *message_end("end_turn", output_tokens=42),
            ]
        )
    )

    events = await collect(provider, [UserMessage("q")])

    (usage,) = [e for e in events if isinstance(e, Usage)]
    assert usage == Usage(
        input_tokens=21 + 1800 + 188, output_tokens=42, cached_tokens=1800, cache_write_tokens=188
    )
    assert usage.total_tokens == 2009 + 42


async def test_usage__message_delta_counts_are_cumulative_and_win_over_message_start(
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    # Newer API versions repeat the input fields in message_delta, as running totals.
    server.push(
        SseReply(
            [
                message_start(10, cache_read=0),
                *text_block(0, "hi"),
                *message_end(
                    "end_turn",
                    output_tokens=77,
                    input_usage={"input_tokens": 12, "cache_read_input_tokens": 500},
                ),
            ]
        )
    )

    events = await collect(provider, [UserMessage("q")])

    assert Usage(512, 77, cached_tokens=500, cache_write_tokens=0) in events


async def test_usage__a_stream_without_any_usage_reports_unknown_counts(
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    start = event("message_start", message={"id": "m", "type": "message", "content": []})
    stop = event("message_delta", delta={"stop_reason": "end_turn"})
    server.push(SseReply([start, *text_block(0, "hi"), stop, event("message_stop")]))

    events = await collect(provider, [UserMessage("q")])

    assert events[-2:] == [Usage(), Finish("stop", "end_turn")]


async def test_usage__a_failed_stream_yields_no_usage(
    server: AnthropicStandIn, provider: AnthropicProvider
) -> None:
    failure = {"type": "api_error", "message": "boom"}
    server.push(SseReply([message_start(), *text_block(0, "par"), event("error", error=failure)]))

    seen: list[object] = []

    async def consume() -> None:
        async for item in provider.stream([UserMessage("q")]):
            seen.append(item)

    with pytest.raises(ModelProviderUnavailable):
        await consume()
    assert seen == [TextDelta("par")]

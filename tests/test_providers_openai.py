"""The Chat Completions client against a local server speaking the streaming wire format."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from core.errors import ModelProviderBadResponse
from core.providers import (
    AssistantMessage,
    Finish,
    HttpOptions,
    OpenAIProvider,
    RetryPolicy,
    SystemMessage,
    TextDelta,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)
from tests.fake_openai import (
    DONE,
    FakeOpenAI,
    chunk,
    text_reply,
    tool_call_reply,
    usage_chunk,
)
from tests.providers_fixtures import RecordingSleep, SseReply, collect, sse_frame, text_of

SHELL = ToolSpec(
    "shell",
    "Run a command in the sandbox.",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)
CHECKPOINT = ToolSpec("write_checkpoint", "Write the checkpoint.")


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
async def provider(server: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    http = HttpOptions(retry=RetryPolicy(sleep=RecordingSleep()))
    client = OpenAIProvider(api_key="sk-test", base_url=server.base_url, http=http)
    yield client
    await client.aclose()


async def test_stream__text_arrives_in_deltas_and_ends_with_usage(
    server: FakeOpenAI, provider: OpenAIProvider
) -> None:
    server.push(text_reply("Hel", "lo, ", "world"))

    events = await collect(provider, [SystemMessage("Be brief."), UserMessage("hi")])

    assert events == [
        TextDelta("Hel"),
        TextDelta("lo, "),
        TextDelta("world"),
        Finish("stop", Usage(12, 7), "stop"),
    ]
    (request,) = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.body == {
        "model": provider.default_model,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_stream__tool_call_fragments_are_assembled_by_index(
    server: FakeOpenAI, provider: OpenAIProvider
) -> None:
    server.push(
        tool_call_reply(
            [
                ("call_a", "shell", {"command": "ls -la /tmp", "note": "first"}),
                ("call_b", "shell", {"command": "echo 'two words'"}),
            ],
            text="Let me look.",
        )
    )

    events = await collect(provider, [UserMessage("look around")], [SHELL], model="gpt-x")

    assert text_of(events) == "Let me look."
    assert [e for e in events if isinstance(e, ToolCall)] == [
        ToolCall("call_a", "shell", {"command": "ls -la /tmp", "note": "first"}),
        ToolCall("call_b", "shell", {"command": "echo 'two words'"}),
    ]
    assert events[-1] == Finish("tool_calls", Usage(30, 11), "tool_calls")
    body = server.requests[0].body
    assert body["model"] == "gpt-x"
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "description": "Run a command in the sandbox.",
                "parameters": SHELL.parameters,
            },
        }
    ]
    assert "tool_choice" not in body


async def test_stream__forced_tool_is_sent_and_reported_as_a_tool_call(
    server: FakeOpenAI, provider: OpenAIProvider
) -> None:
    # OpenAI finishes a forced call with "stop"; callers must still see a tool-call stop.
    server.push(
        tool_call_reply(
            [("call_c", "write_checkpoint", {"objectives": ["ship it"]})], finish_reason="stop"
        )
    )

    events = await collect(
        provider, [UserMessage("compact")], [SHELL, CHECKPOINT], tool_choice="write_checkpoint"
    )

    assert events[-2:] == [
        ToolCall("call_c", "write_checkpoint", {"objectives": ["ship it"]}),
        Finish("tool_calls", Usage(30, 11), "stop"),
    ]
    assert server.requests[0].body["tool_choice"] == {
        "type": "function",
        "function": {"name": "write_checkpoint"},
    }


async def test_stream__forcing_a_tool_not_offered_is_refused_before_any_request(
    server: FakeOpenAI, provider: OpenAIProvider
) -> None:
    with pytest.raises(ValueError, match="write_checkpoint"):
        await collect(provider, [UserMessage("x")], [SHELL], tool_choice="write_checkpoint")
    assert server.requests == []


async def test_request__tool_history_is_sent_in_chat_completions_shape(
    server: FakeOpenAI, provider: OpenAIProvider
) -> None:
    server.push(text_reply("done"))
    call = ToolCall("call_1", "shell", {"command": "false"})
    history = [
        UserMessage("$ false"),
        AssistantMessage("", (call,)),
        ToolResult("call_1", "shell", "exit 1", is_error=True),
        AssistantMessage("It failed."),
        UserMessage("why?"),
    ]

    await collect(provider, history, [SHELL])

    assert server.requests[0].body["messages"] == [
        {"role": "user", "content": "$ false"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "shell", "arguments": json.dumps({"command": "false"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "[error] exit 1"},
        {"role": "assistant", "content": "It failed."},
        {"role": "user", "content": "why?"},
    ]


async def test_stream__tool_arguments_that_are_not_json_are_a_bad_response(
    server: FakeOpenAI, provider: OpenAIProvider
) -> None:
    head = {"index": 0, "id": "call_x", "type": "function"}
    head["function"] = {"name": "shell", "arguments": '{"command": "ls'}
    server.push(
        SseReply(
            [
                sse_frame(chunk({"content": "Running it."})),
                sse_frame(chunk({"tool_calls": [head]})),
                sse_frame(chunk({}, "tool_calls")),
                sse_frame(usage_chunk(1, 1)),
                DONE,
            ]
        )
    )

    with pytest.raises(ModelProviderBadResponse, match="arguments of tool call 'shell'") as info:
        await collect(provider, [UserMessage("ls")], [SHELL])
    assert info.value.partial_text == "Running it."

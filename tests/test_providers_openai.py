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
from standins.http_proxy import HttpProxy
from standins.openai import (
    DONE,
    OpenAIStandIn,
    chunk,
    text_frames,
    text_reply,
    tool_call_reply,
    usage_chunk,
)
from standins.scripted import SseReply, sse_frame
from tests.providers_fixtures import RecordingSleep, collect, text_of

SHELL = ToolSpec(
    "shell",
    "Run a command in the sandbox.",
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
)
CHECKPOINT = ToolSpec("write_checkpoint", "Write the checkpoint.")


@pytest.fixture
async def server() -> AsyncIterator[OpenAIStandIn]:
    async with OpenAIStandIn() as fake:
        yield fake


@pytest.fixture
async def provider(server: OpenAIStandIn) -> AsyncIterator[OpenAIProvider]:
    http = HttpOptions(retry=RetryPolicy(sleep=RecordingSleep()))
    client = OpenAIProvider(api_key="sk-test", base_url=server.base_url, http=http)
    yield client
    await client.aclose()


async def test_stream__text_arrives_in_deltas_and_ends_with_usage(
    server: OpenAIStandIn, provider: OpenAIProvider
) -> None:
    server.push(text_reply("Hel", "lo, ", "world"))

    events = await collect(provider, [SystemMessage("Be brief."), UserMessage("hi")])

    assert events == [
        TextDelta("Hel"),
        TextDelta("lo, "),
        TextDelta("world"),
        Usage(input_tokens=12, output_tokens=7, cached_tokens=0),
        Finish("stop", "stop"),
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
    server: OpenAIStandIn, provider: OpenAIProvider
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
    assert events[-2:] == [Usage(30, 11, cached_tokens=0), Finish("tool_calls", "tool_calls")]
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
    server: OpenAIStandIn, provider: OpenAIProvider
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

    assert events[-3:] == [
        ToolCall("call_c", "write_checkpoint", {"objectives": ["ship it"]}),
        Usage(30, 11, cached_tokens=0),
        Finish("tool_calls", "stop"),
    ]
    assert server.requests[0].body["tool_choice"] == {
        "type": "function",
        "function": {"name": "write_checkpoint"},
    }


async def test_stream__forcing_a_tool_not_offered_is_refused_before_any_request(
    server: OpenAIStandIn, provider: OpenAIProvider
) -> None:
    with pytest.raises(ValueError, match="write_checkpoint"):
        await collect(provider, [UserMessage("x")], [SHELL], tool_choice="write_checkpoint")
    assert server.requests == []


async def test_request__tool_history_is_sent_in_chat_completions_shape(
    server: OpenAIStandIn, provider: OpenAIProvider
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
    server: OpenAIStandIn, provider: OpenAIProvider
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


async def test_usage__cached_prompt_tokens_are_part_of_the_input_count(
    server: OpenAIStandIn, provider: OpenAIProvider
) -> None:
    # OpenAI's prompt_tokens already includes the cached tokens its details name.
    server.push(
        SseReply([*text_frames("hi"), sse_frame(usage_chunk(2006, 300, cached_tokens=1920)), DONE])
    )

    events = await collect(provider, [UserMessage("hi")])

    (usage,) = [e for e in events if isinstance(e, Usage)]
    assert usage == Usage(input_tokens=2006, output_tokens=300, cached_tokens=1920)
    assert usage.total_tokens == 2306
    assert not usage.estimated


async def test_usage__a_server_without_prompt_details_leaves_the_cached_count_unknown(
    server: OpenAIStandIn, provider: OpenAIProvider
) -> None:
    server.push(
        SseReply([*text_frames("hi"), sse_frame(usage_chunk(40, 5, cached_tokens=None)), DONE])
    )

    events = await collect(provider, [UserMessage("hi")])

    assert Usage(input_tokens=40, output_tokens=5, cached_tokens=None) in events


async def test_usage__a_server_that_ignores_include_usage_reports_unknown_counts_not_zero(
    server: OpenAIStandIn, provider: OpenAIProvider
) -> None:
    # vLLM before include_usage, some proxies: no usage chunk at all. One Usage still comes,
    # so the request is counted, with every count unknown.
    server.push(SseReply([*text_frames("hi"), DONE]))

    events = await collect(provider, [UserMessage("hi")])

    assert events[-2:] == [Usage(), Finish("stop", "stop")]
    assert events[-2] == Usage(None, None, None, None, estimated=False)


async def test_usage__running_totals_in_every_chunk_count_once_with_the_last_values(
    server: OpenAIStandIn, provider: OpenAIProvider
) -> None:
    # vLLM's continuous usage stats put a running usage on every chunk.
    def running(delta: dict[str, str], done: int, finish: str | None = None) -> str:
        return sse_frame(
            {**chunk(delta, finish), "usage": {"prompt_tokens": 9, "completion_tokens": done}}
        )

    frames = [running({"content": "a"}, 1), running({"content": "b"}, 2), running({}, 2, "stop")]
    frames.append(DONE)
    server.push(SseReply(frames))

    events = await collect(provider, [UserMessage("hi")])

    assert [e for e in events if isinstance(e, Usage)] == [Usage(9, 2)]


_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


def _proxy_environment(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


async def test_proxy__http_proxy_carries_the_stream_and_is_looked_up_once(
    server: OpenAIStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's ``HTTP_PROXY`` (``HTTPS_PROXY`` for https) carries the model's requests,
    streams included; it is read once per origin, so a second request goes the same way."""
    async with HttpProxy() as proxy:
        _proxy_environment(monkeypatch, HTTP_PROXY=proxy.url)
        provider = OpenAIProvider(api_key="sk-test", base_url=server.base_url)
        try:
            server.push(text_reply("through ", "the proxy"))
            assert text_of(await collect(provider, [UserMessage("hi")])) == "through the proxy"
            _proxy_environment(monkeypatch)  # looked up already: not read again
            server.push(text_reply("again"))
            assert text_of(await collect(provider, [UserMessage("hi")])) == "again"
        finally:
            await provider.aclose()
        url = f"{server.base_url}/chat/completions"
        assert proxy.forwarded == [url, url]
        assert [r.headers["authorization"] for r in server.requests] == ["Bearer sk-test"] * 2


async def test_proxy__no_proxy_keeps_its_hosts_direct(
    server: OpenAIStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with HttpProxy() as proxy:
        _proxy_environment(monkeypatch, HTTP_PROXY=proxy.url, NO_PROXY="localhost,127.0.0.1")
        provider = OpenAIProvider(api_key="sk-test", base_url=server.base_url)
        try:
            server.push(text_reply("direct"))
            assert text_of(await collect(provider, [UserMessage("hi")])) == "direct"
        finally:
            await provider.aclose()
        assert proxy.forwarded == []
        assert len(server.requests) == 1

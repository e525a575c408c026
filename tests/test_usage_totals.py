"""A message's ``metadata.usage``: the requests that wrote it, from the stand-ins' wire formats,
priced and added up, with partial knowledge adding up as documented (unknown wins)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from decimal import Decimal

import pytest

from core.providers import (
    AnthropicProvider,
    AssistantMessage,
    ChatMessage,
    ModelProvider,
    OfflineProvider,
    OpenAIProvider,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)
from core.usage.prices import OwnPrices, PriceSource, request_cost
from core.usage.totals import MessageUsage, RequestUsage
from standins import anthropic, openai
from standins.anthropic import AnthropicStandIn
from standins.openai import DONE, OpenAIStandIn, text_frames, tool_call_frames, usage_chunk
from standins.scripted import SseReply, sse_frame

SHELL = ToolSpec("shell", "Run a command.")
OWN = OwnPrices(Decimal("1"), Decimal("4"), cached_per_million=Decimal("0.25"))


@pytest.fixture
async def openai_server() -> AsyncIterator[OpenAIStandIn]:
    async with OpenAIStandIn() as fake:
        yield fake


@pytest.fixture
async def anthropic_server() -> AsyncIterator[AnthropicStandIn]:
    async with AnthropicStandIn() as fake:
        yield fake


async def request(
    provider: ModelProvider,
    messages: Sequence[ChatMessage],
    source: PriceSource,
    tools: Sequence[ToolSpec] = (),
) -> RequestUsage:
    """One request as the agent loop makes it: stream it, price the Usage it reports."""
    usages = [e async for e in provider.stream(messages, tools) if isinstance(e, Usage)]
    (usage,) = usages  # exactly one per request
    return RequestUsage.priced(
        usage, provider=provider.name, model=provider.default_model, source=source
    )


async def test_openai__a_tool_round_and_an_answer_add_up_to_the_message_usage(
    openai_server: OpenAIStandIn,
) -> None:
    call = ToolCall("call_1", "shell", {"command": "ls"})
    openai_server.push(
        SseReply(
            [
                *tool_call_frames([(call.id, call.name, call.arguments)]),
                sse_frame(usage_chunk(900, 20, cached_tokens=512)),
                DONE,
            ]
        ),
        SseReply([*text_frames("done"), sse_frame(usage_chunk(960, 8, cached_tokens=896)), DONE]),
    )
    provider = OpenAIProvider(api_key="k", base_url=openai_server.base_url, default_model="m1")
    source = PriceSource.stated(OWN)
    try:
        first = await request(provider, [UserMessage("$ ls")], source, [SHELL])
        history = [UserMessage("$ ls"), AssistantMessage("", (call,))]
        history.append(ToolResult(call.id, "shell", "a.txt"))
        second = await request(provider, history, source, [SHELL])
    finally:
        await provider.aclose()

    total = MessageUsage.total([first, second])

    assert total == MessageUsage(
        provider="openai",
        model="m1",
        requests=2,
        input_tokens=1860,
        output_tokens=28,
        cached_tokens=1408,
        cost_usd=(Decimal(1860 - 1408) * 1 + Decimal(1408) * Decimal("0.25") + 28 * 4) / 1_000_000,
        estimated=False,
    )


async def test_anthropic__cache_reads_are_in_the_input_and_the_cached_count(
    anthropic_server: AnthropicStandIn,
) -> None:
    anthropic_server.push(
        SseReply(
            [
                anthropic.message_start(30, cache_read=2000, cache_write=100),
                *anthropic.text_block(0, "hi"),
                *anthropic.message_end("end_turn", output_tokens=12),
            ]
        )
    )
    provider = AnthropicProvider(
        api_key="k", base_url=anthropic_server.base_url, default_model="claude-haiku-4-5"
    )
    try:
        # The stand-in is not api.anthropic.com, so the table's price is asked for the real one.
        one = await request(
            provider, [UserMessage("q")], PriceSource.table("https://api.anthropic.com")
        )
    finally:
        await provider.aclose()

    usage = MessageUsage.of(one)
    assert (usage.input_tokens, usage.output_tokens, usage.cached_tokens) == (2130, 12, 2000)
    assert usage.cost_usd == request_cost(
        Usage(2130, 12, 2000, 100),
        model="claude-haiku-4-5",
        source=PriceSource.table("https://api.anthropic.com"),
    )
    assert usage.cost_usd is not None


async def test_a_server_reporting_nothing__tokens_and_cost_unknown_not_zero(
    openai_server: OpenAIStandIn,
) -> None:
    openai_server.push(
        openai.text_reply("known", usage=(100, 10)), SseReply([*text_frames("?"), DONE])
    )
    provider = OpenAIProvider(api_key="k", base_url=openai_server.base_url, default_model="m")
    source = PriceSource.stated(OWN)
    try:
        known = await request(provider, [UserMessage("a")], source)
        unknown = await request(provider, [UserMessage("b")], source)
    finally:
        await provider.aclose()

    total = MessageUsage.total([known, unknown])

    assert total is not None
    assert total.requests == 2  # the silent request still counts as a request
    assert (total.input_tokens, total.output_tokens, total.cost_usd) == (None, None, None)
    assert total.to_json()["input_tokens"] is None


async def test_offline__counts_are_estimates_said_so_and_free() -> None:
    one = await request(OfflineProvider(), [UserMessage("hello there")], PriceSource.no_cost())

    usage = MessageUsage.of(one)

    assert usage.estimated
    assert usage.cost_usd == 0
    assert (usage.input_tokens or 0) > 0


def priced(usage: Usage, cost: str | None, *, model: str = "m") -> RequestUsage:
    return RequestUsage("p", model, usage, None if cost is None else Decimal(cost))


def test_adding__unknown_plus_known_is_unknown_field_by_field() -> None:
    total = MessageUsage.total(
        [priced(Usage(10, 5, 0), "0.01"), priced(Usage(20, None, None), None)]
    )

    assert total == MessageUsage("p", "m", 2, 30, None, None, None, False)


def test_adding__one_estimated_request_marks_the_message_estimated() -> None:
    total = MessageUsage.total(
        [priced(Usage(10, 5, 0), "0"), priced(Usage(3, 1, 0, estimated=True), "0")]
    )

    assert total is not None
    assert total.estimated
    assert total.input_tokens == 13


def test_adding__requests_of_different_models_name_none_rather_than_one() -> None:
    total = MessageUsage.total([priced(Usage(1, 1), "0"), priced(Usage(1, 1), "0", model="x")])

    assert total is not None
    assert (total.provider, total.model) == ("p", None)


def test_no_request__no_usage() -> None:
    assert MessageUsage.total([]) is None


def test_json__round_trips_through_the_stored_form() -> None:
    usage = MessageUsage("openai", "gpt-4.1-mini", 3, 4000, 120, 2048, Decimal("0.0011"), False)

    stored = json.loads(json.dumps(usage.to_json()))

    assert stored == {
        "provider": "openai",
        "model": "gpt-4.1-mini",
        "requests": 3,
        "input_tokens": 4000,
        "output_tokens": 120,
        "cached_tokens": 2048,
        "cost_usd": 0.0011,
        "estimated": False,
    }
    assert MessageUsage.from_json(stored) == usage


@pytest.mark.parametrize("value", [None, "usage", [], {"requests": "two"}])
def test_json__anything_else_reads_as_no_or_empty_usage(value: object) -> None:
    read = MessageUsage.from_json(value)

    assert read is None or (read.requests, read.input_tokens) == (0, None)

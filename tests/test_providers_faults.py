"""Provider faults, the same for both wire formats, against real local servers.

Every test runs once per wire format. Waits go through a recording sleep (the retry policy's
injected ``sleep``), so what is asserted is the wait asked for, never the time taken.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp
import pytest

from core.errors import (
    ModelProviderBadResponse,
    ModelProviderRateLimited,
    ModelProviderRejected,
    ModelProviderTimeout,
    ModelProviderUnavailable,
)
from core.providers import (
    AnthropicProvider,
    HttpOptions,
    ModelProvider,
    OpenAIProvider,
    RetryPolicy,
    Timeouts,
    UserMessage,
)
from core.providers.streaming import parse_retry_after
from standins import anthropic, openai
from standins.scripted import JsonReply, ScriptedServer, Silence, SseReply, sse_frame
from tests.providers_fixtures import RecordingSleep, collect, text_of

HELLO = [UserMessage("hello")]
RETRY = RetryPolicy(max_attempts=3, base_delay=0.5, max_delay=0.75, max_retry_after=30)
TIMEOUT = Timeouts(connect=0.3, read=0.3, pool=0.3)


@dataclass
class Wire:
    """One wire format: its fake server and how to script the replies the faults need."""

    server: ScriptedServer
    base_url: str
    build: Callable[[str, HttpOptions], ModelProvider]
    text_reply: Callable[..., SseReply]
    error_reply: Callable[[int, Mapping[str, str]], JsonReply]
    # A reply that streamed ``pieces`` of text and then had more to say.
    unfinished: Callable[..., list[str]]


def _openai(server: openai.OpenAIStandIn) -> Wire:
    return Wire(
        server,
        server.base_url,
        lambda url, http: OpenAIProvider(api_key="sk-test", base_url=url, http=http),
        openai.text_reply,
        lambda status, headers: openai.error_reply(status, "fake failure", headers),
        lambda *pieces: openai.text_frames(*pieces)[:-1],
    )


def _anthropic(server: anthropic.AnthropicStandIn) -> Wire:
    return Wire(
        server,
        server.base_url,
        lambda url, http: AnthropicProvider(api_key="sk-ant-test", base_url=url, http=http),
        anthropic.text_reply,
        lambda status, headers: anthropic.error_reply(status, "api_error", "fake", headers),
        lambda *pieces: [
            anthropic.message_start(),
            *anthropic.text_block(0, *pieces)[:-1],
        ],
    )


@pytest.fixture(params=["openai", "anthropic"])
async def wire(request: pytest.FixtureRequest) -> AsyncIterator[Wire]:
    if request.param == "openai":
        async with openai.OpenAIStandIn() as openai_server:
            yield _openai(openai_server)
    else:
        async with anthropic.AnthropicStandIn() as anthropic_server:
            yield _anthropic(anthropic_server)


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture
async def provider(wire: Wire, sleep: RecordingSleep) -> AsyncIterator[ModelProvider]:
    built = wire.build(wire.base_url, HttpOptions(timeout=TIMEOUT, retry=_retry(sleep)))
    yield built
    await built.aclose()


def _retry(sleep: RecordingSleep) -> RetryPolicy:
    return dataclasses.replace(RETRY, sleep=sleep)


async def test_429__waits_as_retry_after_says_then_succeeds(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(wire.error_reply(429, {"retry-after": "7"}), wire.text_reply("ok"))

    events = await collect(provider, HELLO)

    assert text_of(events) == "ok"
    assert sleep.calls == [7.0]
    assert len(wire.server.requests) == 2


async def test_429__retry_after_longer_than_a_turn_should_wait_fails_at_once(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(wire.error_reply(429, {"retry-after": "3600"}))

    with pytest.raises(ModelProviderRateLimited) as info:
        await collect(provider, HELLO)

    assert info.value.code == "model_provider_rate_limited"
    assert info.value.retry_after == 3600
    assert info.value.status_code == 429
    assert sleep.calls == []


async def test_429__gives_up_after_the_attempt_cap(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    for _ in range(RETRY.max_attempts + 1):
        wire.server.push(wire.error_reply(429, {"retry-after": "2"}))

    with pytest.raises(ModelProviderRateLimited):
        await collect(provider, HELLO)

    assert len(wire.server.requests) == RETRY.max_attempts
    assert sleep.calls == [2.0] * (RETRY.max_attempts - 1)


async def test_5xx__retried_with_backoff_then_succeeds(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(wire.error_reply(500, {}), wire.error_reply(503, {}), wire.text_reply("ok"))

    events = await collect(provider, HELLO)

    assert text_of(events) == "ok"
    # Exponential from base_delay, capped at max_delay: 0.5, then min(1.0, 0.75).
    assert sleep.calls == [0.5, 0.75]


async def test_5xx__gives_up_after_the_attempt_cap_with_the_servers_words(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    for _ in range(RETRY.max_attempts + 1):
        wire.server.push(wire.error_reply(502, {}))

    with pytest.raises(ModelProviderUnavailable, match="HTTP 502") as info:
        await collect(provider, HELLO)

    assert info.value.code == "model_provider_unavailable"
    assert info.value.partial_text == ""
    assert len(wire.server.requests) == RETRY.max_attempts
    assert len(sleep.calls) == RETRY.max_attempts - 1


async def test_4xx__is_rejected_without_retry(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(wire.error_reply(401, {}))

    with pytest.raises(ModelProviderRejected, match="HTTP 401") as info:
        await collect(provider, HELLO)

    assert info.value.status_code == 401
    assert len(wire.server.requests) == 1
    assert sleep.calls == []


async def test_read_timeout__mid_stream_keeps_the_streamed_text(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(SseReply(wire.unfinished("Hello ", "there"), stall=True))

    with pytest.raises(ModelProviderTimeout, match="read timeout") as info:
        await collect(provider, HELLO)

    assert info.value.code == "model_provider_timeout"
    assert info.value.partial_text == "Hello there"
    assert len(wire.server.requests) == 1
    assert sleep.calls == []


async def test_read_timeout__before_any_header_is_not_retried(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(Silence())

    with pytest.raises(ModelProviderTimeout):
        await collect(provider, HELLO)

    assert len(wire.server.requests) == 1
    assert sleep.calls == []


async def test_malformed_chunk__is_a_bad_response_keeping_the_streamed_text(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(SseReply([*wire.unfinished("Par", "tial"), sse_frame("{not json")]))

    with pytest.raises(ModelProviderBadResponse, match="malformed JSON") as info:
        await collect(provider, HELLO)

    assert info.value.code == "model_provider_bad_response"
    assert info.value.partial_text == "Partial"
    assert sleep.calls == []


async def test_stream_ended_before_its_terminator__is_a_bad_response(
    wire: Wire, provider: ModelProvider
) -> None:
    wire.server.push(SseReply(wire.unfinished("Half an ")))

    with pytest.raises(ModelProviderBadResponse, match="ended before") as info:
        await collect(provider, HELLO)

    assert info.value.partial_text == "Half an "


async def test_connection_dropped_mid_stream__is_a_bad_response(
    wire: Wire, provider: ModelProvider, sleep: RecordingSleep
) -> None:
    wire.server.push(SseReply(wire.unfinished("Half an "), cut=True))

    with pytest.raises(ModelProviderBadResponse, match="cut") as info:
        await collect(provider, HELLO)

    assert info.value.partial_text == "Half an "
    assert sleep.calls == []


@pytest.fixture
def refused_url() -> str:
    """A port nothing listens on: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_connection_refused__is_retried_then_unavailable(
    wire: Wire, refused_url: str, sleep: RecordingSleep
) -> None:
    provider = wire.build(refused_url, HttpOptions(timeout=TIMEOUT, retry=_retry(sleep)))
    try:
        with pytest.raises(ModelProviderUnavailable, match="cannot reach"):
            await collect(provider, HELLO)
    finally:
        await provider.aclose()

    assert len(sleep.calls) == RETRY.max_attempts - 1


@pytest.fixture
def unanswering_url() -> Iterator[str]:
    """A listener whose accept queue is full, so a new connection's handshake never completes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


async def test_connect_timeout__is_a_timeout_and_not_retried(
    wire: Wire, unanswering_url: str, sleep: RecordingSleep
) -> None:
    provider = wire.build(unanswering_url, HttpOptions(timeout=TIMEOUT, retry=_retry(sleep)))
    try:
        with pytest.raises(ModelProviderTimeout, match="connecting"):
            await collect(provider, HELLO)
    finally:
        await provider.aclose()

    assert sleep.calls == []


async def test_line_ends__crlf_split_between_reads_and_lines_longer_than_the_read_buffer(
    wire: Wire, provider: ModelProvider
) -> None:
    # SSE lets a server end lines with \r\n and spread one event's data over several lines;
    # a \r\n read as "...\r" then "\n..." must not end the event early, and a line longer
    # than aiohttp's own line reader takes (a long answer in one delta) is still read whole.
    long_piece = "x" * 300_000
    frames = [
        frame.replace("data: {", "data: {\ndata: ", 1).replace("\n", "\r\n")
        for frame in wire.text_reply("one ", long_piece).frames
    ]
    pieces = [part for frame in frames for part in frame.replace("\r\n", "\r\0\n").split("\0")]
    # A pause after each "\r" makes the client read the "\n" in a later chunk.
    after_cr = {i + 1: 0.01 for i, piece in enumerate(pieces) if piece.endswith("\r")}
    wire.server.push(SseReply(pieces, split=False, pauses=after_cr))

    events = await collect(provider, HELLO)

    assert text_of(events) == "one " + long_piece


async def test_closing_the_stream_early__releases_the_connection(wire: Wire) -> None:
    # One pooled connection: if closing the stream leaked the response, the second call would
    # wait for the pool and fail with a (pool) timeout.
    client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
    provider = wire.build(wire.base_url, HttpOptions(client=client, timeout=TIMEOUT))
    wire.server.push(wire.text_reply("one ", "two ", "three"), wire.text_reply("again"))
    try:
        stream = provider.stream(HELLO)
        first = await anext(stream)
        await stream.aclose()
        events = await collect(provider, HELLO)
    finally:
        await provider.aclose()
        await client.close()

    assert text_of([first]) == "one "
    assert text_of(events) == "again"


def test_parse_retry_after__seconds_milliseconds_and_http_dates() -> None:
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC).timestamp()

    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:10 GMT"}, now=now) == 10.0
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:27:00 GMT"}, now=now) == 0.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None

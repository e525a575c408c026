"""One streamed POST to a model API: timeouts, retries, and every fault mapped to our errors.

Both wire formats fail the same ways, so this is written once and the providers only build
requests and parse events. The rules:

- 429 and 5xx (and a connection refused) are retried, at most ``RetryPolicy.max_attempts``
  attempts in all, waiting what ``Retry-After`` says or else a capped exponential backoff. A
  ``Retry-After`` longer than ``max_retry_after`` is not waited out: a turn holds the session's
  lock, so failing fast with the wait in the error beats a silent ten-minute stall.
- Nothing is retried once an event reached the caller: the text is already on the user's
  screen and a second attempt would write a different answer under it.
- Timeouts are not retried: the caller has already waited a whole timeout.
- aiohttp's errors never leave this module; they become ``ModelProviderError`` ``from`` the
  cause, with the text streamed so far in ``partial_text``.

The client is aiohttp's, as for the Slack Web API: reading a streamed answer through httpx's
layered async iterators cost about 6.4 ms of CPU for a 24-chunk answer against aiohttp's 0.8
(docs/benchmarks.md, *A turn's own CPU*), a fifth of a turn's own CPU.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from core.errors import (
    ModelProviderBadResponse,
    ModelProviderError,
    ModelProviderRateLimited,
    ModelProviderRejected,
    ModelProviderTimeout,
    ModelProviderUnavailable,
)
from core.leases import before_side_effect
from core.providers.base import EventStream, JsonObject, TextDelta
from core.providers.sse import ServerSentEvent, iter_sse

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """How long a request may wait, in seconds, at each of its stages.

    Models think before their first token and between tool calls, so ``read`` (the longest
    silence between two chunks of the answer) is generous; ``connect`` (opening a connection)
    should never take long; ``pool``: waiting for one of the client's connections to be free.
    There is no write timeout: a request is one JSON body, written at once."""

    connect: float = 10.0
    read: float = 120.0
    pool: float = 10.0

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None,
            connect=self.pool + self.connect,
            sock_connect=self.connect,
            sock_read=self.read,
        )


DEFAULT_TIMEOUT = Timeouts()
# Connections of the client a provider makes; ``ProviderCache`` sizes it from
# MAX_CONCURRENT_TURNS.
DEFAULT_MAX_CONNECTIONS = 100
# The most one read takes from the socket before the lines are cut out of it.
READ_BUFFER = 2**16

Sleep = Callable[[float], Awaitable[None]]
Parser = Callable[[AsyncIterator[ServerSentEvent]], EventStream]


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    base_delay: float = 1.0
    max_delay: float = 8.0
    max_retry_after: float = 60.0
    sleep: Sleep = field(default=asyncio.sleep, compare=False)

    def delay(self, error: ModelProviderError, attempt: int) -> float | None:
        """Seconds to wait before attempt ``attempt + 1``, or ``None`` to give up."""
        if not isinstance(error, ModelProviderUnavailable | ModelProviderRateLimited):
            return None
        if attempt >= self.max_attempts:
            return None
        if error.retry_after is not None:
            return error.retry_after if error.retry_after <= self.max_retry_after else None
        return float(min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds from ``retry-after-ms`` (OpenAI) or ``Retry-After`` (seconds or an HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def error_detail(body: bytes) -> str:
    """The human part of an error body; both APIs put it at ``error.message``."""
    try:
        payload = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])[:300]
        if isinstance(error, str):
            return error[:300]
    return json.dumps(payload)[:300]


def parse_json_object(data: str, *, provider: str, what: str) -> JsonObject:
    """A JSON object from the wire, or the bad-response error naming what was malformed."""
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ModelProviderBadResponse(
            f"{provider}: malformed JSON in {what}: {data[:200]!r}", provider=provider
        ) from exc
    if not isinstance(value, dict):
        raise ModelProviderBadResponse(
            f"{provider}: {what} is not a JSON object: {data[:200]!r}", provider=provider
        )
    return value


def status_error(
    provider: str, response: aiohttp.ClientResponse, body: bytes
) -> ModelProviderError:
    status = response.status
    message = f"{provider}: HTTP {status} from {response.request_info.real_url}"
    detail = error_detail(body)
    if detail:
        message += f": {detail}"
    retry_after = parse_retry_after(response.headers)  # aiohttp's: case-insensitive
    if status == 429:
        return ModelProviderRateLimited(
            message, provider=provider, status_code=status, retry_after=retry_after
        )
    if status >= 500:
        return ModelProviderUnavailable(
            message, provider=provider, status_code=status, retry_after=retry_after
        )
    return ModelProviderRejected(message, provider=provider, status_code=status)


@dataclass(frozen=True)
class HttpOptions:
    """How a provider reaches the network. Tests give their own ``client`` or shorten
    ``timeout`` and ``retry``; ``timeout`` applies even to a given client, because the
    provider, not the client's owner, knows how long a model may stay silent."""

    client: aiohttp.ClientSession | None = None
    timeout: Timeouts = field(default_factory=Timeouts)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Connections of the client the provider makes (none given). A cap below the turns that
    # may run at once would make the next turn wait for a connection, and fail after the pool
    # timeout, however many turns MAX_CONCURRENT_TURNS allows.
    max_connections: int = DEFAULT_MAX_CONNECTIONS


class SseStreamer:
    """POSTs a JSON body and hands the SSE reply to a parser, retrying as the module says."""

    def __init__(self, provider: str, http: HttpOptions | None = None) -> None:
        http = http or HttpOptions()
        self.provider = provider
        self.timeout = http.timeout
        self.retry = http.retry
        self._given = http.client
        self._max_connections = http.max_connections
        self._timeout = http.timeout.client_timeout()
        # Made on first use, in the loop that streams (an aiohttp session belongs to one).
        self._client: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proxies: dict[str, _Proxy] = {}  # per URL (``_proxy``)

    def _session(self) -> aiohttp.ClientSession:
        if self._given is not None:
            return self._given
        client, loop = self._client, asyncio.get_running_loop()
        if client is None or client.closed or self._loop is not loop:
            # A session of another (ended) loop cannot be closed from this one: it is left.
            self._loop = loop
            self._client = client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
                read_bufsize=READ_BUFFER,
            )
        return client

    async def _proxy(self, url: str) -> _Proxy:
        """The proxy for ``url`` that ``HTTPS_PROXY``, ``HTTP_PROXY`` and ``NO_PROXY`` name (and
        its credentials, from the URL or ``~/.netrc``), looked up once per URL; none for a
        client a test gave. aiohttp's ``trust_env`` looks it up on every request, and reads
        ``~/.netrc`` for the host's own credentials, each in a worker thread: two thread hops a
        model call, for an environment that does not change while we run. The host's netrc
        credentials are not wanted either: a provider authenticates by its own header, and
        aiohttp refuses a request that has both."""
        if self._given is not None:
            return _NO_PROXY
        found = self._proxies.get(url)  # a provider calls one or two URLs
        if found is None:
            found = self._proxies[url] = await asyncio.to_thread(_env_proxy, URL(url))
        return found

    async def aclose(self) -> None:
        """Closes the client only if we made it: an injected one belongs to its owner."""
        if self._client is not None and not self._client.closed:
            await self._client.close()
        self._client = None

    async def stream(
        self, url: str, headers: Mapping[str, str], body: JsonObject, parse: Parser
    ) -> EventStream:
        streamed: list[str] = []
        attempt = 0
        while True:
            attempt += 1
            produced = False
            try:
                async with aclosing(self._attempt(url, headers, body, parse)) as events:
                    async for event in events:
                        produced = True
                        if isinstance(event, TextDelta):
                            streamed.append(event.text)
                        yield event
                return
            except ModelProviderError as exc:
                exc.partial_text = "".join(streamed)
                delay = None if produced else self.retry.delay(exc, attempt)
                if delay is None:
                    raise
                log.warning(
                    "%s; retrying in %.1fs (attempt %d of %d)",
                    exc.message,
                    delay,
                    attempt + 1,
                    self.retry.max_attempts,
                )
            await self.retry.sleep(delay)

    async def _attempt(
        self, url: str, headers: Mapping[str, str], body: JsonObject, parse: Parser
    ) -> EventStream:
        provider = self.provider
        answered = False
        try:
            proxy = await self._proxy(url)
            before_side_effect()  # a turn past its lease's safe age sends no request
            async with self._session().post(
                url,
                headers=dict(headers),
                json=body,
                timeout=self._timeout,
                proxy=proxy.url,
                proxy_auth=proxy.auth,
            ) as response:
                answered = True
                if not 200 <= response.status < 300:
                    raise status_error(provider, response, await response.read())
                async with (
                    aclosing(iter_sse(_lines(response.content))) as sse,
                    aclosing(parse(sse)) as events,
                ):
                    async for event in events:
                        yield event
        except aiohttp.ConnectionTimeoutError as exc:
            raise ModelProviderTimeout(
                f"{provider}: connecting to {url} timed out after {self.timeout.connect}s",
                provider=provider,
            ) from exc
        except aiohttp.SocketTimeoutError as exc:
            raise ModelProviderTimeout(
                f"{provider}: {url} sent nothing for {self.timeout.read}s (read timeout)",
                provider=provider,
            ) from exc
        except TimeoutError as exc:
            raise ModelProviderTimeout(
                f"{provider}: request to {url} timed out ({type(exc).__name__})",
                provider=provider,
            ) from exc
        except aiohttp.ClientError as exc:
            if answered:  # the reply had begun: what we have is a cut stream
                raise ModelProviderBadResponse(
                    f"{provider}: the stream from {url} was cut: {exc!r}", provider=provider
                ) from exc
            raise ModelProviderUnavailable(
                f"{provider}: cannot reach {url}: {exc!r}", provider=provider
            ) from exc


class _Proxy(NamedTuple):
    url: URL | None
    auth: aiohttp.BasicAuth | None


_NO_PROXY: Final = _Proxy(None, None)


def _env_proxy(url: URL) -> _Proxy:
    """What aiohttp's ``trust_env`` would choose for ``url`` (it reads files: off the loop)."""
    try:
        return _Proxy(*get_env_proxy_for_url(url))
    except LookupError:  # none named, or NO_PROXY covers the host
        return _NO_PROXY


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The answer's lines as they arrive, without their ends (``\n``, ``\r\n`` or ``\r``, as
    SSE allows), however long a line is (aiohttp's own line reader refuses long ones)."""
    pending = b""
    async for chunk in content.iter_any():
        pending += chunk
        if b"\n" not in chunk and b"\r" not in chunk:
            continue
        lines = pending.splitlines(keepends=True)
        # A last line without its \n is unfinished, or ends in a \r that may be half of a
        # \r\n: it waits for the next chunk.
        pending = b"" if lines[-1].endswith(b"\n") else lines.pop()
        for line in lines:
            yield line.rstrip(b"\r\n").decode("utf-8", "replace")
    if pending:
        yield pending.rstrip(b"\r\n").decode("utf-8", "replace")

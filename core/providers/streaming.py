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
- httpx errors never leave this module; they become ``ModelProviderError`` ``from`` the cause,
  with the text streamed so far in ``partial_text``.
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

import httpx

from core.errors import (
    ModelProviderBadResponse,
    ModelProviderError,
    ModelProviderRateLimited,
    ModelProviderRejected,
    ModelProviderTimeout,
    ModelProviderUnavailable,
)
from core.providers.base import EventStream, JsonObject, TextDelta
from core.providers.sse import ServerSentEvent, iter_sse

log = logging.getLogger(__name__)

# Models think before their first token and between tool calls, so the read timeout (the longest
# silence between two chunks) is generous; connecting should never take long.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=120.0, write=30.0, pool=10.0)
DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)

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


def status_error(provider: str, response: httpx.Response, body: bytes) -> ModelProviderError:
    status = response.status_code
    message = f"{provider}: HTTP {status} from {response.request.url}"
    detail = error_detail(body)
    if detail:
        message += f": {detail}"
    retry_after = parse_retry_after(response.headers)
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
    """How a provider reaches the network. Tests point ``transport`` or ``client`` at a local
    server and shorten ``timeout`` and ``retry``; ``timeout`` applies even to a given client,
    because the provider, not the client's owner, knows how long a model may stay silent."""

    client: httpx.AsyncClient | None = None
    transport: httpx.AsyncBaseTransport | None = None
    timeout: httpx.Timeout = field(default_factory=lambda: DEFAULT_TIMEOUT)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Connections of the client the provider makes (none given). httpx's default cap (100) would
    # make turn 101 wait for a connection, and fail after the pool timeout, however many turns
    # MAX_CONCURRENT_TURNS allows; ``ProviderCache`` sizes it from that setting.
    limits: httpx.Limits = field(default_factory=lambda: DEFAULT_LIMITS)


class SseStreamer:
    """POSTs a JSON body and hands the SSE reply to a parser, retrying as the module says."""

    def __init__(self, provider: str, http: HttpOptions | None = None) -> None:
        http = http or HttpOptions()
        self.provider = provider
        self.timeout = http.timeout
        self.retry = http.retry
        self._owns_client = http.client is None
        self._client = http.client or httpx.AsyncClient(
            transport=http.transport, timeout=http.timeout, limits=http.limits
        )

    async def aclose(self) -> None:
        """Closes the client only if we made it: an injected one belongs to its owner."""
        if self._owns_client:
            await self._client.aclose()

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
            async with self._client.stream(
                "POST", url, headers=dict(headers), json=body, timeout=self.timeout
            ) as response:
                answered = True
                if not response.is_success:
                    raise status_error(provider, response, await response.aread())
                async with (
                    aclosing(iter_sse(response.aiter_lines())) as sse,
                    aclosing(parse(sse)) as events,
                ):
                    async for event in events:
                        yield event
        except httpx.ConnectTimeout as exc:
            raise ModelProviderTimeout(
                f"{provider}: connecting to {url} timed out after {self.timeout.connect}s",
                provider=provider,
            ) from exc
        except httpx.ReadTimeout as exc:
            raise ModelProviderTimeout(
                f"{provider}: {url} sent nothing for {self.timeout.read}s (read timeout)",
                provider=provider,
            ) from exc
        except httpx.TimeoutException as exc:
            raise ModelProviderTimeout(
                f"{provider}: request to {url} timed out ({type(exc).__name__})",
                provider=provider,
            ) from exc
        except httpx.HTTPError as exc:
            if answered:  # the reply had begun: what we have is a cut stream
                raise ModelProviderBadResponse(
                    f"{provider}: the stream from {url} was cut: {exc}", provider=provider
                ) from exc
            raise ModelProviderUnavailable(
                f"{provider}: cannot reach {url}: {exc}", provider=provider
            ) from exc

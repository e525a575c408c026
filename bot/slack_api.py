"""The Slack Web API client every part of the app uses, and what it tells ``/metrics``.

slack_sdk's own retry handlers do the retrying: a 429 is waited out as ``Retry-After`` says, a
5xx answer and a dropped connection are retried with backoff; a turn waiting so holds none of
the places of the turns at work. What is left after them is a failure the caller deals with;
each one (and each 429) is counted by method. Bolt makes a new client for every request (so a
token set on it by authorisation stays that request's): the app's middleware (``bot.app``)
swaps it for an observed one, so listeners' calls count too.
"""

from __future__ import annotations

from typing import Any

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.async_handler import AsyncRetryHandler
from slack_sdk.http_retry.builtin_async_handlers import (
    AsyncConnectionErrorRetryHandler,
    AsyncRateLimitErrorRetryHandler,
    AsyncServerErrorRetryHandler,
)
from slack_sdk.http_retry.request import HttpRequest
from slack_sdk.http_retry.response import HttpResponse
from slack_sdk.http_retry.state import RetryState
from slack_sdk.web.async_client import AsyncWebClient
from slack_sdk.web.async_slack_response import AsyncSlackResponse

from core.conversation.worker import waiting_aside
from core.runtime import Settings, metrics

RETRIES = 3


class _WaitsAside(AsyncRetryHandler):
    """A retry's wait (Slack's ``Retry-After``, a backoff) is not the turn's own work: the
    turn's place among those at work goes to another turn meanwhile (``waiting_aside``)."""

    async def prepare_for_next_attempt_async(
        self,
        *,
        state: RetryState,
        request: HttpRequest,
        response: HttpResponse | None = None,
        error: Exception | None = None,
    ) -> None:
        async with waiting_aside():
            await super().prepare_for_next_attempt_async(
                state=state, request=request, response=response, error=error
            )


class _ConnectionErrors(_WaitsAside, AsyncConnectionErrorRetryHandler):
    pass


class _ServerErrors(_WaitsAside, AsyncServerErrorRetryHandler):
    pass


class _CountedRateLimits(_WaitsAside, AsyncRateLimitErrorRetryHandler):
    async def _can_retry_async(
        self,
        *,
        state: RetryState,
        request: HttpRequest,
        response: HttpResponse | None = None,
        error: Exception | None = None,
    ) -> bool:
        limited = await super()._can_retry_async(
            state=state, request=request, response=response, error=error
        )
        if limited:
            metrics.SLACK_RATE_LIMITED.labels(_method(request.url)).inc()
        return limited


def _method(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]


class ObservedWebClient(AsyncWebClient):
    """``AsyncWebClient`` that counts the calls that failed after the retries."""

    async def api_call(self, api_method: str, **kwargs: Any) -> AsyncSlackResponse:
        try:
            return await super().api_call(api_method, **kwargs)
        except SlackApiError as exc:
            # An answer that was not JSON (a proxy's error page) leaves ``data`` a string.
            data = exc.response.data if exc.response is not None else None
            error = data.get("error") if isinstance(data, dict) else None
            metrics.SLACK_API_ERRORS.labels(api_method, str(error or "unknown")).inc()
            raise
        except Exception as exc:
            metrics.SLACK_API_ERRORS.labels(api_method, exc.__class__.__name__).inc()
            raise


def observed(client: AsyncWebClient) -> AsyncWebClient:
    """``client`` as an ``ObservedWebClient``: the same token, URL, HTTP session, headers,
    team and retry handlers (what Bolt sets on the client it builds for each request, which
    is a plain ``AsyncWebClient`` whatever client the app was given)."""
    if isinstance(client, ObservedWebClient):
        return client
    made = ObservedWebClient(
        token=client.token,
        base_url=client.base_url,
        timeout=client.timeout,
        ssl=client.ssl,
        proxy=client.proxy,
        session=client.session,
        trust_env_in_session=client.trust_env_in_session,
        headers=dict(client.headers),
        logger=client.logger,
        retry_handlers=client.retry_handlers,
    )
    made.default_params = dict(client.default_params)  # the org-wide install's team_id
    return made


def retry_handlers() -> list[AsyncRetryHandler]:
    return [
        _ConnectionErrors(max_retry_count=RETRIES),
        _ServerErrors(max_retry_count=RETRIES),
        _CountedRateLimits(max_retry_count=RETRIES),
    ]


def web_client(
    settings: Settings, token: str | None = None, session: aiohttp.ClientSession | None = None
) -> AsyncWebClient:
    """A client for SLACK_API_URL with the retry handlers above. Without ``session`` slack_sdk
    opens a new HTTP session, so a new connection, for every call: a replica passes one it
    keeps open (``Bot.open``), and its calls reuse warm connections."""
    return ObservedWebClient(
        token=token,
        base_url=settings.slack_api_url,
        retry_handlers=retry_handlers(),
        session=session,
    )


def http_session() -> aiohttp.ClientSession:
    """The replica's one HTTP session for the Web API (no cap of its own on connections: the
    turns that make the calls are already capped by MAX_CONCURRENT_TURNS)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

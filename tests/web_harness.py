"""The HTTP API's tests' kit: a real bot serving it, people with tokens, a client."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.slack_harness import RunningBot


@dataclass
class Answer:
    status: int
    body: Any
    headers: dict[str, str]
    raw: bytes


class ApiClient:
    """Real HTTP to the listener, as one person (a bearer token, or a cookie and its CSRF)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        cookie: str | None = None,
        csrf: str | None = None,
    ) -> None:
        self.url = url
        self.token = token
        self.cookie = cookie
        self.csrf = csrf

    async def call(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        sent: dict[str, str] = dict(headers or {})
        if self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        if self.cookie is not None:
            sent.setdefault("Cookie", f"slack_agent_session={self.cookie}")
        if self.csrf is not None:
            sent.setdefault("X-CSRF-Token", self.csrf)
        if json is not None:
            data = _dumps(json)
            sent.setdefault("Content-Type", "application/json")
        payload: Any = io.BytesIO(data) if data is not None and len(data) > 1 << 19 else data
        async with (
            aiohttp.ClientSession() as session,
            session.request(method, self.url + path, data=payload, headers=sent) as response,
        ):
            raw = await response.read()
            body: Any = None
            if response.content_type == "application/json" and raw:
                body = await response.json()
            return Answer(response.status, body, dict(response.headers), raw)

    async def get(self, path: str) -> Answer:
        return await self.call("GET", path)

    async def post(self, path: str, json: Any = None, **kw: Any) -> Answer:
        return await self.call("POST", path, json, **kw)


def _dumps(value: Any) -> bytes:
    import json

    return json.dumps(value).encode()


async def person_token(bot: RunningBot, person: str, **kw: Any) -> tuple[int, str]:
    """A user row for ``person`` and a token acting as them: (user id, token)."""
    storage = bot.bot.runtime.storage
    user_id = await storage.sessions.get_or_create_user(person)
    _, secret = await storage.web_access.create_token(
        user_id, name=kw.get("name"), expires_days=kw.get("expires_days")
    )
    return user_id, secret


async def api_as(bot: RunningBot, person: str) -> ApiClient:
    _, token = await person_token(bot, person)
    return ApiClient(bot.url, token)

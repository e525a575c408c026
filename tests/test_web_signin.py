"""Sign in with Slack through the stand-in's authorize page, over real HTTP on both databases."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from standins.slack import SlackStandIn
from tests.slack_harness import RunningBot, running_bot
from tests.web_harness import ApiClient


@pytest.fixture
async def running(database_url: str, slack: SlackStandIn) -> AsyncIterator[RunningBot]:
    async with running_bot(
        database_url,
        slack,
        slack_signin_client_id="A1.client",
        slack_signin_client_secret="secret",
        slack_openid_authorize_url=slack.authorize_url,
    ) as bot:
        yield bot


async def sign_in(
    running: RunningBot, browser: aiohttp.ClientSession, next_path: str
) -> aiohttp.ClientResponse:
    """The three hops a browser makes; the last answer (the redirect to ``next``)."""
    start = await browser.get(
        running.url + "/auth/slack", params={"next": next_path}, allow_redirects=False
    )
    assert start.status == 302
    authorize = start.headers["Location"]
    asked = parse_qs(urlsplit(authorize).query)
    assert asked["client_id"] == ["A1.client"]
    assert asked["redirect_uri"] == [running.url + "/auth/slack/callback"]
    back = await browser.get(authorize, allow_redirects=False)
    assert back.status == 302
    return await browser.get(back.headers["Location"], allow_redirects=False)


async def test_a_browser_signs_in_with_slack_and_out(
    running: RunningBot, slack: SlackStandIn
) -> None:
    slack.names["U1"] = "Ada"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        done = await sign_in(running, browser, "/sessions/5?x=1")
        assert done.status == 302
        assert done.headers["Location"] == "/sessions/5?x=1"
        cookie = done.cookies["slack_agent_session"]
        assert cookie["httponly"]
        assert cookie["samesite"] == "Lax"
        assert not cookie["secure"]  # plain HTTP here; Secure over HTTPS
        me = await browser.get(running.url + "/v1/me")
        body = await me.json()
        assert body["person"] == "slack:T1:U1"
        assert body["name"] == "Ada"
        assert body["csrfToken"]
        out = await browser.post(running.url + "/auth/signout")
        assert out.status == 204
        assert (await browser.get(running.url + "/v1/me")).status == 401
    # Only the hash was kept: the cookie's value is nowhere in the table.
    assert cookie.value not in repr(await running.bot.runtime.storage.web_access.tokens())


async def test_next_never_leaves_the_origin(running: RunningBot) -> None:
    targets = ["https://evil.example/", "//evil.example/x", "/\\evil.example", "javascript:x"]
    for target in targets:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            done = await sign_in(running, browser, target)
            assert done.headers["Location"] == "/", target


async def test_a_callback_without_its_state_signs_nobody_in(running: RunningBot) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        forged = await browser.get(
            running.url + "/auth/slack/callback",
            params={"code": "code-1", "state": "guessed"},
            allow_redirects=False,
        )
        assert forged.status == 400
        assert (await forged.json())["code"] == "bad_request"
        assert "slack_agent_session" not in forged.cookies


async def test_expired_sign_ins_open_nothing_and_the_sweeper_removes_them(
    running: RunningBot,
) -> None:
    storage = running.bot.runtime.storage
    user_id = await storage.sessions.get_or_create_user("slack:T1:U1")
    # (A new sign-in removes its person's expired ones: the expired one comes last here.)
    live = await storage.web_access.sign_in(user_id, lifetime_seconds=600)
    old = await storage.web_access.sign_in(user_id, lifetime_seconds=-1)
    assert (await ApiClient(running.url, cookie=old).get("/v1/me")).status == 401
    report = await storage.sweep()
    assert report.extra["sign_ins"] == 1
    assert (await ApiClient(running.url, cookie=live).get("/v1/me")).status == 200


async def test_without_credentials_sign_in_is_a_clear_404(
    database_url: str, slack: SlackStandIn
) -> None:
    async with running_bot(database_url, slack) as bot:
        answer = await ApiClient(bot.url).get("/auth/slack")
        assert answer.status == 404
        assert "SLACK_CLIENT_ID" in answer.body["message"]

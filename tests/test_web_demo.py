"""``slack-agent demo --web``'s last part: the page and its API stay up on a port, "Sign in with
Slack" signs the demo's person in through the stand-in (no Slack), and cancelling (Ctrl-C) lets
go of everything."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest

from slack_agent.demo import keep_the_page_up
from standins.processes import free_port
from standins.slack import TEAM, SlackStandIn

# It starts the demo's notes MCP server as a process.
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("backend", ["sqlite"])]


async def test_demo_web__the_page_signs_the_demos_person_in_until_cancelled(
    database_url: str, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with SlackStandIn(TEAM, history=True) as standin:
        up = asyncio.create_task(keep_the_page_up(standin, database_url, tmp_path, port))
        try:
            # unsafe: keep cookies of an IP address (127.0.0.1), as a browser does
            jar = aiohttp.CookieJar(unsafe=True)
            async with aiohttp.ClientSession(cookie_jar=jar) as browser:
                for _ in range(600):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with browser.get(url + "/") as page:
                            if page.status == 200:
                                break
                    assert not up.done(), up
                    await asyncio.sleep(0.1)
                async with browser.get(url + "/auth/slack?next=/usage") as signed:
                    assert signed.status == 200
                    assert str(signed.url) == url + "/usage"
                    assert '<div id="root">' in await signed.text()
                async with browser.get(url + "/v1/me") as me:
                    who = await me.json()
                assert who["person"] == f"slack:{TEAM}:U0ALICE"
                assert who["admin"] is True
        finally:
            up.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await up
        async with aiohttp.ClientSession() as after:
            with pytest.raises(aiohttp.ClientConnectionError):
                await after.get(url + "/")

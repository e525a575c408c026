"""The web page's weight and first paint: ``slack-agent bench web-page [LOADS]``.

Weight: each file of the built page (``web/static``) as shipped and gzipped at level 9, which is
what ``web.page`` sends a browser that accepts gzip. Paint: a real ``slack-agent serve`` child
(SQLite, the Slack stand-in in a process of its own) and headless Chromium (Debian's, at
``/usr/bin/chromium``, driven by Playwright, a development dependency), LOADS (default 21) cold
loads each in a new browser context: the first contentful paint of the signed-out page (its
sign-in screen: the whole bundle fetched, parsed and run, ``/v1/me`` answering 401), the same
signed in (the navigation drawn once ``/v1/me`` answered), and when the session list showed
(``performance.now()`` once its heading is there, read through Playwright, so a millisecond or
two late): p50 and p95 in milliseconds.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import serve_process, standin_process, stop_process, summarize
from core.errors import UsageError
from core.settings import load_settings
from core.storage import Storage
from web.page import STATIC

CHROMIUM = "/usr/bin/chromium"
PERSON = "slack:T1:U1"
COOKIE = "slack_agent_session"
FIRST_PAINT = """new Promise((done) => new PerformanceObserver((list) => {
    const entry = list.getEntriesByName("first-contentful-paint")[0];
    if (entry) done(entry.startTime);
}).observe({type: "paint", buffered: true}))"""


def weight() -> dict[str, dict[str, int]]:
    """Each shipped file: its bytes and its bytes gzipped as ``web.page`` sends them."""
    shipped = sorted(p for p in STATIC.rglob("*") if p.is_file())
    return {
        str(path.relative_to(STATIC)): {
            "bytes": len(raw := path.read_bytes()),
            "gzipped": len(gzip.compress(raw, compresslevel=9, mtime=0)),
        }
        for path in shipped
    }


async def _paint(loads: int) -> dict[str, Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError as exc:  # installed without the development dependencies
        raise UsageError("bench web-page: needs Playwright (uv sync installs it)") from exc
    if shutil.which(CHROMIUM) is None:
        raise UsageError(f"bench web-page: needs Chromium at {CHROMIUM} (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        standin, api_url = await standin_process()
        database = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        proc, port = await serve_process(database, api_url, tmp)
        url = f"http://127.0.0.1:{port}"
        storage = Storage.open(load_settings(database_url=database))
        signed_out: list[float] = []
        signed_in: list[float] = []
        listed: list[float] = []
        try:
            user_id = await storage.sessions.get_or_create_user(PERSON)
            async with async_playwright() as playwright:
                browser = await playwright.chromium.launch(executable_path=CHROMIUM)
                for _ in range(loads):
                    for cookie in (None, await _sign_in(storage, user_id)):
                        context = await browser.new_context()
                        if cookie is not None:
                            await context.add_cookies(
                                [{"name": COOKIE, "value": cookie, "url": url}]
                            )
                        page = await context.new_page()
                        await page.goto(url + "/")
                        painted = float(await page.evaluate(FIRST_PAINT))
                        if cookie is None:
                            signed_out.append(painted / 1000)
                        else:
                            signed_in.append(painted / 1000)
                            heading = page.get_by_role("heading", name="Sessions")
                            await heading.wait_for()
                            listed.append(float(await page.evaluate("performance.now()")) / 1000)
                        await context.close()
                await browser.close()
        finally:
            await storage.dispose()
            await stop_process(proc)
            await stop_process(standin)
    return {
        "loads": loads,
        "first_paint_signed_out_ms": summarize(signed_out),
        "first_paint_signed_in_ms": summarize(signed_in),
        "sessions_listed_ms": summarize(listed),
    }


async def _sign_in(storage: Storage, user_id: int) -> str:
    return await storage.web_access.sign_in(user_id, lifetime_seconds=3600)


def run_part(argv: Sequence[str]) -> None:
    loads = int(argv[0]) if argv else 21
    paint = asyncio.run(_paint(loads))
    print(json.dumps({"web_page": {"weight": weight(), **paint}}))

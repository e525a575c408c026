"""``web.page``: the page's routes answer index.html (never cached stale) and hashed assets
(cached for good), and leave every other path alone."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
from aiohttp import web

from web.page import ASSET_CACHE, STATIC, add_page_routes


async def _serve() -> tuple[web.AppRunner, str]:
    app = web.Application()
    add_page_routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_the_page_and_its_assets() -> None:
    runner, url = await _serve()
    index = (STATIC / "index.html").read_bytes()
    script = re.search(rb'src="(/assets/[^"]+\.js)"', index)
    assert script is not None
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/", "/sessions", "/sessions/12", "/usage", "/admin"):
                async with http.get(url + path) as r:
                    assert r.status == 200, path
                    assert await r.read() == index
                    assert r.headers["Cache-Control"] == "no-cache"
                    assert "default-src 'self'" in r.headers["Content-Security-Policy"]
            name = Path(script.group(1).decode()).name
            for encoding in ("gzip", "identity"):
                asked = {"Accept-Encoding": encoding}
                async with http.get(url + script.group(1).decode(), headers=asked) as r:
                    assert r.status == 200
                    assert r.headers["Cache-Control"] == ASSET_CACHE
                    assert r.headers["Content-Type"].startswith("text/javascript")
                    assert r.headers.get("Content-Encoding") == (
                        "gzip" if encoding == "gzip" else None
                    )
                    assert await r.read() == (STATIC / "assets" / name).read_bytes()
            for path in ("/assets/nope.js", "/assets/..%2Findex.html", "/v1/nothing", "/healthz"):
                async with http.get(url + path) as r:
                    assert r.status == 404, path
            async with http.post(url + "/slack/events") as r:
                assert r.status == 404  # the page never shadows another route
    finally:
        await runner.cleanup()

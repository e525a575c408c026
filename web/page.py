"""The web page at ``/``: the built bundle (``web/static``, made from ``web/ui`` by Vite and
committed, so serving it needs no Node) on the listener that serves the HTTP API.

``add_page_routes(app)`` adds ``/assets/{name}`` (hashed file names, so cached for a year and
never revalidated) and ``index.html`` on each of the page's own routes (it routes on the client:
``/sessions/12`` is the page's, which asks the API for session 12 itself), sent ``no-cache`` so a
new release is picked up at the next load. Assets are read once and kept gzipped in memory (the
bundle is a few hundred kilobytes, a quarter of that gzipped): a browser that accepts gzip gets
the gzipped bytes, with no work per request.

The routes are named one by one rather than caught all: any other path keeps its plain 404 (and a
``POST`` its 404, not a 405), so the page never shadows the API, Slack's endpoints or the
operator's. Every answer carries a Content-Security-Policy that allows this origin only: the page
loads no fonts, scripts or styles from anywhere else, and works with no internet.
"""

from __future__ import annotations

import gzip
import mimetypes
import re
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "static"
# Vite names each asset after its content's hash: a changed file is a new name.
ASSET_CACHE = "public, max-age=31536000, immutable"
INDEX_CACHE = "no-cache"
# The page's own routes (web/ui/src/App.tsx names the same): each answers index.html.
PAGE_ROUTES = ("/", "/sessions", r"/sessions/{id:\d+}", "/usage", "/admin")
ASSET_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}$")
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'self'; "
        "form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}


def _not_found(message: str) -> web.Response:
    return web.json_response({"code": "not_found", "message": message}, status=404)


@dataclass(frozen=True)
class Asset:
    raw: bytes
    gzipped: bytes
    content_type: str


def _asset(path: Path) -> Asset:
    raw = path.read_bytes()
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if path.suffix == ".js":
        kind = "text/javascript"  # some systems' tables still say application/javascript
    return Asset(raw, gzip.compress(raw, compresslevel=9, mtime=0), kind)


class Page:
    """The bundle in ``static``: ``index.html`` read once, assets served from disk."""

    def __init__(self, static: Path = STATIC) -> None:
        self.static = static
        self.assets = static / "assets"
        self._index: bytes | None = None
        self._assets: dict[str, Asset] = {}

    def _index_html(self) -> bytes | None:
        if self._index is None:
            try:
                self._index = (self.static / "index.html").read_bytes()
            except FileNotFoundError:
                return None
        return self._index

    async def index(self, _request: web.Request) -> web.StreamResponse:
        body = self._index_html()
        if body is None:
            # A checkout whose bundle was deleted: say so, once per request, in one line.
            return web.Response(
                status=503, text="The web page is not built: web/static/index.html is missing.\n"
            )
        return web.Response(
            body=body,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": INDEX_CACHE, **SECURITY_HEADERS},
        )

    async def asset(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        asset = self._assets.get(name)
        if asset is None:
            path = self.assets / name
            if not ASSET_NAME.match(name) or not path.is_file():
                return _not_found("no such file")
            asset = self._assets[name] = _asset(path)
        headers = {"Cache-Control": ASSET_CACHE, "Vary": "Accept-Encoding", **SECURITY_HEADERS}
        body = asset.raw
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            body = asset.gzipped
            headers["Content-Encoding"] = "gzip"
        response = web.Response(body=body, headers=headers)
        response.content_type = asset.content_type
        return response


def add_page_routes(app: web.Application, static: Path = STATIC) -> None:
    """The page's routes on ``app`` (beside the API's, in any order: none overlaps them)."""
    page = Page(static)
    app.router.add_get("/assets/{name}", page.asset)
    for route in PAGE_ROUTES:
        app.router.add_get(route, page.index)

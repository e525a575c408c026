"""Files shared in a session's thread, fetched from Slack for the agent's sandbox.

A file is downloaded with the bot token from its private URL, within ``MAX_FILE_BYTES``, and
handed to the turn, which writes it into the sandbox under ``FOLDER`` so it rewinds and forks
with the session like everything else there. Slack answers a download the token may not make
(no ``files:read``) with its HTML sign-in page and a 200: that page is recognised and refused,
never put into the sandbox as if it were the file.

The bot token goes only to Slack's file hosts (``SLACK_FILE_HOSTS``, over HTTPS) and to the host
of ``SLACK_API_URL`` (a stand-in, a proxy the operator set up): a file object is part of an
event's payload, and one whose URL names any other host is refused without a request, so
neither the token nor a request on the app's behalf goes where the payload says. (A redirect
to another origin loses the token too: httpx drops ``Authorization`` across origins.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from bot import payload
from core.errors import InvalidRequest

# The shell starts in /home/user; files land beside what the agent makes there.
FOLDER = "/home/user/files"
_UNSAFE = re.compile(r"[^A-Za-z0-9._ -]+")
TIMEOUT = httpx.Timeout(30.0, connect=10.0)
# Where Slack serves ``url_private`` / ``url_private_download`` (commercial and GovSlack).
SLACK_FILE_HOSTS = frozenset({"files.slack.com", "files.slack-gov.com"})


@dataclass(frozen=True)
class SharedFile:
    """What a message event says of a file (kept in the delivery record, so a take-over can
    fetch it again)."""

    name: str
    url: str
    size: int | None
    mimetype: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "size": self.size, "mimetype": self.mimetype}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SharedFile:
        return cls(str(data["name"]), str(data["url"]), data.get("size"), data.get("mimetype"))


def shared_files(event: dict[str, Any]) -> list[SharedFile]:
    """The files a message event carries (a ``file_share``); malformed entries are refused."""
    raw = event.get("files")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequest("event.files is not a list")
    found = []
    for i, item in enumerate(raw):
        item = payload.obj(item, f"event.files[{i}]")
        url = payload.string(item.get("url_private_download") or item.get("url_private"), "url")
        name = payload.string(item.get("name"), f"event.files[{i}].name") or "file"
        size = item.get("size")
        if url:
            found.append(
                SharedFile(
                    name,
                    url,
                    size if isinstance(size, int) else None,
                    payload.string(item.get("mimetype"), f"event.files[{i}].mimetype"),
                )
            )
    return found


def sandbox_path(name: str, taken: set[str]) -> str:
    """Where a file goes: ``FOLDER/<name>``, the name made safe (no directories, no dot-files)
    and made unique among this message's files."""
    base = _UNSAFE.sub("_", name.replace("/", "_")).strip(" .") or "file"
    path, n = f"{FOLDER}/{base}", 1
    while path in taken:
        stem, dot, ext = base.rpartition(".")
        path = f"{FOLDER}/{stem}-{n}.{ext}" if dot and stem else f"{FOLDER}/{base}-{n}"
        n += 1
    taken.add(path)
    return path


@dataclass(frozen=True)
class Fetched:
    file: SharedFile
    data: bytes | None
    refused: str | None  # why it was not fetched (told to the poster)


def slack_hosted(url: str, api_url: str) -> bool:
    """Whether ``url`` is on Slack's file hosts or on the host ``SLACK_API_URL`` names."""
    try:
        target, api = httpx.URL(url), httpx.URL(api_url)
    except httpx.InvalidURL:
        return False
    if target.scheme == "https" and target.host in SLACK_FILE_HOSTS and target.port is None:
        return True
    return bool(target.host) and (target.scheme, target.host, target.port) == (
        api.scheme,
        api.host,
        api.port,
    )


async def fetch(file: SharedFile, token: str | None, max_bytes: int, api_url: str) -> Fetched:
    if not slack_hosted(file.url, api_url):
        return Fetched(file, None, "not_slack")
    if file.size is not None and file.size > max_bytes:
        return Fetched(file, None, "too_big")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            httpx.AsyncClient(timeout=TIMEOUT, follow_redirects=True) as http,
            http.stream("GET", file.url, headers=headers) as response,
        ):
            if response.status_code != 200:
                return Fetched(file, None, "unavailable")
            if response.headers.get("content-type", "").startswith("text/html"):
                return Fetched(file, None, "no_access")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    return Fetched(file, None, "too_big")
    except httpx.HTTPError:
        return Fetched(file, None, "unavailable")
    return Fetched(file, bytes(data), None)

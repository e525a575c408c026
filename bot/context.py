"""What the agent is told beside a person's message: the thread before it was mentioned, the
files shared with the message, what the person is looking at in Slack.

It travels in the user message's ``metadata.context`` (the model reads it just before the
message; drafts, titles and rewinds keep the person's own words), so it is stored with the
transcript, rewinds and forks with it, and a turn resumed elsewhere sees the same.
Model-facing wording lives here; words a person reads live in ``bot.texts``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from bot.files import Fetched, SharedFile, fetch, sandbox_path, shared_files
from core.errors import InvalidRequest

log = logging.getLogger(__name__)

THREAD_MESSAGES = 50  # the latest messages of a thread before the agent joins it are read
THREAD_CHARS = 20_000  # and at most this much of their text
THREAD_FILES = 10  # and the files shared in them, the most recent ones
# Slack returns a thread oldest first, a page at a time: the pages up to the mention are read
# to reach the messages just before it (a thread longer than PAGES x PAGE_SIZE replies before
# the mention is read up to there).
PAGE_SIZE = 200
PAGES = 25
_HUMAN = (None, "thread_broadcast", "file_share")


@dataclass
class Gathered:
    """A message's context and the files its turn puts into the sandbox."""

    notes: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    refused: list[Fetched] = field(default_factory=list)

    @property
    def context(self) -> str | None:
        return "\n\n".join(self.notes) or None


@dataclass
class Earlier:
    """What a thread said before the agent was mentioned in it."""

    text: str | None = None
    files: list[SharedFile] = field(default_factory=list)


async def thread_before(
    client: AsyncWebClient, channel: str, thread_ts: str, before_ts: str
) -> Earlier:
    """The people's messages of a thread before ``before_ts`` (the agent's first mention in
    it), the latest ``THREAD_MESSAGES`` of them, newest last, within ``THREAD_CHARS``, and the
    files shared in them; nothing when there are none or Slack says no."""
    latest: deque[dict[str, Any]] = deque(maxlen=THREAD_MESSAGES)
    try:
        async for message in _people(client, channel, thread_ts, latest=before_ts, inclusive=False):
            if message["ts"] < before_ts:
                latest.append(message)
    except SlackApiError as exc:  # what was read before stays
        log.warning("could not read the thread %s/%s: %s", channel, thread_ts, exc)
    lines: list[str] = []
    files: list[SharedFile] = []
    for message in latest:
        text = message.get("text")
        if isinstance(text, str) and text.strip():
            lines.append(f"<@{message['user']}>: {text.strip()}")
        with contextlib.suppress(InvalidRequest):
            files.extend(shared_files(message))
    kept: list[str] = []
    size = 0
    for line in reversed(lines):  # the most recent ones matter most
        size += len(line) + 1
        if size > THREAD_CHARS:
            break
        kept.append(line)
    said = None
    if kept:
        said = "Before you were mentioned, this Slack thread said (oldest first):\n" + "\n".join(
            reversed(kept)
        )
    return Earlier(said, files[-THREAD_FILES:])


async def thread_span(
    client: AsyncWebClient, channel: str, thread_ts: str, oldest: str, latest: str
) -> dict[str, dict[str, Any]] | None:
    """People's messages of a thread from ``oldest`` to ``latest`` (both included), by ts:
    the words of strays being adopted (``ThreadAnswers.words``). Bounded by both ends, so a
    long thread costs no more than the few recent messages asked for (strays are at most
    minutes old: the thread's newest end). None when Slack says no."""
    found: dict[str, dict[str, Any]] = {}
    try:
        async for message in _people(
            client, channel, thread_ts, oldest=oldest, latest=latest, inclusive=True
        ):
            found[message["ts"]] = message
    except SlackApiError as exc:
        log.warning("could not read the thread %s/%s: %s", channel, thread_ts, exc)
        return None
    return found


async def _people(
    client: AsyncWebClient, channel: str, thread_ts: str, **bounds: Any
) -> AsyncIterator[dict[str, Any]]:
    """A thread's messages by people (a ``ts`` and a ``user``; no bot's) within ``bounds``,
    as ``thread_messages`` reads them."""
    async for message in thread_messages(client, channel, thread_ts, **bounds):
        if message.get("bot_id"):
            continue
        ts, user = message.get("ts"), message.get("user")
        if message.get("subtype") in _HUMAN and isinstance(ts, str) and isinstance(user, str):
            yield message


async def thread_messages(
    client: AsyncWebClient, channel: str, thread_ts: str, **bounds: Any
) -> AsyncIterator[dict[str, Any]]:
    """A thread's messages within ``bounds`` (``oldest``, ``latest``, ``inclusive``), oldest
    first, as Slack pages them (at most ``PAGES`` pages). Slack refusing a page raises
    ``SlackApiError``."""
    cursor: str | None = None
    for _ in range(PAGES):
        response = await client.conversations_replies(
            channel=channel, ts=thread_ts, limit=PAGE_SIZE, cursor=cursor, **bounds
        )
        for message in response.get("messages") or []:
            if isinstance(message, dict):
                yield message
        metadata = response.get("response_metadata") or {}
        cursor = metadata.get("next_cursor") if isinstance(metadata, dict) else None
        if not response.get("has_more") or not cursor:
            return


def viewing(context: dict[str, Any] | None) -> str | None:
    """Slack's ``app_context_changed`` context as a sentence for the agent."""
    channels = [
        e.get("value")
        for e in (context or {}).get("entities") or []
        if isinstance(e, dict) and e.get("type") == "slack#/types/channel_id"
    ]
    if not channels or not isinstance(channels[0], str):
        return None
    return f"The person is looking at the Slack channel <#{channels[0]}> right now."


async def fetch_files(
    files: list[SharedFile], token: str | None, max_bytes: int, api_url: str, gathered: Gathered
) -> None:
    """Download the message's files for the sandbox; note where they are for the agent."""
    taken: set[str] = set()
    placed: list[str] = []
    for file in files:
        fetched = await fetch(file, token, max_bytes, api_url)
        if fetched.data is None:
            gathered.refused.append(fetched)
            continue
        path = sandbox_path(file.name, taken)
        gathered.files[path] = fetched.data
        placed.append(f"{path} ({len(fetched.data):,} bytes{_kind(file)})")
    if placed:
        gathered.notes.append(
            "Files shared with this message were copied into your sandbox: " + ", ".join(placed)
        )


def _kind(file: SharedFile) -> str:
    return f", {file.mimetype}" if file.mimetype else ""

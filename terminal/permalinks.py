"""Slack permalinks and the sessions they name, for the terminal (``slack-agent chat LINK``).

A permalink is ``https://<workspace>.slack.com/archives/<channel>/p<ts without its dot>``,
with ``?thread_ts=<root ts>`` when the message is a reply in a thread. It names a channel and a
message but not the workspace, so the lookup matches the end of the Slack surface's keys
(``{team}/{channel}/{ts}``): Slack channel ids are unique across workspaces.

A link finds its session by the thread it belongs to, or, when the thread is not one the app
took part in as such (a fork's head, an answer posted elsewhere), by the message itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from core.conversation import Conversations
from core.conversation.places import SlackThread
from core.errors import AgentSessionNotFound, UsageError

_PATH = re.compile(r"/archives/(?P<channel>[A-Z0-9]+)/p(?P<secs>\d{10})(?P<micros>\d{6})/?$")
_TS = re.compile(r"\d{10}\.\d{6}")


@dataclass(frozen=True)
class Permalink:
    channel: str
    ts: str  # the linked message
    thread_ts: str  # the thread's root (the message itself when it is a root)


def looks_like_link(value: str) -> bool:
    return "://" in value or "/archives/" in value or value.startswith("slack.com")


def parse_permalink(value: str) -> Permalink:
    """The channel and message a Slack permalink names; ``UsageError`` when it names none."""
    parts = urlsplit(value.strip() if "://" in value else f"https://{value.strip()}")
    host = (parts.hostname or "").lower()
    match = _PATH.search(parts.path)
    if not (host == "slack.com" or host.endswith(".slack.com")) or match is None:
        raise UsageError(
            f"not a Slack message link: {value!r} (expected "
            "https://<workspace>.slack.com/archives/<channel>/p<digits>)"
        )
    ts = f"{match['secs']}.{match['micros']}"
    thread = parse_qs(parts.query).get("thread_ts", [ts])[0]
    if not _TS.fullmatch(thread):
        raise UsageError(f"not a Slack message link: {value!r} (its thread_ts is malformed)")
    return Permalink(match["channel"], ts, thread)


async def session_for_permalink(slack: Conversations, value: str) -> int:
    """The id of the session whose thread holds the linked message."""
    link = parse_permalink(value)
    found = await slack.find_by_key_suffix(
        SlackThread.suffix(link.channel, link.thread_ts),
        ref_suffix=SlackThread.suffix(link.channel, link.ts),
    )
    if found is None:
        raise AgentSessionNotFound(f"no session has the Slack message {value.strip()}")
    return found


async def permalink_of_session(slack: Conversations, session_id: int) -> str | None:
    """The permalink of the session's Slack thread, when it has one."""
    key = await slack.key_of(session_id)
    thread = None if key is None else SlackThread.parse(key)
    return None if thread is None else thread.permalink

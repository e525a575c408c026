"""Where a Slack message was posted and by whom, and the keys the Slack surface names things by.

Keys (written down in ``core.conversation.places``): a thread is ``{team}/{channel}/{thread_ts}``
(its session's ``project_session_id``), a Slack message ``{team}/{channel}/{ts}``; a user
message's id is ``slack_message_id(team, channel, ts)``, so a retried delivery can never be
stored twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.conversation.places import SLACK_PROJECT, SLACK_SURFACE, SlackThread, slack_person

SURFACE = SLACK_SURFACE  # the surface's tables (threads, message references, delivery records)
PROJECT = SLACK_PROJECT  # the sessions' ``project_name``


def thread_key(team: str, channel: str, thread_ts: str) -> str:
    return SlackThread(team, channel, thread_ts).key


def external_user(team: str, user: str) -> str:
    return slack_person(team, user)


@dataclass(frozen=True)
class Post:
    """Where a message was posted and by whom: what every reply needs."""

    team: str
    channel: str
    thread_ts: str
    ts: str
    user: str
    surface: str  # "dm", "channel" or "assistant" (TEMPORARY_SESSION_SURFACES)

    @property
    def thread(self) -> str:
        return thread_key(self.team, self.channel, self.thread_ts)

    @property
    def ref(self) -> str:
        return thread_key(self.team, self.channel, self.ts)

    def context(self) -> dict[str, Any]:
        return {
            "team": self.team,
            "channel": self.channel,
            "thread_ts": self.thread_ts,
            "ts": self.ts,
            "user": self.user,
            "surface": self.surface,
        }

    @classmethod
    def of_thread(cls, key: str, user: str, ts: str | None = None) -> Post | None:
        """Where a conversation's thread is, from its key; None when the key names none."""
        thread = SlackThread.parse(key)
        if thread is None:
            return None
        return cls(thread.team, thread.channel, thread.ts, ts or thread.ts, user, thread.surface)

    @classmethod
    def from_context(cls, data: dict[str, Any]) -> Post:
        return cls(
            **{k: str(data[k]) for k in ("team", "channel", "thread_ts", "ts", "user", "surface")}
        )

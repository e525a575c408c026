"""Where a session lives, and who may see it: what a surface that lists every surface's
sessions (the HTTP API) needs to know of the others.

A session belongs to the surface that made it, named by its project: a Slack thread
(``slack``, keyed ``team/channel/thread_ts``), a terminal session (``cli``), a web session
(``web``). ``place`` reads that back as data. ``Viewer`` is a person as a listing sees them:
their own sessions, the Slack threads of the channels they belong to (the surface asks Slack
which those are and passes them in), everything for an admin. Someone who may not see a
session is told it does not exist (``may_see``): ids are not to be probed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.records import Actor, SessionInfo

SLACK_PROJECT = "slack"
TERMINAL_PROJECT = "cli"
WEB_PROJECT = "web"

PlaceKind = Literal["slack", "web", "terminal"]


@dataclass(frozen=True)
class Place:
    """Where a session is: ``kind``; for a Slack thread its workspace, channel and root
    message (``surface``: ``dm`` or ``channel``)."""

    kind: PlaceKind
    surface: str | None = None
    team: str | None = None
    channel: str | None = None
    thread_ts: str | None = None

    @property
    def url(self) -> str | None:
        """A link that opens the thread in Slack (the workspace's own domain is not known
        here; Slack's ``app_redirect`` finds it)."""
        if self.channel is None or self.thread_ts is None:
            return None
        return (
            f"https://slack.com/app_redirect?team={self.team}&channel={self.channel}"
            f"&message_ts={self.thread_ts}"
        )


def place(session: SessionInfo) -> Place:
    if session.project_name == SLACK_PROJECT:
        parts = session.project_session_id.split("/")
        if len(parts) == 3 and all(parts):
            team, channel, thread_ts = parts
            surface = "dm" if channel.startswith("D") else "channel"
            return Place("slack", surface, team, channel, thread_ts)
        return Place("slack")
    if session.project_name == TERMINAL_PROJECT:
        return Place("terminal")
    return Place("web")


@dataclass(frozen=True)
class Viewer:
    """A person looking at sessions: ``team`` is their Slack workspace (None for a person who
    is not a Slack user) and ``channels`` the channels there they belong to."""

    actor: Actor
    person: str
    team: str | None = None
    channels: frozenset[str] = field(default_factory=frozenset)

    @property
    def admin(self) -> bool:
        return self.actor.admin

    @property
    def shared(self) -> list[tuple[str, str]]:
        """The ``(project, key prefix)`` of the Slack threads they see through a channel."""
        if self.team is None:
            return []
        return [(SLACK_PROJECT, f"{self.team}/{channel}/") for channel in sorted(self.channels)]


def may_see(session: SessionInfo, viewer: Viewer) -> bool:
    """Whether ``viewer`` sees ``session``: theirs, a Slack thread in one of their channels,
    or any for an admin (terminal sessions included)."""
    if viewer.admin:
        return True
    if session.user_id is not None and session.user_id == viewer.actor.user_id:
        return True
    where = place(session)
    return (
        where.kind == "slack"
        and where.team == viewer.team
        and where.channel is not None
        and where.channel in viewer.channels
    )


__all__ = [
    "SLACK_PROJECT",
    "TERMINAL_PROJECT",
    "WEB_PROJECT",
    "Place",
    "PlaceKind",
    "Viewer",
    "may_see",
    "place",
]

"""Where a session lives, read off its key: the one place the key formats are written down.

A session is named by its project and a key unique within it (``project_session_id``). Three
projects exist: ``slack`` (a Slack thread: ``{team}/{channel}/{thread_ts}``), ``cli`` (the
terminal: ``{login}/{uuid}``) and ``web`` (the HTTP API: ``{person}/{uuid}``). Every surface that
meets another's session must read its key: the terminal finds a Slack thread's session from a
permalink, the HTTP API shows each session's place with a link to its thread, the approval
rounds find the thread a card is in. Written once here, not parsed where it is needed; the core
knows the shape of these names, never how to talk to Slack.

A person is ``slack:{team}:{user}`` when Slack knows them (Sign in with Slack names the same
person), ``operator:{login}`` for the terminal's operator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

SLACK_PROJECT: Final = "slack"
TERMINAL_PROJECT: Final = "cli"
WEB_PROJECT: Final = "web"
SLACK_SURFACE: Final = "slack"  # the Slack surface's tables (threads, references, deliveries)

PlaceKind = Literal["slack", "terminal", "web", "other"]
_KINDS: Final[dict[str, PlaceKind]] = {
    SLACK_PROJECT: "slack",
    TERMINAL_PROJECT: "terminal",
    WEB_PROJECT: "web",
}


def slack_person(team: str, user: str) -> str:
    """A Slack user's external id: one person whichever surface they come through."""
    return f"slack:{team}:{user}"


def slack_ids(person: str) -> tuple[str, str] | None:
    """The workspace and user of ``slack:T…:U…``; None for anyone else (an operator)."""
    parts = person.split(":")
    if len(parts) == 3 and parts[0] == "slack" and parts[1] and parts[2]:
        return parts[1], parts[2]
    return None


def team_of_person(person: str) -> str | None:
    """The Slack workspace of a person; None for anyone else (an operator)."""
    ids = slack_ids(person)
    return None if ids is None else ids[0]


def slack_user_in(person: str, team: str) -> str | None:
    """The Slack user id of ``person`` in workspace ``team``; None for anyone else."""
    prefix = slack_person(team, "")
    return person.removeprefix(prefix) if person.startswith(prefix) else None


@dataclass(frozen=True)
class SlackThread:
    """A Slack message's address (a thread's root, or any message in it: a card, a reply)."""

    team: str
    channel: str
    ts: str

    @property
    def key(self) -> str:
        return f"{self.team}/{self.channel}/{self.ts}"

    @property
    def surface(self) -> str:
        """Where in Slack: a direct message (``D…`` channels) or a channel."""
        return "dm" if self.channel.startswith("D") else "channel"

    @property
    def permalink(self) -> str:
        """A link to the message; slack.com redirects it to the workspace's own host."""
        return f"https://slack.com/archives/{self.channel}/p{self.ts.replace('.', '')}"

    @classmethod
    def parse(cls, key: str) -> SlackThread | None:
        """The address a key names; None when it is not one (a tampered or foreign key)."""
        parts = key.split("/")
        if len(parts) != 3 or not all(parts):
            return None
        return cls(*parts)

    @staticmethod
    def in_workspace(team: str) -> str:
        """The start of every key of a workspace's messages."""
        return f"{team}/"

    @staticmethod
    def suffix(channel: str, ts: str) -> str:
        """The end of the keys of a channel's message in any workspace (a permalink names no
        workspace; Slack channel ids are unique across workspaces)."""
        return f"/{channel}/{ts}"


@dataclass(frozen=True)
class Place:
    """A session's place as a person would name it: a Slack thread (with its link), a web
    session, a terminal session."""

    kind: PlaceKind
    surface: str | None = None  # Slack: "dm" or "channel"
    url: str | None = None
    thread: SlackThread | None = None


def workspace_keys(team: str) -> list[tuple[str, str]]:
    """The ``(project, key prefix)`` of every session that belongs to Slack workspace ``team``:
    its threads, and the web sessions of its people (``{person}/{uuid}``)."""
    return [(SLACK_PROJECT, SlackThread.in_workspace(team)), (WEB_PROJECT, slack_person(team, ""))]


def workspace_of(project: str, key: str) -> str | None:
    """The Slack workspace a session belongs to: None for one that belongs to none (the
    terminal's, the operator's), ``""`` for a key that names none it should (never a team)."""
    if project == SLACK_PROJECT:
        thread = SlackThread.parse(key)
        return "" if thread is None else thread.team
    if project == WEB_PROJECT:  # ``{person}/{uuid}``
        return team_of_person(key.split("/", 1)[0]) or ""
    return None


def place_of(project: str, key: str) -> Place:
    kind = _KINDS.get(project)
    if kind == "slack":
        thread = SlackThread.parse(key)
        if thread is not None:
            return Place("slack", thread.surface, thread.permalink, thread)
    return Place(kind or "other")

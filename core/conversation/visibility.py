"""Who may see a session: what a surface that lists every surface's sessions (the HTTP API)
asks.

A person sees the sessions they own, those of Slack threads in channels they belong to (the
surface asks Slack which those are and passes them in: the core never talks to Slack), and an
admin (``ADMIN_USER_IDS`` names an admin *of a workspace*) sees every session of their
workspace (its threads, its people's web sessions) and the terminal's, never another
workspace's. Someone who may not see a session is told it
does not exist (``may_see`` false: a 404), so ids cannot be probed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.conversation.places import SLACK_PROJECT, Place, place_of, workspace_keys, workspace_of
from core.records import Actor, SessionInfo


def place(session: SessionInfo) -> Place:
    """Where ``session`` lives (``places.place_of`` its project and key)."""
    return place_of(session.project_name, session.project_session_id)


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
    def workspace(self) -> list[tuple[str, str]]:
        """The ``(project, key prefix)`` of their workspace's sessions (an admin's ``all``)."""
        return [] if self.team is None else workspace_keys(self.team)

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
        workspace = workspace_of(session.project_name, session.project_session_id)
        if workspace is None or workspace == viewer.team:
            return True
    if session.user_id is not None and session.user_id == viewer.actor.user_id:
        return True
    thread = place(session).thread
    return (
        thread is not None
        and viewer.team is not None
        and thread.team == viewer.team
        and thread.channel in viewer.channels
    )


__all__ = ["Viewer", "may_see", "place"]

"""Who is asking: a program's bearer token or a browser's sign-in cookie, and what they see.

A token (``Authorization: Bearer sat_…``) and a sign-in cookie (``slack_agent_session``) each
act as one person; only their hashes are stored (``WebAccess``). A cookie request that changes
anything must carry ``X-CSRF-Token``, derived from the sign-in's secret (so it needs no state
of its own): another site can make a browser send the cookie, never read the token.

What a person sees beside their own sessions depends on the Slack channels they belong to;
Slack is asked through ``Channels``, which the composition provides (``bot`` knows Slack,
``web`` does not), and the answer is kept for ``CHANNELS_TTL_SECONDS``.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from core.conversation import Actor, Payer

COOKIE = "slack_agent_session"
CSRF_HEADER = "X-CSRF-Token"
CHANGES = frozenset({"POST", "PATCH", "PUT", "DELETE"})
CHANNELS_TTL_SECONDS = 60.0
CHANNELS_CACHED = 10_000  # people whose channels are kept at once (a bound, not a tuning)


@dataclass(frozen=True)
class Caller:
    """A person the request acts as. ``team``/``user``: their Slack ids (``slack:T…:U…``);
    ``cookie``: the sign-in's secret when a browser asks (None for a token)."""

    user_id: int
    person: str
    name: str | None
    admin: bool
    team: str | None
    user: str | None
    cookie: str | None = None

    @property
    def csrf_token(self) -> str | None:
        return None if self.cookie is None else csrf_token(self.cookie)

    @property
    def payer(self) -> Payer:
        """Who pays for what they start: the person, in their workspace (its budgets too)."""
        return Payer(self.person, self.team)

    @property
    def actor(self) -> Actor:
        return Actor(self.user_id, admin=self.admin)

    @property
    def approver_id(self) -> str | None:
        """How an MCP server's ``approvers`` name this person (``T…:U…``)."""
        return None if self.team is None else f"{self.team}:{self.user}"


def csrf_token(secret: str) -> str:
    return hmac.new(secret.encode(), b"slack-agent csrf", hashlib.sha256).hexdigest()


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def csrf_ok(method: str, headers: Mapping[str, str], caller: Caller) -> bool:
    """A cookie request that changes something carries the sign-in's CSRF token."""
    if caller.cookie is None or method not in CHANGES:
        return True
    expected = caller.csrf_token or ""
    return hmac.compare_digest(headers.get(CSRF_HEADER, ""), expected)


class Channels(Protocol):
    """The Slack channels a person belongs to, asked of Slack (``bot`` implements it)."""

    async def of(self, team: str, user: str) -> frozenset[str]: ...


class NoChannels:
    """No Slack to ask (tests of the API alone, a deployment without a bot token)."""

    async def of(self, team: str, user: str) -> frozenset[str]:
        return frozenset()


class CachedChannels:
    """``Channels`` asked at most once per ``ttl`` per person; a failure is not kept."""

    def __init__(self, channels: Channels, ttl: float = CHANNELS_TTL_SECONDS) -> None:
        self._channels = channels
        self._ttl = ttl
        self._kept: dict[tuple[str, str], tuple[float, frozenset[str]]] = {}

    async def of(self, team: str, user: str) -> frozenset[str]:
        now = time.monotonic()
        kept = self._kept.get((team, user))
        if kept is not None and now - kept[0] < self._ttl:
            return kept[1]
        found = await self._channels.of(team, user)
        if len(self._kept) >= CHANNELS_CACHED:
            self._kept = {k: v for k, v in self._kept.items() if now - v[0] < self._ttl}
            if len(self._kept) >= CHANNELS_CACHED:
                self._kept.clear()
        self._kept[(team, user)] = (now, found)
        return found

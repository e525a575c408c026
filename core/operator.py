"""What the operator's command line does, as plain async functions over the core.

The command line (``slack_agent.cli``) only parses arguments and prints; everything that touches
the database is here, on the same storage every other entry point builds (``core.storage``).
"""

from __future__ import annotations

import getpass
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import date
from typing import Any

from core.errors import ConfigError, UsageError
from core.records import Actor, SessionInfo, StoredMessage
from core.settings import Settings
from core.storage import Erased, Person, RetentionPolicy, Storage, SweepReport
from core.storage.tokens import TokenInfo
from core.storage.usage import GroupBy, UsageLine
from core.usage.budgets import Account, Budget

# A Slack person as the command line names them: TEAM:USER (T…:U… or W… in Enterprise Grid).
_SLACK_PERSON = re.compile(r"(?P<team>[TE][A-Z0-9]+):(?P<user>[UW][A-Z0-9]+)")


def operator_external_id() -> str:
    """The local operator: ``cli:<login name>``."""
    try:
        login = getpass.getuser()
    except (KeyError, OSError):
        login = "unknown"
    return f"cli:{login}"


@dataclass
class Operator:
    """The database credentials holder: may act on any session, and says so."""

    settings: Settings
    storage: Storage

    @classmethod
    def open(cls, settings: Settings) -> Operator:
        return cls(settings, Storage.open(settings))

    async def close(self) -> None:
        await self.storage.dispose()

    async def actor(self) -> Actor:
        sessions = self.storage.sessions
        user_id = await sessions.get_or_create_user(operator_external_id(), "local operator")
        return Actor(user_id, admin=True)

    async def migrate(self) -> tuple[str | None, str | None]:
        return await self.storage.migrate()

    async def retention(self) -> RetentionPolicy:
        return await self.storage.retention.policy()

    async def set_retention(
        self, *, max_idle_days: float | None, max_per_user: int | None
    ) -> RetentionPolicy:
        return await self.storage.retention.set(
            max_idle_days=max_idle_days, max_per_user=max_per_user
        )

    async def sweep_once(self) -> SweepReport:
        return await self.storage.sweep()

    async def list_sessions(self, *, limit: int) -> list[SessionInfo]:
        return await self.storage.sessions.list_sessions(limit=limit)

    async def show_session(
        self, session_id: int
    ) -> tuple[SessionInfo, list[StoredMessage], dict[str, dict[str, int]]]:
        """The session, its transcript, and the votes on its answers."""
        sessions = self.storage.sessions
        session = await sessions.get_session(session_id)
        messages = await sessions.messages(session_id)
        return session, messages, await self.storage.feedback.of_session(session_id)

    async def usage(self, by: GroupBy, *, since: date | None = None) -> list[UsageLine]:
        return await self.storage.usage.report(by, since=since)

    async def budgets(self) -> list[tuple[Budget, str, Account | None]]:
        """Each budget in force, where it comes from, and (for the shared budget, the one
        account that needs no person named) what its window has used so far."""
        shown: list[tuple[Budget, str, Account | None]] = []
        for budget, source in await self.storage.budgets.sources():
            account = None
            if budget.scope == "all":
                (account,) = await self.storage.usage.accounts([budget], None)
            shown.append((budget, source, account))
        return shown

    async def set_budgets(self, value: str) -> tuple[Budget, ...]:
        try:
            return await self.storage.budgets.set(value)
        except ConfigError as exc:  # nothing was stored: say why, in the command's words
            raise UsageError(f"budget set: {str(exc).removeprefix('BUDGETS: ')}") from None

    async def clear_budgets(self, value: str | None) -> tuple[Budget, ...]:
        try:
            return await self.storage.budgets.clear(value)
        except ConfigError as exc:
            raise UsageError(f"budget clear: {exc}") from None

    async def delete_session(self, session_id: int) -> SessionInfo:
        session = await self.storage.sessions.get_session(session_id)
        await self.storage.sessions.delete_session(session_id, await self.actor())
        return session

    async def create_token(
        self, person: str, *, name: str | None, expires_days: float | None
    ) -> tuple[int, str]:
        """A token acting as the Slack person ``TEAM:USER``: its id and secret (shown once)."""
        found = _SLACK_PERSON.fullmatch(person)
        if found is None:
            raise UsageError(f"token create: --user takes TEAM:USER (T123:U456), not {person!r}")
        if expires_days is not None and not 0 < expires_days <= 3650:
            raise UsageError("token create: --expires takes days, more than 0 and at most 3650")
        if name is not None and not 0 < len(name) <= 100:
            raise UsageError("token create: --name takes 1 to 100 characters")
        external = f"slack:{found['team']}:{found['user']}"
        user_id = await self.storage.sessions.get_or_create_user(external)
        return await self.storage.web_access.create_token(
            user_id, name=name, expires_days=expires_days
        )

    async def tokens(self) -> list[TokenInfo]:
        return await self.storage.web_access.tokens()

    async def revoke_token(self, token_id: int) -> None:
        if not await self.storage.web_access.revoke_token(token_id):
            raise UsageError(f"token revoke: no token {token_id} (or it is revoked already)")

    def export_person(self, person: str) -> AsyncIterator[dict[str, Any]]:
        """Everything kept about the Slack person ``TEAM:USER``, one record at a time."""
        return self.storage.people.export(Person.parse(person, "user export"))

    async def erase_person(self, person: str) -> Erased:
        """Remove the Slack person ``TEAM:USER``'s data (``core.storage.people`` says what);
        refused while a turn of theirs runs."""
        return await self.storage.people.erase(Person.parse(person, "user erase"))

"""What the operator's command line does, as plain async functions over the core.

The command line (``slack_agent.cli``) only parses arguments and prints; everything that touches the
database is here so the terminal client and tests call the same code.
"""

from __future__ import annotations

import getpass
from dataclasses import dataclass

from core.records import Actor, SessionInfo, StoredMessage
from core.settings import Settings
from core.storage.engine import Database, create_database
from core.storage.feedback import votes
from core.storage.migrate import upgrade
from core.storage.retention import RetentionPolicy, load_policy, set_policy
from core.storage.sessions import SessionStore
from core.storage.surface_state import SURFACE_SWEEPS
from core.storage.sweeper import SweepReport, sweep


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
    db: Database
    store: SessionStore

    @classmethod
    def open(cls, settings: Settings) -> Operator:
        db = create_database(
            settings.database_url, synchronous_commit=settings.postgres_synchronous_commit
        )
        store = SessionStore(
            db,
            staleness_seconds=settings.turn_lock_staleness_seconds,
            temporary_ttl_hours=settings.temporary_agent_session_time_to_live_hours,
        )
        return cls(settings, db, store)

    async def close(self) -> None:
        await self.db.dispose()

    async def actor(self) -> Actor:
        user_id = await self.store.get_or_create_user(operator_external_id(), "local operator")
        return Actor(user_id, admin=True)

    async def migrate(self) -> tuple[str | None, str | None]:
        return await upgrade(self.db)

    def _defaults(self) -> RetentionPolicy:
        return RetentionPolicy.from_settings(self.settings)

    async def retention(self) -> RetentionPolicy:
        return await load_policy(self.db, self._defaults())

    async def set_retention(
        self, *, max_idle_days: float | None, max_per_user: int | None
    ) -> RetentionPolicy:
        return await set_policy(
            self.db, self._defaults(), max_idle_days=max_idle_days, max_per_user=max_per_user
        )

    async def sweep_once(self) -> SweepReport:
        return await sweep(
            self.db,
            await self.retention(),
            staleness_seconds=self.settings.turn_lock_staleness_seconds,
            batch_size=self.settings.sweeper_batch_size,
            extra_passes=SURFACE_SWEEPS,
        )

    async def list_sessions(self, *, limit: int) -> list[SessionInfo]:
        return await self.store.list_sessions(limit=limit)

    async def show_session(
        self, session_id: int
    ) -> tuple[SessionInfo, list[StoredMessage], dict[str, dict[str, int]]]:
        """The session, its transcript, and the votes on its answers."""
        session = await self.store.get_session(session_id)
        return session, await self.store.messages(session_id), await votes(self.db, session_id)

    async def delete_session(self, session_id: int) -> SessionInfo:
        session = await self.store.get_session(session_id)
        await self.store.delete_session(session_id, await self.actor())
        return session

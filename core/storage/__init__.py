"""The storage layer: every SQL statement of the product, behind a few objects.

Nothing above this package sees an engine, a connection or a statement. A process builds one
``Storage`` from its settings (``core.runtime``) and hands its stores to the parts that need
them: the agent gets the session store and the snapshots, model choice the custom providers, a
surface its surface state and delivery records. Inside, ``engine`` opens transactions and is the
only module that makes engines, ``dialect`` holds what differs between SQLite and PostgreSQL,
``models`` the tables, ``queries`` the turn protocol's shared predicates and statements, and one
module per concern holds that concern's statements (``sessions``, ``transcript``,
``snapshots``, ``deliveries``, ``approvals``, ``surface_state``, ``feedback``, ``retention``,
``custom_providers``, ``sweeper``, ``migrate``, ``usage`` (the ledger of model requests and
budget reservations), ``budgets`` (the limits set at run time), ``people`` (one person's
data, exported or erased)).
"""

from __future__ import annotations

from typing import Any

from core.errors import DatabaseNotReady
from core.settings import Settings
from core.storage.approvals import ApprovalRecord, Approvals
from core.storage.budgets import Budgets
from core.storage.custom_providers import CustomProviders
from core.storage.deliveries import Deliveries
from core.storage.engine import Database, DatabaseTimeouts, create_database, library_engine
from core.storage.feedback import Feedback
from core.storage.migrate import (
    create_library_tables,
    known_revisions,
    this_builds_head,
    upgrade,
)
from core.storage.people import Erased, People, Person
from core.storage.retention import Retention, RetentionPolicy
from core.storage.sessions import SessionStore
from core.storage.snapshots import Snapshots
from core.storage.surface_state import SURFACE_SWEEPS, SurfaceState
from core.storage.sweeper import SweepReport, sweep
from core.storage.tokens import WebAccess, sweep_sign_ins
from core.storage.usage import UsageLedger, sweep_totals


class Storage:
    """One database and the stores on it, built from settings in one place."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self._db = db
        self._settings = settings
        self.sessions = SessionStore(
            db,
            staleness_seconds=settings.turn_lock_staleness_seconds,
            temporary_ttl_hours=settings.temporary_agent_session_time_to_live_hours,
        )
        self.snapshots = self.sessions.snapshots
        self.feedback = Feedback(db)
        self.custom_providers = self.sessions.custom_providers
        self.retention = Retention(db, RetentionPolicy.from_settings(settings))
        self.usage = UsageLedger(db, staleness_seconds=settings.turn_lock_staleness_seconds)
        self.budgets = Budgets(db, settings.budgets)
        self.approvals = Approvals(db, timeout_seconds=settings.approval_timeout_seconds)
        self.web_access = WebAccess(db)
        self.people = People(db, staleness_seconds=settings.turn_lock_staleness_seconds)

    @classmethod
    def open(cls, settings: Settings, *, pool_size: int = 10) -> Storage:
        """The database ``DATABASE_URL`` names (nothing is connected until first used), every
        call bounded by the timeouts the settings choose from the staleness window. Nothing is
        said here about timeouts that do not fit the window: every command opens storage, and a
        one-line refusal must stay one line (``serve`` says it once, ``bot.serve``)."""
        db = create_database(
            settings.database_url,
            pool_size=pool_size,
            synchronous_commit=settings.postgres_synchronous_commit,
            timeouts=timeouts_of(settings),
        )
        return cls(db, settings)

    @property
    def dialect(self) -> str:
        return self._db.dialect

    def surface(self, name: str) -> SurfaceState:
        """What the surface ``name`` keeps beside the sessions (threads, message refs, …)."""
        return SurfaceState(self._db, name)

    def deliveries(self, surface: str, *, owner: str | None = None) -> Deliveries:
        """This process's view of the surface's delivery records, as ``owner`` (a new one
        unless given)."""
        return Deliveries(
            self._db,
            surface,
            staleness_seconds=self._settings.turn_lock_staleness_seconds,
            owner=owner,
        )

    async def migrate(self) -> tuple[str | None, str | None]:
        """Bring the database to the newest schema (safe when replicas start at once)."""
        return await upgrade(self._db)

    def library_engine(self) -> Any:
        """An engine for a library that brings its own tables and statements (slack_sdk's
        stores), its calls bounded like ours. ``Any``: what is above this layer only hands it
        to that library."""
        return library_engine(self._settings.database_url, timeouts_of(self._settings))

    async def create_library_tables(self, *metadata: Any) -> None:
        """A library's tables (their ``MetaData``), created under the migration lock."""
        await create_library_tables(self._db, metadata)

    async def sweep(self) -> SweepReport:
        """One pass of every retention rule, under the policy in force now."""
        return await sweep(
            self._db,
            await self.retention.policy(),
            staleness_seconds=self._settings.turn_lock_staleness_seconds,
            batch_size=self._settings.sweeper_batch_size,
            extra_passes=(
                *SURFACE_SWEEPS,
                ("sign_ins", sweep_sign_ins),
                ("usage_totals", sweep_totals),
            ),
        )

    async def answers(self) -> bool:
        """Whether the database answers a read of a real table now (``/healthz``)."""
        return await self._db.answers()

    async def not_ready(self) -> str | None:
        """Why this process should take no traffic now as far as its database goes (``/readyz``),
        or None: the database did not answer within the health timeout, or its schema is
        behind the one this build needs (not migrated, or rolled back under it: its
        statements would name tables and columns that are not there).

        A revision this build does not know is a newer build's: the replicas of the old
        build stay ready while a rolling upgrade migrates ahead of them (a migration that
        broke the previous build would be a breaking release, said in the CHANGELOG)."""
        probe = await self._db.probe()
        if not probe.answered:
            return "database unavailable"
        if _behind(probe.revision):
            head = this_builds_head()
            return f"database schema at {probe.revision or 'nothing'}; this build needs {head}"
        return None

    async def require_ready(self) -> None:
        """``not_ready`` as an error that says what to do: an operator's command that only
        reads or sets values does not migrate, and on a database never migrated it failed on
        its first statement ("no such table: system_settings")."""
        probe = await self._db.probe()
        if probe.answered and _behind(probe.revision):
            raise DatabaseNotReady(
                f"database schema at {probe.revision or 'nothing'}; this build needs "
                f"{this_builds_head()}: run `slack-agent migrate` (`serve` migrates as it starts)"
            )
        # A database that did not answer: the command's own statement says why (refused,
        # no such database, a password), better than a probe's "unavailable" could.

    async def warm(self) -> None:
        """The connections a first message's acknowledgement needs, opened now
        (``Database.warm``): called before listening, on the loop that will use them."""
        await self._db.warm()

    async def dispose(self) -> None:
        await self._db.dispose()


def _behind(revision: str | None) -> bool:
    """The schema is older than this build's (or absent). A revision this build does not know
    is a newer build's: not behind (see ``Storage.not_ready``)."""
    return revision != this_builds_head() and (revision is None or revision in known_revisions())


def timeouts_of(settings: Settings) -> DatabaseTimeouts:
    connect, statement = settings.database_timeouts
    return DatabaseTimeouts(connect=connect, statement=statement)


__all__ = [
    "ApprovalRecord",
    "Approvals",
    "Budgets",
    "CustomProviders",
    "Deliveries",
    "Erased",
    "Feedback",
    "People",
    "Person",
    "Retention",
    "RetentionPolicy",
    "SessionStore",
    "Snapshots",
    "Storage",
    "SurfaceState",
    "SweepReport",
    "UsageLedger",
]

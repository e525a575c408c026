"""PostgreSQL: a write transaction that opens holding transaction-level advisory locks, its
BEGIN and the locks sent as one simple query (one round trip where SQLAlchemy's transaction
takes two: its BEGIN, then the locks' statement).

A budgeted claim runs in it (``SessionStore.start_turn``) when its one statement could not take
the locks itself (``reservations._claim_at_once``: a lock held elsewhere, a transaction ended
meanwhile, a refusal to word), and a turn's later request likewise (``UsageLedger.extend``):
the locks come before any statement that reads
the budget, so that statement's snapshot (READ COMMITTED takes one per statement) sees
everything the locks' earlier holders committed, and the claim, the admission, the reservation
and the user message are then one statement (``core.storage.reservations``): three round trips
(BEGIN and the locks, the statement, COMMIT) where it took five. The lock order
this gives is argued in docs/design.md, *Budgets across replicas*.

The transaction is the connection's own (SQL ``BEGIN`` … ``COMMIT`` on a connection held in
autocommit mode, ``Database.autocommit``), not SQLAlchemy's, which would send its BEGIN by
itself; SQLAlchemy therefore neither commits nor rolls it back: this module does, and a
connection whose transaction could not be seen to end is invalidated (closed), which ends the
transaction and its locks on the server, rather than lent again still holding them. When
anything listens to the engine's statements (``core.storage.prepared``), BEGIN, the locks and
COMMIT go SQLAlchemy's ordinary way, one statement each, so they are seen.

Whether a step tries the locks inside its one statement first at all is ``AtOnce``'s to say:
on a server where most tries fall back, each try is a round trip spent for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Final, TypeVar

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from core import metrics
from core.storage.engine import Conn, Database
from core.storage.prepared import direct_driver

T = TypeVar("T")

# How many of a database's last tries ``AtOnce`` weighs, the share of them that must have gone
# at once for the next step to try again, and how often a step tries anyway while they do not
# (so a server that has gone quiet is noticed). A try that falls back costs its round trip
# and the statement's start (about 0.13 ms in the server) on top of the waiting way's three
# round trips; one that goes saves two of them. Trying pays while more than about 45 % go with
# the server on the same machine (a round trip about 0.2 ms) and about 36 % with one a
# millisecond away: 40 % between them.
RECENT: Final = 32
WORTH_TRYING: Final = 0.4
TRY_ANYWAY_EVERY: Final = 16


class AtOnce:
    """Whether a budgeted step (a claim, a turn's later request) on one database tries the
    accounts' locks inside its one statement first, from how the database's recent tries went,
    and what ``slack_agent_budget_checks_total{way}`` counts of them.

    A try goes at once only if no transaction on the whole server ended between the
    statement's start and its locks (docs/design.md, *Budgets across replicas*): on a busy
    shared server most tries can fall back, and each then cost a round trip more than
    waiting for the locks at once. While fewer than ``WORTH_TRYING`` of the last ``RECENT``
    went, steps wait for the locks without trying (``skipped``), one in ``TRY_ANYWAY_EVERY``
    excepted. A try that fell back because the budget refused counts as fallen back too: the
    statement does not say why it wrote nothing, and the waiting way is right for it anyway.
    """

    def __init__(self) -> None:
        self._recent: deque[bool] = deque(maxlen=RECENT)
        self._passed = 0  # steps that did not try since the last that did

    def worth_trying(self) -> bool:
        """Whether the next step tries at once; a step told no is counted ``skipped``."""
        recent = self._recent
        if len(recent) < RECENT or sum(recent) >= WORTH_TRYING * RECENT:
            return True
        self._passed += 1
        if self._passed >= TRY_ANYWAY_EVERY:
            self._passed = 0
            return True
        metrics.BUDGET_CHECKS.labels("skipped").inc()
        return False

    def tried(self, went: bool) -> None:
        """A try's outcome (``went``: the statement wrote, at once), noted and counted."""
        self._recent.append(went)
        metrics.BUDGET_CHECKS.labels("at_once" if went else "waiting").inc()


_AT_ONCE: weakref.WeakKeyDictionary[Database, AtOnce] = weakref.WeakKeyDictionary()


def at_once(db: Database) -> AtOnce:
    """``db``'s ``AtOnce``: the server's traffic is what decides, so one per database."""
    odds = _AT_ONCE.get(db)
    if odds is None:
        odds = _AT_ONCE[db] = AtOnce()
    return odds


async def tried_at_once(db: Database, step: Callable[[Conn], Awaitable[T]]) -> T | None:
    """``step`` (a statement that tries the accounts' locks itself) on a connection outside
    any transaction, when ``db``'s recent tries say it is worth it, its outcome noted: what it
    returned, falsy when it wrote nothing (the caller then waits for the locks), or None when
    it was not tried."""
    odds = at_once(db)
    if not odds.worth_trying():
        return None
    async with db.autocommit() as conn:
        done = await step(conn)
    odds.tried(bool(done))
    return done


def _opening(keys: Sequence[int]) -> str:
    """BEGIN and the locks, in ``keys``' order, as one simple query. The keys are written into
    the SQL (a simple query takes no parameters): Python integers, so nothing but digits and a
    sign is ever written."""
    locks = ", ".join(f"pg_advisory_xact_lock({int(key)})" for key in keys)
    return f"BEGIN; SELECT {locks}"


def _driver(conn: Conn) -> asyncpg.Connection:
    """The asyncpg connection under ``conn``, watched or not (to end its transaction)."""
    assert isinstance(conn, AsyncConnection)
    sync = conn.sync_connection
    assert sync is not None
    driver = getattr(sync.connection.dbapi_connection, "driver_connection", None)
    assert isinstance(driver, asyncpg.Connection)
    return driver


@contextlib.asynccontextmanager
async def locked(db: Database, keys: Sequence[int]) -> AsyncIterator[Conn]:
    """A transaction holding the advisory locks ``keys`` (taken in that order: pass them
    sorted by a fixed rule, so every holder takes them in the same order), committed when the
    block ends and rolled back when it raises (the opening too: a lock wait that times out).
    PostgreSQL only."""
    async with db.autocommit() as conn:
        direct = direct_driver(conn)
        try:
            if direct is not None:
                await direct.execute(_opening(keys))
            else:
                await conn.execute(text("BEGIN"))
                await conn.execute(text(_opening(keys).removeprefix("BEGIN; ")))
            yield conn
            if direct is not None:
                await direct.execute("COMMIT")
            else:
                await conn.execute(text("COMMIT"))
        except BaseException:
            await asyncio.shield(_roll_back(conn))
            raise


async def _roll_back(conn: Conn) -> None:
    """The transaction rolled back, or the connection invalidated when that cannot be done
    (it broke, or a cancelled statement is still being cancelled): never lent again holding
    the locks."""
    try:
        await _driver(conn).execute("ROLLBACK")
    except Exception:  # whatever it was, the connection goes, and its transaction with it
        assert isinstance(conn, AsyncConnection)
        await conn.invalidate()


__all__ = ["AtOnce", "at_once", "locked", "tried_at_once"]

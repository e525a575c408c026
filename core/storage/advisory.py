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
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from core.storage.engine import Conn, Database
from core.storage.prepared import direct_driver


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


__all__ = ["locked"]

"""A budgeted claim's locks (docs/design.md, *Budgets across replicas*, *Lock order*): on
PostgreSQL its transaction opens with the accounts' advisory locks (``core.storage.advisory``),
a transaction of the connection's own, so every way it ends (admitted, refused for the budget,
busy, stale, cancelled while it waits on the locks) must leave no lock held and no transaction
open; with the locks taken before the session's row, a claim that waits on the row while
another turn of the same accounts takes its next request's step, and a release that commits
meanwhile, all finish. On SQLite the same claims end with the write lock free."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from core.agent.accounting import Payer
from core.errors import AgentSessionBudgetExceeded, AgentSessionBusy, AgentSessionStale
from core.messages import user_message
from core.providers.base import Usage
from core.records import TurnLease
from core.storage import advisory
from core.storage.engine import Database, create_database
from core.storage.reservations import lock_key
from core.storage.sessions import SessionStore
from core.storage.usage import LedgerEntry, UsageLedger
from core.usage.budgets import account_key, parse_budgets
from core.usage.totals import RequestUsage
from tests.helpers import claim_params, new_session, statements

PAYER = Payer("slack:T1:U1", "T1")
ROOMY = "user:day:1000000tokens,workspace:day:1000000tokens,all:day:1000000tokens"
SPENT = "user:day:100tokens,workspace:day:1000000tokens,all:day:1000000tokens"


async def spend(db: Database, tokens: int) -> None:
    request = RequestUsage("openai", "m", Usage(tokens, 0), None)
    await UsageLedger(db, staleness_seconds=60).record(
        LedgerEntry(request, "answer", tokens, False, payer=PAYER)
    )


async def nothing_left_open(db: Database) -> None:
    """No advisory lock held and no session of the database idle in a transaction (PostgreSQL);
    a write transaction can begin at once (both)."""
    if db.dialect == "postgresql":
        async with db.read() as conn:
            locks = await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database ="
                    " (SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            )
            idle = await conn.scalar(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND state LIKE 'idle in transaction%'"
                )
            )
        assert (locks, idle) == (0, 0)
    async with asyncio.timeout(5), db.write() as conn:
        await conn.execute(text("SELECT 1"))


def roomy_claim(
    store: SessionStore, ledger: UsageLedger, session_id: int, text: str = "hi"
) -> Coroutine[Any, Any, TurnLease]:
    """A claim of ``session_id`` with a user message and no tail seen, for ``PAYER`` under
    ``ROOMY`` (budgets it never reaches, so every claim checks them)."""
    return store.start_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=None,
        reservation=ledger.reservation(parse_budgets(ROOMY), PAYER),
    )


@contextlib.asynccontextmanager
async def another_holding(db: Database, database_url: str, account: int = 0) -> AsyncIterator[None]:
    """Another transaction, on an engine of its own, holding the advisory lock of one of
    ``PAYER``'s accounts under ``ROOMY`` (``account``: the budget's index; PostgreSQL), or
    SQLite's write lock, until the block ends."""
    holder = create_database(database_url)
    try:
        async with holder.write() as conn:
            if db.dialect == "postgresql":
                key = lock_key(account_key(parse_budgets(ROOMY)[account], PAYER) or "")
                await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})
            else:
                await conn.execute(text("DELETE FROM usage_reservations WHERE 0"))
            yield
    finally:
        await holder.dispose()


def _budget_checks(way: str) -> float:
    """``slack_agent_budget_checks_total{way}`` in this process."""
    return REGISTRY.get_sample_value("slack_agent_budget_checks_total", {"way": way}) or 0.0


async def waiting(db: Database, count: int) -> None:
    """Until ``count`` of the database's sessions wait on a lock (PostgreSQL); a moment
    (SQLite, where a writer waits in its busy handler)."""
    if db.dialect != "postgresql":
        await asyncio.sleep(0.3)
        return
    async with asyncio.timeout(10):
        while True:
            async with db.read() as conn:
                found = await conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                        " current_database() AND wait_event_type = 'Lock'"
                    )
                )
            if found >= count:
                return
            await asyncio.sleep(0.02)


async def test_claim__every_ending_leaves_no_lock_and_no_transaction(db: Database) -> None:
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, session = await new_session(store)

    async def claim(budgets: str, last: str | None) -> None:
        lease = await store.start_turn(
            session.id,
            user_message=user_message("hi"),
            last_message_id=last,
            reservation=ledger.reservation(parse_budgets(budgets), PAYER),
        )
        await store.release(lease)

    await claim(ROOMY, None)  # admitted, then released
    await nothing_left_open(db)
    tail = await store.tail(session.id)
    assert tail is not None
    with pytest.raises(AgentSessionStale):
        await claim(ROOMY, None)
    await nothing_left_open(db)
    await spend(db, 500)
    with pytest.raises(AgentSessionBudgetExceeded):
        await claim(SPENT, tail.message_id)
    await nothing_left_open(db)
    running = await store.start_turn(
        session.id, user_message=user_message("a"), last_message_id=tail.message_id
    )
    other = SessionStore(db)  # another process: it does not know the lease is live
    with pytest.raises(AgentSessionBusy):
        await other.start_turn(
            session.id,
            user_message=user_message("b"),
            last_message_id=running.tail.message_id if running.tail else None,
            reservation=ledger.reservation(parse_budgets(ROOMY), PAYER),
        )
    await store.release(running)
    await nothing_left_open(db)


async def test_claim__cancelled_while_it_waits_on_the_locks_leaves_none(
    db: Database, database_url: str
) -> None:
    """Another transaction holds one of the payer's accounts' locks (on SQLite: the write
    lock); a claim waiting behind it is cancelled; once the holder ends, nothing is held and
    the next claim is admitted."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, session = await new_session(store)
    async with another_holding(db, database_url):
        claim = asyncio.create_task(roomy_claim(store, ledger, session.id, "hi"))
        await waiting(db, 1)
        assert not claim.done()
        claim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await claim
    await nothing_left_open(db)
    lease = await roomy_claim(store, ledger, session.id, "hi")
    await store.release(lease)
    assert len(await store.messages(session.id)) == 1
    await nothing_left_open(db)


async def test_claim__waiting_on_the_session_row_under_the_locks_does_not_deadlock(
    db: Database, database_url: str
) -> None:
    """The order of docs/design.md's table, under contention: a budgeted claim takes the
    accounts' locks and waits on the session's row (held by an open transaction, as a release
    or a claim without budgets would hold it); a running turn of the same accounts takes its
    next request's step (it waits on the locks); the row's holder commits; both finish, and
    the claim is refused as busy or admitted, never failed."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, first = await new_session(store)
    _, second = await new_session(store)
    reservation = ledger.reservation(parse_budgets(ROOMY), PAYER)
    assert reservation is not None
    running = await store.start_turn(
        first.id, user_message=user_message("a"), last_message_id=None, reservation=reservation
    )
    holder = create_database(database_url)
    try:
        async with holder.write() as conn:
            await conn.execute(
                text("UPDATE agent_sessions SET updated_at = updated_at WHERE id = :s"),
                {"s": second.id},
            )
            claim = asyncio.create_task(roomy_claim(store, ledger, second.id, "b"))
            await waiting(db, 1)  # the claim, on the row, holding the accounts' locks
            step = asyncio.create_task(ledger.extend(reservation))
            await waiting(db, 2)  # and the step, on the locks
            assert not claim.done()
        async with asyncio.timeout(10):
            lease = await claim
            await step
    finally:
        await holder.dispose()
    await store.release(lease)
    await store.release(running)
    await nothing_left_open(db)


async def test_claim__watched_statements_are_seen_either_way(
    db: Database, database_url: str
) -> None:
    """With a listener on the engine's statements, a budgeted claim's statements are seen and
    it is admitted as unwatched. On PostgreSQL its first is the one that tries the accounts'
    locks itself (``_claim_at_once``); while another transaction holds one of them, that one
    writes nothing and the waiting way follows, BEGIN, the locks and COMMIT each seen, and
    admits the claim once the holder ends."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, session = await new_session(store)
    waited = _budget_checks("waiting")
    with statements(db) as seen:
        async with another_holding(db, database_url):
            claim = asyncio.create_task(roomy_claim(store, ledger, session.id, "hi"))
            await waiting(db, 1)  # the waiting way, on the lock
        async with asyncio.timeout(10):
            lease = await claim
    await store.release(lease)
    claims = [sql for sql, _ in seen if "pg_stat_activity" not in sql]  # not waiting()'s
    said = [sql.split()[0].upper() for sql in claims]
    if db.dialect == "postgresql":
        assert "pg_try_advisory_xact_lock" in claims[0]
        assert "usage_locked_snapshot" in claims[0]
        assert said[1] == "BEGIN"
        assert "pg_advisory_xact_lock" in claims[2]
        assert said[-1] == "COMMIT"
        assert _budget_checks("waiting") == waited + 1
    async with db.read() as conn:
        held = await conn.scalar(text("SELECT count(*) FROM usage_reservations"))
    assert held == 0  # the release's trigger deleted it
    assert len(await store.messages(session.id)) == 1
    await nothing_left_open(db)


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite's claims hold its write lock
async def test_claim_at_once__writes_nothing_while_a_lock_is_held_elsewhere(
    db: Database, database_url: str
) -> None:
    """PostgreSQL: the one statement only tries the accounts' locks. While another
    transaction holds one, it returns at once having written nothing (the session free, no
    message, no reservation) and holding nothing; the waiting way is the caller's."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, session = await new_session(store)
    reservation = ledger.reservation(parse_budgets(ROOMY), PAYER)
    assert reservation is not None
    params = claim_params(session.id)
    async with another_holding(db, database_url, -1):
        async with asyncio.timeout(5), db.autocommit() as mine:
            got = await reservation.claim_admitting(mine, params, stamp=False, at_once=True)
        assert got is None
        assert not await store.is_turn_active(session.id)
        assert await store.messages(session.id) == []
        async with db.read() as mine:
            held = await mine.scalar(text("SELECT count(*) FROM usage_reservations"))
        assert held == 0
    await nothing_left_open(db)


@pytest.mark.parametrize("backend", ["postgresql"])  # migration 0013: nothing on SQLite
async def test_locked_snapshot__tells_a_transaction_that_ended_after_the_statement_began(
    db: Database, database_url: str
) -> None:
    """Migration 0013's ``usage_locked_snapshot``: a snapshot of its own, taken
    when it runs, not the calling statement's. A statement that calls it after another
    transaction committed (here while the statement sleeps) gets a snapshot unlike its own,
    so a claim in that case writes nothing; NULL when the locks were not all taken. With no
    transaction ending meanwhile the two are equal (other tests' transactions on the same
    server can end meanwhile, so it is asked until they are, a bounded number of times)."""
    later = (
        "SELECT usage_locked_snapshot((SELECT true FROM pg_sleep(:pause)))"
        " = pg_current_snapshot()::text"
    )
    other = create_database(database_url)
    try:
        async with db.read() as conn:
            assert await conn.scalar(text("SELECT usage_locked_snapshot(false)")) is None
        async with db.autocommit() as conn:
            asking = asyncio.create_task(conn.scalar(text(later), {"pause": 1.0}))
            await asyncio.sleep(0.3)
            async with other.write() as writer:  # a transaction with an id, committed
                await writer.execute(text("SELECT pg_current_xact_id()"))
            assert await asking is False
        async with db.autocommit() as conn:
            equal = False
            for _ in range(200):
                if await conn.scalar(text(later), {"pause": 0}):
                    equal = True
                    break
            assert equal
    finally:
        await other.dispose()


async def test_extend__waits_for_a_lock_held_elsewhere_then_reserves(
    db: Database, database_url: str
) -> None:
    """A running turn's later request (``UsageLedger.extend``): while another transaction
    holds one of its payer's accounts' locks, the one statement that tries them writes nothing
    and the step waits for the locks the other way (PostgreSQL; on SQLite for the write
    lock), then reserves once the holder ends; nothing is left held or open."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, session = await new_session(store)
    budgets = parse_budgets(ROOMY)
    reservation = ledger.reservation(budgets, PAYER)
    assert reservation is not None
    lease = await store.start_turn(
        session.id, user_message=user_message("a"), last_message_id=None, reservation=reservation
    )
    waited = _budget_checks("waiting")
    async with another_holding(db, database_url, 1):
        step = asyncio.create_task(ledger.extend(reservation))
        await waiting(db, 1)
        assert not step.done()
    async with asyncio.timeout(10):
        await step
    if db.dialect == "postgresql":
        assert _budget_checks("waiting") == waited + 1
    async with db.read() as conn:
        held = await conn.scalar(
            text("SELECT count(*) FROM usage_reservations WHERE session_id = :s"),
            {"s": session.id},
        )
    assert held == 1
    await store.release(lease)
    await nothing_left_open(db)


def test_at_once__not_tried_while_most_tries_fall_back_and_tried_now_and_then() -> None:
    """``advisory.AtOnce``: steps try at once until ``RECENT`` tries are known; while fewer
    than ``WORTH_TRYING`` of the last ``RECENT`` went, one step in ``TRY_ANYWAY_EVERY`` tries
    (the others counted ``skipped``), and once enough go again every step tries."""
    odds = advisory.AtOnce()
    for _ in range(advisory.RECENT - 1):
        assert odds.worth_trying()
        odds.tried(False)
    assert odds.worth_trying()  # one try short of knowing
    odds.tried(False)
    skipped = _budget_checks("skipped")
    asked = [odds.worth_trying() for _ in range(2 * advisory.TRY_ANYWAY_EVERY)]
    assert [i for i, tries in enumerate(asked) if tries] == [
        advisory.TRY_ANYWAY_EVERY - 1,
        2 * advisory.TRY_ANYWAY_EVERY - 1,
    ]
    assert _budget_checks("skipped") == skipped + 2 * advisory.TRY_ANYWAY_EVERY - 2
    needed = math.ceil(advisory.WORTH_TRYING * advisory.RECENT)  # went, of the last RECENT
    for _ in range(needed - 1):
        odds.tried(True)
    assert not any(odds.worth_trying() for _ in range(advisory.TRY_ANYWAY_EVERY - 1))
    odds.tried(True)
    assert all(odds.worth_trying() for _ in range(3 * advisory.TRY_ANYWAY_EVERY))


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite's steps have one way
async def test_claim_and_extend__wait_for_the_locks_without_trying_while_tries_fall_back(
    db: Database,
) -> None:
    """PostgreSQL: once the database's last ``RECENT`` tries fell back, a budgeted claim and
    a turn's later request open with BEGIN and the locks, with no statement that tries them
    first, each counted ``skipped``, and are admitted and reserve as before."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    _, session = await new_session(store)
    odds = advisory.at_once(db)
    for _ in range(advisory.RECENT):
        odds.tried(False)
    skipped, tried = _budget_checks("skipped"), _budget_checks("at_once")
    reservation = ledger.reservation(parse_budgets(ROOMY), PAYER)
    assert reservation is not None
    with statements(db) as seen:
        lease = await store.start_turn(
            session.id,
            user_message=user_message("a"),
            last_message_id=None,
            reservation=reservation,
        )
        await ledger.extend(reservation)
    said = [sql.split()[0].upper() for sql, _ in seen]
    assert not any("pg_try_advisory_xact_lock" in sql for sql, _ in seen)
    assert said.count("BEGIN") == 2
    assert said[0] == "BEGIN"
    assert (_budget_checks("skipped"), _budget_checks("at_once")) == (skipped + 2, tried)
    async with db.read() as conn:
        held = await conn.scalar(
            text("SELECT count(*) FROM usage_reservations WHERE session_id = :s"),
            {"s": session.id},
        )
    assert held == 1
    assert len(await store.messages(session.id)) == 1
    await store.release(lease)
    await nothing_left_open(db)

"""A turn's reservation as one row (migration 0010): what it holds on each of its payer's
accounts, carried over from the rows of before; a crashed turn's reservation stops counting
with its lock and goes with the take-over; the one-statement admission (SQLite's ``INSERT …
SELECT``, PostgreSQL's claim) agrees with the rules (``core.usage.budgets``) it writes in SQL."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import text, update

from core.agent.accounting import Payer
from core.errors import AgentSessionBudgetExceeded
from core.messages import user_message
from core.providers.base import Usage
from core.records import TurnLease
from core.storage.dialect import db_now
from core.storage.engine import Conn, Database, create_database
from core.storage.migrate import upgrade
from core.storage.queries import SESSIONS
from core.storage.reservations import NANO, Reservation
from core.storage.sessions import SessionStore
from core.storage.usage import LedgerEntry, UsageLedger
from core.usage.budgets import parse_budgets
from core.usage.totals import RequestUsage
from tests.helpers import claim_params, new_session, take_over
from tests.test_migrations import _downgrade

PAYER = Payer("slack:T1:U1", "T1")
NEIGHBOUR = Payer("slack:T1:U2", "T1")  # the same workspace, another person
GENEROUS = "user:day:1000000000tokens,workspace:month:1000usd,all:month:1000000000tokens"


def priced(tokens: int, nanousd: int) -> RequestUsage:
    return RequestUsage(
        "openai", "m", Usage(tokens - tokens // 10, tokens // 10), Decimal(nanousd) / NANO
    )


async def held(ledger: UsageLedger, budgets: str, payer: Payer = PAYER) -> list[Decimal]:
    return [account.reserved for account in await ledger.accounts(parse_budgets(budgets), payer)]


async def test_reservation__one_row_per_turn_holds_each_account(
    store: SessionStore, db: Database
) -> None:
    """Three budgets (user tokens, workspace dollars, everyone's tokens): one row, and each
    account reads what the turn holds on it; another person of the workspace sees the turn's
    hold on the workspace and on everyone's, not on the person's own account."""
    ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
    await ledger.record(LedgerEntry(priced(900, 4_000), "answer", 900, False, payer=PAYER))
    _, session = await new_session(store)
    reservation = ledger.reservation(parse_budgets(GENEROUS), PAYER)
    lease = await store.start_turn(
        session.id, user_message=user_message("hi"), last_message_id=None, reservation=reservation
    )
    try:
        async with db.read() as conn:
            rows = (await conn.execute(text("SELECT * FROM usage_reservations"))).mappings().all()
        assert len(rows) == 1
        (row,) = rows
        assert row["user_account"] == f"user:{PAYER.user}"
        assert row["workspace_account"] == f"workspace:{PAYER.workspace}"
        user, workspace, everyone = await held(ledger, GENEROUS, NEIGHBOUR)
        assert user == 0
        assert workspace == Decimal(row["workspace_nanousd"]) / NANO > 0
        assert everyone == row["all_tokens"] > 0
        # The payer's own account holds it too, and the turn's own check leaves it out.
        assert await held(ledger, GENEROUS, PAYER) == [row["user_tokens"], workspace, everyone]
        mine = await ledger.accounts(parse_budgets(GENEROUS), PAYER, exclude_session=session.id)
        assert [account.reserved for account in mine] == [0, 0, 0]
    finally:
        await store.release(lease)
    assert await held(ledger, GENEROUS, NEIGHBOUR) == [0, 0, 0]


async def test_reservation__a_crashed_turn_stops_holding_and_the_take_over_deletes_it(
    db: Database,
) -> None:
    """A turn whose process died (no heartbeat past the staleness window) holds nothing for
    anyone else's claim, without a write; the claim that takes its session over deletes its
    row (the lock's trigger) and holds its own instead."""
    store = SessionStore(db, staleness_seconds=60)
    ledger = UsageLedger(db, staleness_seconds=60)
    _, session = await new_session(store)
    await store.start_turn(
        session.id,
        user_message=user_message("hi"),
        last_message_id=None,
        reservation=ledger.reservation(parse_budgets(GENEROUS), PAYER),
    )
    before = await held(ledger, GENEROUS, NEIGHBOUR)
    assert before[2] > 0
    async with db.write() as conn:  # the process died a window ago: its heartbeat aged
        await conn.execute(
            text(
                "UPDATE agent_sessions SET heartbeat_at = :old WHERE id = :sid",
            ),
            {"old": datetime(2000, 1, 1), "sid": session.id},
        )
    assert await held(ledger, GENEROUS, NEIGHBOUR) == [0, 0, 0]
    lease = await take_over(db, session.id)
    async with db.read() as conn:
        count = await conn.scalar(text("SELECT count(*) FROM usage_reservations"))
    assert count == 0
    await store.release(lease)


# -- the admission in SQL agrees with the rules ------------------------------------------------


class _RolledBack(Exception):
    """Ends a write transaction of the test without committing it."""


async def _both_ways(
    db: Database, reservation: Reservation, session_id: int, *, at_once: str = ""
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """What the rules decide (the hold's columns, None: refused) and what the one statement
    wrote (None: nothing), in one transaction that is rolled back. On PostgreSQL the statement
    is the claim's (``Reservation.claim_admitting``: the claim, the admission, the reservation
    and a user message), claiming the session, which is free, whatever its tail; ``at_once``:
    a statement that tries the locks itself, the claim's (``claim``:
    ``Reservation.claim_at_once``) or a later request's (``extend``:
    ``Reservation.extend_at_once``), which also writes nothing when a transaction elsewhere on
    the server ended while it took them, so where the rules admit it is run again (each time
    afresh) until it writes, or 200 times."""
    out: list[dict[str, Any] | None] = []

    async def row(conn: Conn) -> dict[str, Any] | None:
        found = (
            (
                await conn.execute(
                    text("SELECT * FROM usage_reservations WHERE session_id = :s"),
                    {"s": session_id},
                )
            )
            .mappings()
            .first()
        )
        return None if found is None else {k: found[k] for k in SLOT_COLUMNS}

    try:
        async with db.write() as conn:
            try:
                params = await reservation._decide(conn, session_id, "token", False)
                out.append({k: params[f"h_{k}"] for k in SLOT_COLUMNS})
            except AgentSessionBudgetExceeded:
                out.append(None)
            if conn.dialect.name == "sqlite":
                admitted = await reservation._admit(conn, session_id, "token", False)
            else:
                claim = claim_params(session_id)
                if at_once:
                    for _ in range(1 if out[0] is None else 200):
                        if at_once == "extend":
                            admitted = await reservation.extend_at_once(conn, session_id, "token")
                        else:
                            got = await reservation.claim_admitting(
                                conn, claim, stamp=False, at_once=True
                            )
                            admitted = got is not None
                        if admitted:
                            break
                else:
                    got = await reservation.claim_admitting(conn, claim, stamp=False)
                    admitted = got is not None
            out.append(await row(conn) if admitted else None)
            raise _RolledBack
    except _RolledBack:
        pass
    return out[0], out[1]


SLOT_COLUMNS = (
    "user_tokens",
    "user_nanousd",
    "workspace_tokens",
    "workspace_nanousd",
    "all_tokens",
    "all_nanousd",
)


async def test_admission__the_one_statement_agrees_with_the_rules(db: Database) -> None:
    """Around every budget's edge (what is left just above, at and below what the turn is
    expected to cost, one unit, nothing), with and without another live turn holding on the
    same accounts, for a session with priced requests and a new one, with and without new
    text: the statement admits exactly the turns the rules admit and holds what they hold
    (on PostgreSQL every statement built on it: the claim under the locks, and the claim and
    a later request's step trying them themselves)."""
    now = datetime.now(UTC)
    store = SessionStore(db, staleness_seconds=60)
    ledger = UsageLedger(db, staleness_seconds=60, clock=lambda: now)
    _, talked = await new_session(store)
    _, fresh = await new_session(store)
    _, other = await new_session(store, owner=NEIGHBOUR.user)
    for tokens, cost in ((700, 3_000), (1_100, 5_000)):
        entry = LedgerEntry(priced(tokens, cost), "answer", tokens, False, talked.id, payer=PAYER)
        await ledger.record(entry)
    await ledger.record(LedgerEntry(priced(500, 2_000), "answer", 500, False, payer=NEIGHBOUR))
    patterns = (
        (("user", "day", "tokens"),),
        (("workspace", "month", "usd"),),
        (("user", "day", "tokens"), ("workspace", "month", "usd"), ("all", "month", "tokens")),
        (("user", "day", "tokens"), ("user", "month", "tokens"), ("all", "day", "usd")),
    )
    outcomes: set[bool] = set()
    for holding in (False, True):
        lease = None
        if holding:  # another live turn on the workspace's and everyone's accounts
            lease = await store.start_turn(
                other.id,
                user_message=user_message("x"),
                last_message_id=None,
                reservation=ledger.reservation(parse_budgets(GENEROUS), NEIGHBOUR),
            )
            entry = LedgerEntry(priced(90, 300), "answer", 90, False, other.id, payer=NEIGHBOUR)
            await ledger.record(entry)
        for pattern in patterns:
            for session in (talked, fresh):
                for text_tokens in (0, 37):
                    edges = [
                        await _edges(db, ledger, budget, session.id, text_tokens)
                        for budget in pattern
                    ]
                    for limits in zip(*edges, strict=True):
                        spec = ",".join(
                            f"{scope}:{period}:{_amount(unit, limit)}{unit}"
                            for (scope, period, unit), limit in zip(pattern, limits, strict=True)
                        )
                        reservation = _reservation(ledger, spec, text_tokens)
                        rules, statement = await _both_ways(db, reservation, session.id)
                        assert statement == rules, (spec, session.id, text_tokens, holding)
                        if db.dialect == "postgresql":
                            ways = ("claim", "extend") if text_tokens == 0 else ("claim",)
                            for way in ways:  # a later request adds no new text
                                _, at_once = await _both_ways(
                                    db, reservation, session.id, at_once=way
                                )
                                assert at_once == rules, (way, spec, session.id, holding)
                        outcomes.add(rules is not None)
        if lease is not None:
            await store.release(lease)
    assert outcomes == {True, False}  # the edges were crossed both ways


def _amount(unit: str, limit: int) -> str:
    return f"{Decimal(limit) / NANO:f}" if unit == "usd" else str(limit)


async def _edges(
    db: Database,
    ledger: UsageLedger,
    budget: tuple[str, str, str],
    session_id: int,
    text_tokens: int,
) -> list[int]:
    """Limits of one budget (in its stored unit) around its edge: what is used (spent and
    held by others) plus nothing, one unit, two, the expected cost less one, it, one more,
    and plenty. The expected cost is what the rules hold under a limit that never binds."""
    scope, period, unit = budget
    plenty = 10**15 if unit == "tokens" else 10**9
    spec = f"{scope}:{period}:{plenty}{unit}"
    rules, _ = await _both_ways(db, _reservation(ledger, spec, text_tokens), session_id)
    assert rules is not None
    (expected,) = [value for value in rules.values() if value is not None]
    (account,) = await ledger.accounts(parse_budgets(spec), PAYER)
    used = int(account.used * NANO) if unit == "usd" else int(account.used)
    steps = (0, 1, 2, expected - 1, expected, expected + 1, 3 * expected + 1)
    return [used + step for step in steps]


def _reservation(ledger: UsageLedger, spec: str, text_tokens: int) -> Reservation:
    reservation = ledger.reservation(parse_budgets(spec), PAYER)
    assert reservation is not None
    reservation.text_tokens = text_tokens
    return reservation


# -- migration 0010 carries the live reservations over --------------------------------------


async def test_migration_0010__carries_live_reservations_over_as_one_row_per_turn(
    empty_database_url: str,
) -> None:
    db = create_database(empty_database_url)
    try:
        await upgrade(db, "0009_decision_reason")
        store = SessionStore(db, staleness_seconds=60)
        _, live = await new_session(store)
        _, ended = await new_session(store)
        # A turn holding ``live``'s lock, taken as that revision's code took it (a claim
        # names columns later revisions add).
        lease = TurnLease(live.id, "turn-0009", None, 0)
        async with db.write() as conn:
            await conn.execute(
                update(SESSIONS)
                .where(SESSIONS.c.id == live.id)
                .values(lock_token=lease.token, heartbeat_at=db_now())
            )
        at = datetime(2026, 12, 7, 1, 0, 0)
        rows = [
            (live.id, lease.token, "all", "tokens", 300),
            (live.id, lease.token, f"user:{PAYER.user}", "tokens", 200),
            (live.id, lease.token, f"workspace:{PAYER.workspace}", "usd", 7_000),
            (ended.id, "gone", "all", "tokens", 999),  # its lock is no longer held
        ]
        async with db.write() as conn:
            for sid, token, account, unit, amount in rows:
                await conn.execute(
                    text(
                        "INSERT INTO usage_reservations (session_id, lock_token, account, unit,"
                        " amount, created_at) VALUES (:s, :t, :a, :u, :n, :c)"
                    ),
                    {"s": sid, "t": token, "a": account, "u": unit, "n": amount, "c": at},
                )
        await upgrade(db)
        async with db.read() as conn:
            found = (await conn.execute(text("SELECT * FROM usage_reservations"))).mappings().all()
        assert [row["session_id"] for row in found] == [live.id]
        (row,) = found
        assert row["lock_token"] == lease.token
        assert (row["all_tokens"], row["user_tokens"], row["workspace_nanousd"]) == (
            300,
            200,
            7_000,
        )
        assert (row["user_account"], row["workspace_account"]) == (
            f"user:{PAYER.user}",
            f"workspace:{PAYER.workspace}",
        )
        assert row["all_nanousd"] is None
        assert row["user_nanousd"] is None
        ledger = UsageLedger(db, staleness_seconds=60)
        budgets = "user:day:1000000tokens,workspace:month:10usd,all:day:1000000tokens"
        user, workspace, everyone = await held(ledger, budgets, PAYER)
        assert (user, workspace, everyone) == (200, Decimal(7_000) / NANO, 300)
        # And back: a row per account and unit again, what each held unchanged.
        await _downgrade(db, "0009_decision_reason")
        async with db.read() as conn:
            back = (
                await conn.execute(
                    text(
                        "SELECT session_id, lock_token, account, unit, amount"
                        " FROM usage_reservations"
                    )
                )
            ).all()
        assert sorted(map(tuple, back)) == sorted(row[:5] for row in rows if row[0] == live.id)
        await upgrade(db)
        assert await held(ledger, budgets, PAYER) == [user, workspace, everyone]
        await store.release(lease)
        assert await held(ledger, budgets, PAYER) == [0, 0, 0]
    finally:
        await db.dispose()

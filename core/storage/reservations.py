"""The budget check a claim runs, in O(1): the payer's running totals (``usage_totals``), the
other live turns' reservations and the session's last request, read in one prepared statement;
the decision (``core.usage.budgets.admits``); the turn's reservation written.

What it guarantees (docs/design.md, *Budgets across replicas*):

- A turn reserves what its next model request is expected to cost (``expected_tokens``: the
  session's conversation as its last request left it, the new text, the account's average
  output in the window; ``expected_nanousd`` for a dollar budget), capped by what is left.
- It is admitted while what is left (the limit less the window's spending and what *other* live
  turns hold) is positive and its expected cost fits, or, when no other turn holds anything on
  that account, into the last bit. So of turns racing at a budget's end, those whose expected
  costs fit run, and at most one more: concurrent turns overshoot a budget by at most one model
  request in total (plus what requests cost beyond what was expected of them), not one per turn.
- Each later request of a running turn takes the same step again (``UsageLedger.extend``), and
  what a turn holds is what it has yet to spend: its reservation less its session's ledger rows
  written since it reserved (both stamped by the writing process's clock).
- The step is atomic per account: on PostgreSQL under transaction-level advisory locks (one per
  account, taken in one statement, in a fixed order: claims on different accounts never wait
  for each other; at a claim the claim's own UPDATE takes them, and the user message's insert
  writes the reservation, so the check adds its read to the claim's transaction; a claim
  with no budget to check is one statement, with no transaction), on SQLite
  under the write lock every write transaction holds. The read is one
  statement, so it sees the totals, the reservations and the rows that use them up of one
  moment.
- A reservation counts only while its turn holds the session's lock (same token, live
  heartbeat): a turn that ends, dies or loses its lock stops holding it without another write,
  and the statement that releases or takes over the lock deletes its rows (a trigger of
  migration 0007), so a claim scans only the reservations of live turns (and of dead turns
  whose session nobody has claimed since).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Final, cast

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Insert,
    Table,
    and_,
    bindparam,
    case,
    func,
    literal,
    or_,
    select,
    union_all,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect

from core.storage.dialect import UtcDateTime, db_now
from core.storage.engine import Conn
from core.storage.models import (
    AgentSession,
    AgentSessionMessage,
    UsageRequest,
    UsageReservation,
    UsageTotal,
)
from core.storage.prepared import Prepared
from core.storage.queries import claim_statement, insert_next_statement
from core.usage.budgets import (
    Account,
    Budget,
    LastRequest,
    Payer,
    Period,
    WindowTotals,
    account_key,
    admits,
    expected_nanousd,
    expected_tokens,
    refusal,
    window,
)

REQUESTS: Final = cast(Table, UsageRequest.__table__)
RESERVATIONS: Final = cast(Table, UsageReservation.__table__)
SESSIONS: Final = cast(Table, AgentSession.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
TOTALS: Final = cast(Table, UsageTotal.__table__)

NANO: Final = Decimal(1_000_000_000)
MOST_ACCOUNTS: Final = 3  # a payer's: its user, its workspace, everyone's


class WindowStart(UtcDateTime):
    """A window's first instant as a statement's parameter: ``UtcDateTime`` with its bound form
    kept per value. A claim's read names today's and this month's start three times each, a
    ledger row's totals six; on SQLite each is formatted to text in Python, which cost more
    than the read itself (a window start changes once a day)."""

    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        process = super().bind_processor(dialect)
        return None if process is None else functools.lru_cache(maxsize=8)(process)


WINDOW_START: Final = WindowStart()


def applicable(budgets: Sequence[Budget], payer: Payer | None) -> list[tuple[Budget, str]]:
    """Each budget with the payer's account it limits (a payer of ``None`` meets only ``all``)."""
    found: list[tuple[Budget, str]] = []
    for budget in budgets:
        if payer is None:
            key = "all" if budget.scope == "all" else None
        else:
            key = account_key(budget, payer)
        if key is not None:
            found.append((budget, key))
    return found


def lock_key(account: str) -> int:
    """A stable signed 64-bit advisory-lock key for an account (every replica agrees)."""
    digest = hashlib.blake2b(f"usage:{account}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


# -- the statements, one shape per number of accounts (built once, prepared) ---------------------


Wanted = tuple[tuple[int, Period], ...]  # (account's index in the sorted keys, period), sorted


def _wanted(pairs: Sequence[tuple[Budget, str]], keys: Sequence[str]) -> Wanted:
    """The (account, period) totals some budget of ``pairs`` reads: only those are read."""
    return tuple(sorted({(keys.index(key), budget.period) for budget, key in pairs}))


@functools.cache
def _read(accounts: int, wanted: Wanted) -> Prepared:
    """The totals of the ``wanted`` accounts (``a0``…) and windows (today's, ``day``; this
    month's, ``month``), the other live turns' reservations on the ``accounts`` accounts, and
    the session's last request: one statement, so one moment's view, whatever commits
    meanwhile. One shape per number of accounts and windows wanted (a handful in any
    deployment), built and prepared at its first use."""
    names = [bindparam(f"a{i}", type_=TOTALS.c.account.type) for i in range(accounts)]
    spent = select(
        literal("spent").label("kind"),
        TOTALS.c.account.label("account"),
        TOTALS.c.period.label("label"),
        TOTALS.c.tokens.label("n1"),
        TOTALS.c.nanousd.label("n2"),
        TOTALS.c.output_tokens.label("n3"),
        TOTALS.c.requests.label("n4"),
        TOTALS.c.priced_requests.label("n5"),
    ).where(
        # Every row by its whole key, so each is one lookup of the primary key however many
        # windows an account has behind it.
        or_(
            *(
                and_(
                    TOTALS.c.account == names[index],
                    TOTALS.c.period == period,
                    TOTALS.c.window_start == bindparam(period, type_=WINDOW_START),
                )
                for index, period in wanted
            )
        ),
    )
    # What each reserving turn has spent since it reserved: its session's rows written since
    # (a session runs one turn at a time; both times are the writing process's clock).
    since_reserved = (
        select(
            func.coalesce(
                func.sum(
                    case(
                        (RESERVATIONS.c.unit == "tokens", REQUESTS.c.counted_tokens),
                        else_=func.coalesce(REQUESTS.c.cost_nanousd, 0),
                    )
                ),
                0,
            )
        )
        .where(
            REQUESTS.c.session_id == RESERVATIONS.c.session_id,
            REQUESTS.c.created_at >= RESERVATIONS.c.created_at,
        )
        .scalar_subquery()
    )
    unspent = case(
        (RESERVATIONS.c.amount > since_reserved, RESERVATIONS.c.amount - since_reserved),
        else_=0,
    )
    held = (
        select(
            literal("held"),
            RESERVATIONS.c.account,
            RESERVATIONS.c.unit,
            sa_cast(func.sum(unspent), BigInteger),
            literal(0, BigInteger),
            literal(0, BigInteger),
            literal(0, BigInteger),
            literal(0, BigInteger),
        )
        .join(
            SESSIONS,
            and_(
                SESSIONS.c.id == RESERVATIONS.c.session_id,
                SESSIONS.c.lock_token == RESERVATIONS.c.lock_token,
            ),
        )
        .where(
            RESERVATIONS.c.account.in_(names),
            RESERVATIONS.c.session_id != bindparam("sid", type_=BigInteger),
            SESSIONS.c.heartbeat_at >= db_now(bindparam("since", type_=Float)),
        )
        .group_by(RESERVATIONS.c.account, RESERVATIONS.c.unit)
    )
    newest = (
        select(REQUESTS.c.counted_tokens, REQUESTS.c.cost_nanousd)
        .where(REQUESTS.c.session_id == bindparam("sid", type_=BigInteger))
        .order_by(REQUESTS.c.created_at.desc(), REQUESTS.c.id.desc())
        .limit(1)
        .subquery()
    )
    last = select(
        literal("last"),
        literal(""),
        literal(""),
        newest.c.counted_tokens,
        func.coalesce(newest.c.cost_nanousd, -1),
        literal(0, BigInteger),
        literal(0, BigInteger),
        literal(0, BigInteger),
    )
    united = union_all(spent, held, last).subquery()
    return Prepared(select(*united.c))


def _hold(dialect: Any, rows: int) -> Insert:
    """The turn's reservation rows, replacing its session's earlier ones in place (an earlier
    turn's, or this turn's own before a later request): no delete first."""
    upsert = dialect.insert(RESERVATIONS).values(
        [
            {
                "session_id": bindparam("h_sid", type_=BigInteger),
                "lock_token": bindparam("token", type_=RESERVATIONS.c.lock_token.type),
                "account": bindparam(f"r{i}", type_=RESERVATIONS.c.account.type),
                "unit": bindparam(f"u{i}", type_=RESERVATIONS.c.unit.type),
                "amount": bindparam(f"n{i}", type_=BigInteger),
                "created_at": bindparam("at", type_=RESERVATIONS.c.created_at.type),
            }
            for i in range(rows)
        ]
    )
    return cast(
        Insert,
        upsert.on_conflict_do_update(
            index_elements=["session_id", "account", "unit"],
            set_={
                "lock_token": upsert.excluded.lock_token,
                "amount": upsert.excluded.amount,
                "created_at": upsert.excluded.created_at,
            },
        ),
    )


def _lock_columns(accounts: int) -> list[ColumnElement[Any]]:
    """The accounts' advisory locks (``k0``…), in the accounts' sorted order: every claim takes
    them in the same order, so claims never wait on each other in a cycle."""
    return [
        func.pg_advisory_xact_lock(bindparam(f"k{i}", type_=BigInteger)) for i in range(accounts)
    ]


def _locks(accounts: int) -> Prepared:
    return Prepared(select(*_lock_columns(accounts)))


def _claim_locking(stamp: bool, accounts: int) -> Prepared:
    """The claim returning its token and, evaluated after it for the row it claimed, the
    accounts' advisory locks (PostgreSQL; see ``Reservation.claim``)."""
    claim = claim_statement(stamp=stamp).returning(SESSIONS.c.lock_token)
    return Prepared(claim.returning(*_lock_columns(accounts)))


def _insert_holding(rows: int) -> Prepared:
    """The user message's insert (after the claim, which ran the stale guard) with the
    reservation's upsert as a CTE of it."""
    held = _hold(postgresql, rows).cte("held")
    return Prepared(insert_next_statement().add_cte(held).returning(MESSAGES.c.position))


_LOCKS: Final = {n: _locks(n) for n in range(1, MOST_ACCOUNTS + 1)}
_HOLD: Final = {
    name: {n: Prepared(_hold(dialect, n)) for n in range(1, 2 * MOST_ACCOUNTS + 1)}
    for name, dialect in (("postgresql", postgresql), ("sqlite", sqlite))
}
_CLAIM_LOCKING: Final = {
    (stamp, n): _claim_locking(stamp, n)
    for stamp in (False, True)
    for n in range(1, MOST_ACCOUNTS + 1)
}
_INSERT_HOLDING: Final = {n: _insert_holding(n) for n in range(1, 2 * MOST_ACCOUNTS + 1)}


@dataclass(frozen=True)
class _View:
    totals: dict[tuple[str, str], WindowTotals]  # (account, period)
    held: dict[tuple[str, str], int]  # (account, unit): what other live turns hold
    last: LastRequest | None


async def _view(
    conn: Conn,
    keys: Sequence[str],
    wanted: Wanted,
    now: datetime,
    session_id: int | None,
    staleness: float,
) -> _View:
    params: dict[str, Any] = {f"a{i}": key for i, key in enumerate(keys)}
    for _, period in wanted:
        if period not in params:
            params[period] = window(period, now).start
    params["sid"] = -1 if session_id is None else session_id
    params["since"] = -float(staleness)
    rows = await _read(len(keys), wanted).all(conn, params)
    totals: dict[tuple[str, str], WindowTotals] = {}
    held: dict[tuple[str, str], int] = {}
    last: LastRequest | None = None
    for kind, account, label, n1, n2, n3, n4, n5 in rows:
        if kind == "spent":
            totals[(account, label)] = WindowTotals(int(n1), int(n2), int(n3), int(n4), int(n5))
        elif kind == "held":
            held[(account, label)] = int(n1 or 0)
        elif n1 is not None:
            last = LastRequest(int(n1), None if int(n2) < 0 else int(n2))
    return _View(totals, held, last)


_NOTHING: Final = WindowTotals()


def _in_unit(budget: Budget, amount: int) -> Decimal:
    return Decimal(amount) / NANO if budget.unit == "usd" else Decimal(amount)


def _limit(budget: Budget) -> int:
    """The limit in the stored unit (tokens, or billionths of a dollar)."""
    return int(budget.amount * NANO) if budget.unit == "usd" else int(budget.amount)


def _spent(budget: Budget, totals: WindowTotals) -> int:
    return totals.nanousd if budget.unit == "usd" else totals.tokens


async def read_accounts(
    conn: Conn,
    pairs: Sequence[tuple[Budget, str]],
    *,
    now: datetime,
    staleness_seconds: float,
    exclude_session: int | None = None,
) -> list[Account]:
    """Each budget's account now: what its window spent and what other live turns hold."""
    if not pairs:
        return []
    keys = sorted({key for _, key in pairs})
    view = await _view(conn, keys, _wanted(pairs, keys), now, exclude_session, staleness_seconds)
    accounts = []
    for budget, key in pairs:
        totals = view.totals.get((key, budget.period), WindowTotals())
        held = view.held.get((key, budget.unit), 0)
        accounts.append(
            Account(
                budget,
                window(budget.period, now),
                _in_unit(budget, _spent(budget, totals)),
                _in_unit(budget, held),
            )
        )
    return accounts


@dataclass(frozen=True)
class _Plan:
    """What a claim under some budgets for one payer works out before any statement: the
    budgets that apply with their accounts, the accounts sorted (the order locks are taken in),
    their advisory-lock keys, and each budget's limit in its stored unit."""

    pairs: list[tuple[Budget, str]]
    keys: list[str]
    wanted: Wanted
    locks: dict[str, int]
    limits: list[tuple[Budget, str, int]]


@functools.lru_cache(maxsize=1024)
def _plan(budgets: tuple[Budget, ...], payer: Payer | None) -> _Plan:
    """Per budgets and payer, once (a person's turns reuse it)."""
    pairs = applicable(budgets, payer)
    keys = sorted({key for _, key in pairs})
    return _Plan(
        pairs,
        keys,
        _wanted(pairs, keys),
        {f"k{i}": lock_key(key) for i, key in enumerate(keys)},
        [(budget, key, _limit(budget)) for budget, key in pairs],
    )


class Reservation:
    """The budget check and reservation a turn's claim transaction runs (see the module), and
    again before each of the turn's later requests (``UsageLedger.extend``).

    ``text_tokens``: the new text the turn's first request adds to the conversation (an
    estimate, known at the claim). Once taken, ``session_id`` and ``token`` name the turn whose
    ledger rows lower it.
    """

    def __init__(
        self,
        budgets: Sequence[Budget],
        payer: Payer | None,
        *,
        staleness_seconds: float,
        clock: Callable[[], datetime],
    ) -> None:
        plan = _plan(tuple(budgets), payer)
        self.pairs = plan.pairs
        self.keys = plan.keys
        self._wanted = plan.wanted
        self._locks = plan.locks
        self._limits = plan.limits
        self.staleness_seconds = staleness_seconds
        self.clock = clock
        self.text_tokens = 0
        self.session_id: int | None = None
        self.token: str | None = None

    def rides(self, dialect: Dialect) -> bool:
        """Whether a claim on ``dialect`` carries this check inside its own statements: on
        PostgreSQL the claim takes the advisory locks (``claim``) and the user message's insert
        writes the reservation (``take_inserting``), so the check adds its read to the
        claim's transaction, not three round trips (docs/benchmarks.md, *The budget check at
        O(1)*); the claim stays a transaction (BEGIN, the claim, the read, the insert,
        COMMIT) where one without budgets is one statement."""
        return bool(self.pairs) and dialect.name == "postgresql"

    async def claim(self, conn: Conn, params: dict[str, Any], *, stamp: bool) -> str | None:
        """PostgreSQL: the claim (``core.storage.queries.claim``) taking the accounts' advisory
        locks as it returns its token. The locks are taken only when the claim succeeds, in
        the accounts' fixed order, after the session's row lock, as they were when they were a
        statement of their own; the read comes in a later statement, whose snapshot (READ
        COMMITTED) sees every reservation and ledger row the locks' earlier holders
        committed."""
        row = (await _CLAIM_LOCKING[stamp, len(self.keys)].run(conn, params | self._locks)).row
        return None if row is None else str(row[0])

    async def take(
        self,
        conn: Conn,
        session_id: int,
        token: str,
        *,
        during_turn: bool = False,
        locked: bool = False,
    ) -> None:
        """Refuse (``AgentSessionBudgetExceeded``, rolling the claim back) or reserve.
        ``locked``: the transaction holds the accounts' advisory locks already (``claim``)."""
        if not self.pairs:
            return
        params, rows = await self._decide(conn, session_id, token, during_turn, locked)
        await _HOLD[conn.dialect.name][rows].run(conn, params)
        self.session_id, self.token = session_id, token

    async def take_inserting(
        self, conn: Conn, session_id: int, token: str, message: dict[str, Any]
    ) -> int:
        """PostgreSQL, after ``claim`` (whose stale guard held): the check, then the user
        message inserted (``message``: ``core.storage.queries.user_params``) by the statement
        that writes the reservation. Returns the message's position. A refusal for the budget
        comes first, with nothing written."""
        params, rows = await self._decide(conn, session_id, token, False, True)
        row = (await _INSERT_HOLDING[rows].run(conn, message | params)).row
        assert row is not None  # an INSERT … SELECT of constants: one row
        self.session_id, self.token = session_id, token
        return int(row[0])

    async def _decide(
        self, conn: Conn, session_id: int, token: str, during_turn: bool, locked: bool
    ) -> tuple[dict[str, Any], int]:
        """The read and the decision: the hold's parameters and its number of rows, or the
        refusal."""
        keys = self.keys
        if conn.dialect.name == "postgresql" and not locked:
            await _LOCKS[len(keys)].all(conn, self._locks)
        now = self.clock()
        view = await _view(conn, keys, self._wanted, now, session_id, self.staleness_seconds)
        text = 0 if during_turn else self.text_tokens
        holds: dict[tuple[str, str], int] = {}
        for budget, key, limit in self._limits:
            totals = view.totals.get((key, budget.period), _NOTHING)
            others = view.held.get((key, budget.unit), 0)
            tokens = expected_tokens(view.last, totals, text)
            expected = (
                expected_nanousd(tokens, view.last, totals) if budget.unit == "usd" else tokens
            )
            left = limit - _spent(budget, totals) - others
            if not admits(left, expected, others):
                account = Account(
                    budget,
                    window(budget.period, now),
                    _in_unit(budget, _spent(budget, totals)),
                    _in_unit(budget, others),
                )
                raise refusal(account, during_turn=during_turn)
            amount = max(min(expected, left), 1)
            slot = (key, budget.unit)
            holds[slot] = min(holds.get(slot, amount), amount)
        params: dict[str, Any] = {"h_sid": session_id, "token": token, "at": now}
        for i, ((key, unit), amount) in enumerate(sorted(holds.items())):
            params.update({f"r{i}": key, f"u{i}": unit, f"n{i}": amount})
        return params, len(holds)


__all__ = ["NANO", "WINDOW_START", "Reservation", "applicable", "lock_key", "read_accounts"]

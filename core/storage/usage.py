"""The usage ledger: one row per model request, the running totals per budget account and
window kept with it, and the budget accounts read from those totals.

Every replica writes and reads the same rows, so they share one account per budget:

- ``record``: one model request, in its own short transaction (one statement on PostgreSQL), as
  soon as it ended: its row and the totals of its payer's accounts (``usage_totals``: the user,
  the workspace and everyone's, today's and this month's windows). A turn that dies later has
  still paid. A running turn's reservation counts what it has yet to spend: the claim's read
  subtracts the turn's rows written since it reserved, in the same statement that reads the
  totals, so a row is never seen both as spent and as still reserved, nor as neither.
- ``accounts``: for each budget that applies to a payer, what its window spent and what *other*
  running turns hold, from a few rows whatever the ledger's size.
- ``Reservation`` (``core.storage.reservations``): the check and reservation a claim runs; and
  ``extend``, the same step before each later request of a turn.

Windows are UTC days and months, cut by this process's clock (``clock``), which also stamps the
ledger row, so a request's row and the totals it was added to always agree on its window.
Dollar amounts are kept in billionths of a dollar (``NANO``): integers add exactly on both
databases, and a request's cost is rounded to that once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any, Final, Literal, cast

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Table,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite

from core.storage import advisory
from core.storage.dialect import ago
from core.storage.engine import Database
from core.storage.models import UsageRequest, UsageTotal
from core.storage.prepared import Prepared
from core.storage.reservations import (
    MOST_ACCOUNTS,
    NANO,
    WINDOW_START,
    Reservation,
    applicable,
    read_accounts,
)
from core.usage.budgets import Account, Budget, Payer, window
from core.usage.totals import RequestUsage

REQUESTS: Final = cast(Table, UsageRequest.__table__)
TOTALS: Final = cast(Table, UsageTotal.__table__)
PERIODS: Final = ("day", "month")
Clock = Callable[[], datetime]

Kind = Literal["answer", "compaction"]
GroupBy = Literal["user", "workspace", "model", "day"]


def nano_usd(amount: Decimal) -> int:
    return int((amount * NANO).to_integral_value(rounding=ROUND_HALF_EVEN))


def usd(nano: int | None) -> Decimal | None:
    return None if nano is None else Decimal(nano) / NANO


@dataclass(frozen=True)
class LedgerEntry:
    """One model request as the ledger keeps it.

    ``counted_tokens`` is what token budgets count: the provider's input + output, or an
    estimate when it reported none (``counts_estimated``).
    """

    request: RequestUsage
    kind: Kind
    counted_tokens: int
    counts_estimated: bool
    session_id: int | None = None
    message_id: str | None = None
    payer: Payer | None = None
    surface: str | None = None

    def row(self) -> dict[str, Any]:
        usage = self.request.usage
        cost = self.request.cost_usd
        return {
            "session_id": self.session_id,
            "message_id": self.message_id,
            "user_key": None if self.payer is None else self.payer.user,
            "workspace": None if self.payer is None else self.payer.workspace,
            "surface": self.surface,
            "kind": self.kind,
            "provider": self.request.provider,
            "model": self.request.model,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.cache_write_tokens,
            "counted_tokens": self.counted_tokens,
            "estimated": usage.estimated,
            "counts_estimated": self.counts_estimated,
            "cost_nanousd": None if cost is None else nano_usd(cost),
        }


@dataclass(frozen=True)
class UsageLine:
    """One line of ``slack-agent usage``: requests grouped by one key."""

    key: str
    requests: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    counted_tokens: int
    cost_usd: Decimal
    unreported: int  # requests whose provider reported no counts (counted by estimate)
    estimated: int  # requests whose counts are estimates (the offline model included)
    unpriced: int  # requests whose cost is unknown (not in cost_usd)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "counted_tokens": self.counted_tokens,
            "cost_usd": float(self.cost_usd),
            "requests_unreported": self.unreported,
            "requests_estimated": self.estimated,
            "requests_unpriced": self.unpriced,
        }


_LEDGER_COLUMNS: Final = (
    "session_id",
    "message_id",
    "user_key",
    "workspace",
    "surface",
    "kind",
    "provider",
    "model",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "cache_write_tokens",
    "counted_tokens",
    "estimated",
    "counts_estimated",
    "cost_nanousd",
    "created_at",
)
_AMOUNTS: Final = ("tokens", "nanousd", "output_tokens", "requests", "priced_requests")


def _row_insert() -> Any:
    return insert(REQUESTS).values(
        {column: bindparam(column, type_=REQUESTS.c[column].type) for column in _LEDGER_COLUMNS}
    )


def _totals_upsert(dialect: Any, accounts: int) -> Any:
    """``usage_totals`` rows of ``accounts`` accounts (``a0``…) in both periods, each raised by
    the request's amounts, in a fixed order (accounts sorted, day before month): concurrent
    writers lock the rows in one order and never deadlock."""
    start = WINDOW_START
    rows = [
        {
            "account": bindparam(f"a{i}", type_=TOTALS.c.account.type),
            "period": literal(period),
            "window_start": bindparam(period, type_=start),
            **{amount: bindparam(amount, type_=BigInteger) for amount in _AMOUNTS},
        }
        for i in range(accounts)
        for period in PERIODS
    ]
    upsert = dialect.insert(TOTALS).values(rows)
    return upsert.on_conflict_do_update(
        index_elements=["account", "period", "window_start"],
        set_={amount: TOTALS.c[amount] + upsert.excluded[amount] for amount in _AMOUNTS},
    )


# A request's bookkeeping, built once with bind parameters (``core.storage.prepared``): every
# turn writes at least one. On PostgreSQL the row and the totals are one statement (a
# data-modifying CTE: one round trip, atomic); on SQLite two in one transaction.
_RECORD_PG: Final = {
    n: Prepared(_totals_upsert(postgresql, n).add_cte(_row_insert().cte("recorded")))
    for n in range(1, MOST_ACCOUNTS + 1)
}
_RECORD_ROW: Final = Prepared(_row_insert())
_RECORD_TOTALS: Final = {
    n: Prepared(_totals_upsert(sqlite, n)) for n in range(1, MOST_ACCOUNTS + 1)
}


def accounts_of(payer: Payer | None) -> list[str]:
    """Every account a payer's request adds to (sorted: the order rows are locked in)."""
    found = ["all"]
    if payer is not None:
        found.append(f"user:{payer.user}")
        if payer.workspace is not None:
            found.append(f"workspace:{payer.workspace}")
    return sorted(found)


def _amounts(entry: LedgerEntry) -> dict[str, int]:
    cost = entry.request.cost_usd
    return {
        "tokens": entry.counted_tokens,
        "nanousd": 0 if cost is None else nano_usd(cost),
        "output_tokens": entry.request.usage.output_tokens or 0,
        "requests": 1,
        "priced_requests": 0 if cost is None else 1,
    }


class UsageLedger:
    """The ledger's statements (see the module)."""

    def __init__(
        self, db: Database, *, staleness_seconds: float, clock: Clock | None = None
    ) -> None:
        self._db = db
        self.staleness_seconds = staleness_seconds
        self.clock: Clock = clock or (lambda: datetime.now(UTC))

    async def record(self, entry: LedgerEntry) -> None:
        """One request: its row and its payer's totals, in one transaction."""
        now = self.clock()
        accounts = accounts_of(entry.payer)
        params: dict[str, Any] = {**entry.row(), "created_at": now, **_amounts(entry)}
        params.update({f"a{i}": account for i, account in enumerate(accounts)})
        params.update(day=window("day", now).start, month=window("month", now).start)
        async with self._db.autocommit() as conn:
            if conn.dialect.name == "postgresql":
                await _RECORD_PG[len(accounts)].run(conn, params)
                return
            await _RECORD_ROW.run(conn, params)
            await _RECORD_TOTALS[len(accounts)].run(conn, params)

    async def record_many(self, entries: Sequence[LedgerEntry]) -> None:
        """Several requests in one transaction, totals included (an import, the benchmark's
        set-up)."""
        if not entries:
            return
        now = self.clock()
        starts = {period: window(period, now).start for period in PERIODS}
        totals: dict[tuple[str, str], dict[str, int]] = {}
        for entry in entries:
            for account in accounts_of(entry.payer):
                for period in PERIODS:
                    total = totals.setdefault((account, period), dict.fromkeys(_AMOUNTS, 0))
                    for name, amount in _amounts(entry).items():
                        total[name] += amount
        async with self._db.write() as conn:
            await conn.execute(
                insert(REQUESTS), [{**entry.row(), "created_at": now} for entry in entries]
            )
            upsert = self._db.upsert(TOTALS)
            upsert = upsert.values(
                [
                    {"account": account, "period": period, "window_start": starts[period], **t}
                    for (account, period), t in sorted(totals.items())
                ]
            )
            await conn.execute(
                upsert.on_conflict_do_update(
                    index_elements=["account", "period", "window_start"],
                    set_={a: TOTALS.c[a] + upsert.excluded[a] for a in _AMOUNTS},
                )
            )

    def reservation(self, budgets: Sequence[Budget], payer: Payer | None) -> Reservation | None:
        """What a claim runs for ``payer`` under ``budgets`` (``None``: no budget applies)."""
        reservation = Reservation(
            budgets, payer, staleness_seconds=self.staleness_seconds, clock=self.clock
        )
        return reservation if reservation.pairs else None

    async def extend(self, reservation: Reservation) -> None:
        """Before a running turn's next request: the claim's step again, in a write transaction
        of its own (``AgentSessionBudgetExceeded`` with ``during_turn`` when the request's
        expected cost no longer fits, or nothing is left). On PostgreSQL one statement that
        tries the accounts' advisory locks itself when it can (``Reservation.extend_at_once``,
        as a claim's, and as rarely: ``advisory.AtOnce``), and otherwise a transaction that
        opens with them (``core.storage.advisory.locked``: BEGIN and the locks in one round
        trip), first, as a claim's does: the lock order of docs/design.md."""
        if reservation.session_id is None or reservation.token is None:
            return
        session_id, token = reservation.session_id, reservation.token
        if self._db.dialect == "postgresql" and reservation.pairs:
            if reservation.in_sql and await advisory.tried_at_once(
                self._db, lambda conn: reservation.extend_at_once(conn, session_id, token)
            ):
                return
            async with advisory.locked(self._db, reservation.lock_keys) as conn:
                await reservation.take(conn, session_id, token, during_turn=True)
            return
        async with self._db.write() as conn:
            await reservation.take(conn, session_id, token, during_turn=True)

    async def accounts(
        self,
        budgets: Sequence[Budget],
        payer: Payer | None,
        *,
        exclude_session: int | None = None,
        now: datetime | None = None,
    ) -> list[Account]:
        """The payer's accounts now; ``exclude_session``: leave out that running turn's own
        reservation."""
        pairs = applicable(budgets, payer)
        if not pairs:
            return []
        async with self._db.read() as conn:
            return await read_accounts(
                conn,
                pairs,
                now=now or self.clock(),
                staleness_seconds=self.staleness_seconds,
                exclude_session=exclude_session,
            )

    async def report(
        self,
        by: GroupBy,
        *,
        since: date | None = None,
        user_key: str | None = None,
        workspace: str | None = None,
    ) -> list[UsageLine]:
        """Requests grouped ``by`` user, workspace, model or day (UTC), since a day (UTC);
        ``user_key``: only that payer's (a person reading their own usage); ``workspace``: only
        those made in that Slack workspace (its admin reading everyone's there)."""
        async with self._db.read(large=True) as conn:
            key: ColumnElement[Any]
            if by == "user":
                key = func.coalesce(REQUESTS.c.user_key, "(none)")
            elif by == "workspace":
                key = func.coalesce(REQUESTS.c.workspace, "(none)")
            elif by == "model":
                key = REQUESTS.c.provider + literal("/") + REQUESTS.c.model
            elif conn.dialect.name == "postgresql":
                key = func.to_char(func.timezone("UTC", REQUESTS.c.created_at), "YYYY-MM-DD")
            else:
                key = func.substr(REQUESTS.c.created_at, 1, 10)
            key = key.label("key")

            def flag(condition: ColumnElement[bool]) -> ColumnElement[Any]:
                return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)

            query = select(
                key,
                func.count(),
                func.coalesce(func.sum(REQUESTS.c.input_tokens), 0),
                func.coalesce(func.sum(REQUESTS.c.output_tokens), 0),
                func.coalesce(func.sum(REQUESTS.c.cached_tokens), 0),
                func.coalesce(func.sum(REQUESTS.c.counted_tokens), 0),
                func.coalesce(func.sum(REQUESTS.c.cost_nanousd), 0),
                flag(REQUESTS.c.input_tokens.is_(None) | REQUESTS.c.output_tokens.is_(None)),
                flag(REQUESTS.c.estimated.cast(Boolean) | REQUESTS.c.counts_estimated),
                flag(REQUESTS.c.cost_nanousd.is_(None)),
            )
            if since is not None:
                start = datetime(since.year, since.month, since.day, tzinfo=UTC)
                query = query.where(REQUESTS.c.created_at >= start)
            if user_key is not None:
                query = query.where(REQUESTS.c.user_key == user_key)
            if workspace is not None:
                query = query.where(REQUESTS.c.workspace == workspace)
            query = query.group_by(key).order_by(key)
            rows: Sequence[Any] = (await conn.execute(query)).all()
        return [
            UsageLine(
                key=str(row[0]),
                requests=int(row[1]),
                input_tokens=int(row[2]),
                output_tokens=int(row[3]),
                cached_tokens=int(row[4]),
                counted_tokens=int(row[5]),
                cost_usd=Decimal(int(row[6])) / NANO,
                unreported=int(row[7]),
                estimated=int(row[8]),
                unpriced=int(row[9]),
            )
            for row in rows
        ]


__all__ = [
    "GroupBy",
    "LedgerEntry",
    "Reservation",
    "UsageLedger",
    "UsageLine",
    "accounts_of",
    "nano_usd",
    "usd",
]


# A window's totals are read only while it is current (a month at most); kept this long after
# it began, so the month before (and its last day) is still there for anyone looking.
TOTALS_KEPT_SECONDS: Final = 70 * 86400


async def sweep_totals(db: Database, _batch_size: int) -> int:
    """Sweeper pass: the running totals of windows long over (claims read and write only the
    current ones, so one statement takes them all without waiting on a turn; the ledger keeps
    every request for ``usage``)."""
    async with db.write() as conn:
        done = await conn.execute(
            delete(TOTALS).where(TOTALS.c.window_start < ago(TOTALS_KEPT_SECONDS))
        )
    return int(done.rowcount or 0)

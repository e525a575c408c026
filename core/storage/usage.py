"""The usage ledger: one row per model request, the budget accounts summed from it, and the
reservations running turns take at their claim.

Every replica writes and reads the same rows, so they share one account per budget. What the
statements guarantee:

- ``record``: one model request, in its own short transaction, as soon as its provider reported
  what it used (before the answer is stored: a turn that dies later has still paid).
- ``accounts``: for each budget that applies to a payer, what its window spent (tokens counted,
  or dollars of priced requests) and what *other* running turns hold reserved.
- ``Reservation.take``: inside a turn's claim transaction (``SessionStore.start_turn``), the
  decision and the reservation are one atomic step per account: on PostgreSQL under a
  transaction-level advisory lock per account (claims on different accounts never wait for
  each other), on SQLite under the write lock every write transaction already holds. A turn
  whose payer is over a limit is refused there, so its user message is rolled back with the
  claim and no model request is made. A reservation counts only while its turn holds the
  session's lock (same token, live heartbeat), so a turn that finishes, dies or loses its lock
  stops holding it without any further write.

How far concurrent turns can overshoot a budget (also in docs/design.md): a turn is admitted
only while spent + reserved < limit, and it holds ``min(RESERVATION_SHARE x limit, what is
left)`` until it ends; a turn makes each later request only while spent + the others'
reservations < limit. So the last bit of a budget admits exactly one turn (the first to claim
reserves all of it), and the most a budget can be overshot is one model request per turn
running when it ran out, with at most ``1 / RESERVATION_SHARE`` + 1 turns admitted at once
against one account near its end.

Dollar amounts are kept in billionths of a dollar (``NANO``): integers add exactly on both
databases, and a request's cost is rounded to that once.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any, Final, Literal, cast

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Table,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    select,
    text,
    true,
)

from core.storage.dialect import ago
from core.storage.engine import Conn, Database
from core.storage.models import AgentSession, UsageRequest, UsageReservation
from core.storage.prepared import Prepared
from core.usage.budgets import Account, Budget, Payer, account_key, decide, refusal, window
from core.usage.totals import RequestUsage

REQUESTS: Final = cast(Table, UsageRequest.__table__)
RESERVATIONS: Final = cast(Table, UsageReservation.__table__)
SESSIONS: Final = cast(Table, AgentSession.__table__)

NANO: Final = Decimal(1_000_000_000)
# What a turn reserves of each budget at its claim, as a share of the limit (capped at what is
# left): small enough that a shared budget admits about a hundred turns at once, large enough
# that the last bit of a budget admits one.
RESERVATION_SHARE: Final = Decimal("0.01")

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


def _applicable(budgets: Sequence[Budget], payer: Payer | None) -> list[tuple[Budget, str]]:
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


def _condition(key: str) -> ColumnElement[bool]:
    scope, _, name = key.partition(":")
    if scope == "user":
        return REQUESTS.c.user_key == name
    if scope == "workspace":
        return REQUESTS.c.workspace == name
    return true()


def _lock_key(account: str) -> int:
    """A stable signed 64-bit advisory-lock key for an account (every replica agrees)."""
    digest = hashlib.blake2b(f"usage:{account}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


async def _accounts(
    conn: Conn,
    pairs: Sequence[tuple[Budget, str]],
    *,
    staleness_seconds: float,
    now: datetime,
    exclude_session: int | None,
) -> list[Account]:
    if not pairs:
        return []
    windows = [window(budget.period, now) for budget, _ in pairs]
    columns = []
    for index, ((budget, key), span) in enumerate(zip(pairs, windows, strict=True)):
        amount = REQUESTS.c.counted_tokens if budget.unit == "tokens" else REQUESTS.c.cost_nanousd
        inside = and_(
            REQUESTS.c.created_at >= span.start,
            REQUESTS.c.created_at < span.end,
            _condition(key),
        )
        columns.append(func.coalesce(func.sum(case((inside, amount))), 0).label(f"b{index}"))
    earliest = min(span.start for span in windows)
    spent_row = (
        await conn.execute(select(*columns).where(REQUESTS.c.created_at >= earliest))
    ).one()

    keys = sorted({key for _, key in pairs})
    held = select(RESERVATIONS.c.account, RESERVATIONS.c.unit, func.sum(RESERVATIONS.c.amount))
    held = held.join(
        SESSIONS,
        and_(
            SESSIONS.c.id == RESERVATIONS.c.session_id,
            SESSIONS.c.lock_token == RESERVATIONS.c.lock_token,
        ),
    ).where(
        RESERVATIONS.c.account.in_(keys),
        SESSIONS.c.heartbeat_at >= ago(staleness_seconds),
    )
    if exclude_session is not None:
        held = held.where(RESERVATIONS.c.session_id != exclude_session)
    held = held.group_by(RESERVATIONS.c.account, RESERVATIONS.c.unit)
    held_rows: Sequence[Any] = (await conn.execute(held)).all()
    reserved = {(row[0], row[1]): int(row[2] or 0) for row in held_rows}

    accounts = []
    for index, ((budget, key), span) in enumerate(zip(pairs, windows, strict=True)):
        spent = int(spent_row[index] or 0)
        hold = reserved.get((key, budget.unit), 0)
        if budget.unit == "usd":
            accounts.append(Account(budget, span, Decimal(spent) / NANO, Decimal(hold) / NANO))
        else:
            accounts.append(Account(budget, span, Decimal(spent), Decimal(hold)))
    return accounts


class Reservation:
    """The budget check and reservation a turn's claim transaction runs (see the module)."""

    def __init__(
        self, budgets: Sequence[Budget], payer: Payer | None, *, staleness_seconds: float
    ) -> None:
        self.pairs = _applicable(budgets, payer)
        self.staleness_seconds = staleness_seconds

    async def take(self, conn: Conn, session_id: int, token: str) -> None:
        """Refuse (``AgentSessionBudgetExceeded``, rolling the claim back) or reserve."""
        if not self.pairs:
            return
        if conn.dialect.name == "postgresql":
            for key in sorted({key for _, key in self.pairs}):
                await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _lock_key(key)})
        await conn.execute(delete(RESERVATIONS).where(RESERVATIONS.c.session_id == session_id))
        accounts = await _accounts(
            conn,
            self.pairs,
            staleness_seconds=self.staleness_seconds,
            now=datetime.now(UTC),
            exclude_session=session_id,
        )
        refused = decide(accounts)
        if refused is not None:
            raise refusal(refused)
        rows = []
        for (_, key), account in zip(self.pairs, accounts, strict=True):
            budget = account.budget
            left = budget.amount - account.used
            share = Decimal(math.ceil(budget.amount * RESERVATION_SHARE))
            if budget.unit == "usd":
                share = budget.amount * RESERVATION_SHARE
            amount = min(share, left)
            units = nano_usd(amount) if budget.unit == "usd" else math.ceil(amount)
            rows.append(
                {
                    "session_id": session_id,
                    "lock_token": token,
                    "account": key,
                    "unit": budget.unit,
                    "amount": max(units, 1),
                }
            )
        await conn.execute(insert(RESERVATIONS), rows)


# A model request's row, built once with bind parameters (``core.storage.prepared``): every turn
# writes at least one.
_RECORD_REQUEST: Final = Prepared(
    insert(REQUESTS).values(
        {
            column: bindparam(column, type_=REQUESTS.c[column].type)
            for column in (
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
            )
        }
    )
)


class UsageLedger:
    """The ledger's statements (see the module)."""

    def __init__(self, db: Database, *, staleness_seconds: float) -> None:
        self._db = db
        self.staleness_seconds = staleness_seconds

    async def record(self, entry: LedgerEntry) -> None:
        row = entry.row()
        async with self._db.autocommit() as conn:
            await _RECORD_REQUEST.run(conn, row)

    async def record_many(self, entries: Sequence[LedgerEntry]) -> None:
        """Several requests in one transaction (an import, the benchmark's set-up)."""
        if entries:
            async with self._db.write() as conn:
                await conn.execute(insert(REQUESTS), [entry.row() for entry in entries])

    def reservation(self, budgets: Sequence[Budget], payer: Payer | None) -> Reservation | None:
        """What a claim runs for ``payer`` under ``budgets`` (``None``: no budget applies)."""
        reservation = Reservation(budgets, payer, staleness_seconds=self.staleness_seconds)
        return reservation if reservation.pairs else None

    async def accounts(
        self,
        budgets: Sequence[Budget],
        payer: Payer | None,
        *,
        exclude_session: int | None = None,
        now: datetime | None = None,
    ) -> list[Account]:
        """The payer's accounts now; ``exclude_session``: leave out that running turn's own
        reservation (a turn checking whether it may make its next request)."""
        pairs = _applicable(budgets, payer)
        if not pairs:
            return []
        async with self._db.read() as conn:
            return await _accounts(
                conn,
                pairs,
                staleness_seconds=self.staleness_seconds,
                now=now or datetime.now(UTC),
                exclude_session=exclude_session,
            )

    async def report(
        self, by: GroupBy, *, since: date | None = None, user_key: str | None = None
    ) -> list[UsageLine]:
        """Requests grouped ``by`` user, workspace, model or day (UTC), since a day (UTC);
        ``user_key``: only that payer's (a person reading their own usage)."""
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
    "RESERVATION_SHARE",
    "GroupBy",
    "LedgerEntry",
    "Reservation",
    "UsageLedger",
    "UsageLine",
    "nano_usd",
    "usd",
]

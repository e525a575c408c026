"""The budget check a claim runs, in O(1): the payer's running totals (``usage_totals``), the
other live turns' reservations and the session's last request, read in one prepared statement;
the decision (``core.usage.budgets.admits``); the turn's reservation written, one row per turn
(migration 0010). The rules are written in SQL once (``_admission``), so that at a claim the
three are one statement: on SQLite an ``INSERT … SELECT`` that writes the row only when every
budget admits the turn (``_admitting``), on PostgreSQL the claim's own statement, which also
claims the session and inserts the user message (``_claim_admitting``); a claim it does not
admit takes the read and the rules in Python, which word the refusal.

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
  account, taken before any row lock: waited for in one statement, in a fixed order, as the
  transaction's first statement, ``core.storage.advisory``; or only tried, by the step's one
  statement, ``_claim_at_once`` and ``_extending_at_once``, which admit only on a snapshot as
  good as one taken after them; claims on different accounts never wait for each other;
  docs/design.md argues the lock order), on SQLite under the write lock every write
  transaction holds. A claim with no budget to check is one statement, with no transaction.
  The read is one statement, so it sees the totals, the reservations and the rows that use
  them up of one moment.
- A reservation counts only while its turn holds the session's lock (same token, live
  heartbeat): a turn that ends, dies or loses its lock stops holding it without another write,
  and the statement that releases or takes over the lock deletes its row (a trigger of
  migration 0007), so a claim scans only the reservations of live turns (and of dead turns
  whose session nobody has claimed since): every one of them, with no index but the session,
  as an ``all`` budget's lookup did anyway.
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
    Select,
    Table,
    Text,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import IntegrityError

from core.storage.dialect import UtcDateTime, db_now, greater_of, lesser_of
from core.storage.engine import Conn
from core.storage.models import (
    AgentSession,
    AgentSessionMessage,
    UsageRequest,
    UsageReservation,
    UsageTotal,
)
from core.storage.prepared import Prepared
from core.storage.queries import (
    claimed_cte,
    insert_claimed,
    insert_next_statement,
    message_integrity_error,
)
from core.usage.budgets import (
    DEFAULT_INPUT_TOKENS,
    DEFAULT_OUTPUT_TOKENS,
    SCOPES,
    Account,
    Budget,
    LastRequest,
    Payer,
    Period,
    Scope,
    Unit,
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
# A limit the admitting statements take (in tokens or billionths of a dollar): below it what is
# left stays inside 64 bits, where PostgreSQL's arithmetic works (a greater one, over nine
# billion dollars, is decided in Python).
SQL_LIMIT: Final = 2**62


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


# -- the statements, one shape per pattern of budgets (built once, prepared) ---------------------


Wanted = tuple[tuple[int, Period], ...]  # (account's index in the sorted keys, period), sorted
Slot = tuple[Scope, Unit]  # what a turn holds: one account of its payer's, in one unit
Slots = tuple[Slot, ...]  # sorted
SLOTS: Final[Slots] = tuple(sorted((scope, unit) for scope in SCOPES for unit in ("tokens", "usd")))


def _column(slot: Slot) -> str:
    """The reservation's column for a slot: ``user_tokens``, ``all_nanousd``…"""
    scope, unit = slot
    return f"{scope}_{'tokens' if unit == 'tokens' else 'nanousd'}"


def _wanted(pairs: Sequence[tuple[Budget, str]], keys: Sequence[str]) -> Wanted:
    """The (account, period) totals some budget of ``pairs`` reads: only those are read."""
    return tuple(sorted({(keys.index(key), budget.period) for budget, key in pairs}))


def _slots(pairs: Sequence[tuple[Budget, str]]) -> Slots:
    """The (scope, unit) some budget of ``pairs`` limits: what a turn holds and reads held."""
    return tuple(sorted({(budget.scope, budget.unit) for budget, _ in pairs}))


def _zero() -> ColumnElement[Any]:
    return literal_column("0")


def _none() -> ColumnElement[Any]:
    return literal_column("''")


def _spent_since(unit: Unit) -> ColumnElement[Any]:
    """What a reserving turn has spent in ``unit`` since it reserved: its session's ledger rows
    written since (a session runs one turn at a time; both times are the writing process's
    clock). Correlated to the reservation's row."""
    amount = REQUESTS.c.counted_tokens if unit == "tokens" else REQUESTS.c.cost_nanousd
    return (
        select(func.coalesce(func.sum(amount), _zero()))
        .where(
            REQUESTS.c.session_id == RESERVATIONS.c.session_id,
            REQUESTS.c.created_at >= RESERVATIONS.c.created_at,
        )
        .scalar_subquery()
    )


def _held(slot: Slot) -> ColumnElement[Any]:
    """What other live turns hold on the claiming payer's account of ``slot`` and have yet to
    spend: their amounts less what their sessions spent since, never below nothing. A user or
    workspace slot counts the turns of the same account (``user``, ``workspace``: the payer's);
    ``all`` counts every turn."""
    scope, unit = slot
    amount = RESERVATIONS.c[_column(slot)]
    unspent: ColumnElement[Any] = greater_of(amount - _spent_since(unit), _zero())
    if scope != "all":
        owner = RESERVATIONS.c[f"{scope}_account"]
        unspent = case((owner == bindparam(scope, type_=owner.type), unspent))
    return sa_cast(func.coalesce(func.sum(unspent), _zero()), BigInteger)


SPENT, HELD, LAST = 0, 1, 2  # the kind of a row of the read


def _of_other_live_turns(query: Select[Any], session: str) -> Select[Any]:
    """``query`` over the reservation rows of live turns other than ``session``'s (a bound
    parameter's name): a row counts while its turn holds its session's lock (the same token)
    with a heartbeat inside the window (``since``, seconds before now, negative)."""
    return (
        query.select_from(RESERVATIONS)
        .join(
            SESSIONS,
            and_(
                SESSIONS.c.id == RESERVATIONS.c.session_id,
                SESSIONS.c.lock_token == RESERVATIONS.c.lock_token,
            ),
        )
        .where(
            RESERVATIONS.c.session_id != bindparam(session, type_=BigInteger),
            SESSIONS.c.heartbeat_at >= db_now(bindparam("since", type_=Float)),
        )
    )


def _window(totals: Any, account: ColumnElement[Any], period: str) -> ColumnElement[Any]:
    """The row of ``totals`` (``usage_totals`` or an alias of it) that is ``account``'s window
    ``period`` (``day``, ``month``) starting at the bound parameter of that name, by its whole
    key, so each is one lookup of the primary key however many windows an account has behind
    it. The read selects these rows, SQLite's admission outer-joins each: the same rows."""
    return and_(
        totals.c.account == account,
        totals.c.period == literal_column(f"'{period}'"),
        totals.c.window_start == bindparam(period, type_=WINDOW_START),
    )


def _last_request(session: str) -> Select[Any]:
    """The newest model request of the session ``session`` (a bound parameter's name): what
    the next one is expected to cost is priced from it (``core.usage.budgets``)."""
    return (
        select(REQUESTS.c.counted_tokens, REQUESTS.c.cost_nanousd)
        .where(REQUESTS.c.session_id == bindparam(session, type_=BigInteger))
        .order_by(REQUESTS.c.created_at.desc(), REQUESTS.c.id.desc())
        .limit(literal_column("1"))
        .offset(_zero())
    )


@functools.cache
def _read(accounts: int, wanted: Wanted, slots: Slots) -> Prepared:
    """The totals of the ``wanted`` accounts (``a0``…) and windows (today's, ``day``; this
    month's, ``month``), what the other live turns hold on the payer's accounts of the
    ``slots`` (one row, a column per slot, in order; the user's and workspace's accounts as
    ``user`` and ``workspace``), and the session's last request: one statement, so one
    moment's view, whatever commits meanwhile. One shape per pattern of budgets (a handful in
    any deployment), built and prepared at its first use. Its constants are written into the
    SQL, not bound: a bound one is a parameter processed at every run."""
    names = [bindparam(f"a{i}", type_=TOTALS.c.account.type) for i in range(accounts)]
    width = max(len(slots), 5)
    spent = select(
        literal_column(str(SPENT)).label("kind"),
        TOTALS.c.account.label("account"),
        TOTALS.c.period.label("label"),
        TOTALS.c.tokens.label("n1"),
        TOTALS.c.nanousd.label("n2"),
        TOTALS.c.output_tokens.label("n3"),
        TOTALS.c.requests.label("n4"),
        TOTALS.c.priced_requests.label("n5"),
        *(_zero().label(f"n{i + 1}") for i in range(5, width)),
    ).where(or_(*(_window(TOTALS, names[index], period) for index, period in wanted)))
    # Every live turn's one row: the table holds only running turns' (and dead turns' whose
    # session nobody has claimed since), which the ``all`` account counts in any case.
    held = _of_other_live_turns(
        select(
            literal_column(str(HELD)),
            _none(),
            _none(),
            *(_held(slot) for slot in slots),
            *(_zero() for _ in range(len(slots), width)),
        ),
        "sid",
    )
    newest = _last_request("sid").subquery()
    last = select(
        literal_column(str(LAST)),
        _none(),
        _none(),
        newest.c.counted_tokens,
        func.coalesce(newest.c.cost_nanousd, literal_column("-1")),
        *(_zero() for _ in range(2, width)),
    )
    return Prepared(union_all(spent, held, last))


_HOLD_COLUMNS: Final = (
    "session_id",
    "lock_token",
    "created_at",
    "user_account",
    "workspace_account",
    *(_column(slot) for slot in SLOTS),
)


def _in_place(upsert: Any) -> Insert:
    """A reservation's insert (``dialect.insert(RESERVATIONS)`` of every column) replacing its
    session's earlier row in place (an earlier turn's, or this turn's own before a later
    request): no delete first."""
    return cast(
        Insert,
        upsert.on_conflict_do_update(
            index_elements=["session_id"],
            set_={name: upsert.excluded[name] for name in _HOLD_COLUMNS[1:]},
        ),
    )


def _hold(dialect: Any) -> Insert:
    """The turn's reservation, one row, in place (``_in_place``). Every column is written, a
    slot no budget limits as NULL."""
    return _in_place(
        dialect.insert(RESERVATIONS).values(
            {
                name: bindparam(f"h_{name}", type_=RESERVATIONS.c[name].type)
                for name in _HOLD_COLUMNS
            }
        )
    )


def _insert_holding() -> Prepared:
    """The user message's insert (after the claim, which ran the stale guard) with the
    reservation's upsert as a CTE of it."""
    held = _hold(postgresql).cte("held")
    return Prepared(insert_next_statement().add_cte(held).returning(MESSAGES.c.position))


Term = tuple[int, Unit, Slot]  # a budget to admit: its totals' index in Wanted, unit, slot
Terms = tuple[Term, ...]


def _number(value: int) -> ColumnElement[Any]:
    return literal_column(str(int(value)))


def _expected_and_spent(
    t: Any, last: Any, text: ColumnElement[Any], unit: Unit, *, bounded: bool = False
) -> tuple[ColumnElement[Any], ColumnElement[Any]]:
    """``expected_tokens`` and ``expected_nanousd`` (``core.usage.budgets``) in SQL, over one
    window's totals (``t``, a LEFT JOIN: NULL when the window has no row) and the session's
    last request (``last``, likewise), and what the window spent, in ``unit``. Integer division
    is SQLite's (whole numbers, all of them at least 0: the same as Python's ``//``); the
    price per token's ceiling is taken as ``q·tokens + ⌈r·tokens / counted⌉`` (``q``, ``r``:
    the last cost's quotient and remainder by its tokens), which is exact wherever the result
    fits in 64 bits, where the product ``cost·tokens`` of Python's could overflow SQLite's.

    ``bounded`` (PostgreSQL, whose ``bigint`` arithmetic raises on overflow where SQLite's
    turns to REAL): where a factor of that product is 2³¹ or more the expected cost is NULL,
    which admits nothing, so Python's rules, which have no such limit, decide."""
    known = last.c.counted_tokens.is_not(None)
    requests = func.coalesce(t.c.requests, _zero())
    output = case(
        (requests > _zero(), t.c.output_tokens // requests),
        else_=_number(DEFAULT_OUTPUT_TOKENS),
    )
    sent = case(
        (known, last.c.counted_tokens),
        (requests > _zero(), greater_of(t.c.tokens - t.c.output_tokens, _zero()) // requests),
        else_=_number(DEFAULT_INPUT_TOKENS),
    )
    tokens = sent + text + output
    if unit == "tokens":
        return tokens, func.coalesce(t.c.tokens, _zero())
    cost, counted = last.c.cost_nanousd, last.c.counted_tokens
    priced = func.coalesce(t.c.priced_requests, _zero())
    per_token = and_(known, cost.is_not(None), counted > _zero())
    exact = (cost // counted) * tokens + (
        (cost % counted) * tokens + counted - _number(1)
    ) // counted
    whens: list[tuple[ColumnElement[bool], ColumnElement[Any]]] = []
    if bounded:
        big = _number(2**31)
        fits = and_(counted < big, tokens < big, cost // counted < big)
        whens.append((and_(per_token, ~fits), null()))
    whens += [(per_token, exact), (priced > _zero(), t.c.nanousd // priced)]
    expected = case(*whens, else_=_zero())
    return expected, func.coalesce(t.c.nanousd, _zero())


@dataclass(frozen=True)
class _Admission:
    """The rules in SQL (``_admission``): the reservation's columns (``values``, by name), read
    from ``source`` where ``admitted`` holds, in one row or none."""

    values: dict[str, ColumnElement[Any]]
    source: Any
    admitted: ColumnElement[bool]


def _admission(
    accounts: int, wanted: Wanted, slots: Slots, terms: Terms, *, bounded: bool
) -> _Admission:
    """``core.usage.budgets`` (``expected_tokens``, ``expected_nanousd``, ``admits``) and
    ``Reservation._decide`` in SQL, on the values ``_read`` reads (``terms``: per budget, in
    the plan's order, its totals' index in ``wanted``, its unit and its slot; its limit is
    ``l0``…): the reservation's row, one, when every budget admits the turn, and none
    otherwise. ``bounded``: PostgreSQL's (``_expected_and_spent``). Both databases' admitting
    statements are built on it, so the rules are written in SQL once."""
    names = [bindparam(f"a{i}", type_=TOTALS.c.account.type) for i in range(accounts)]
    held = _of_other_live_turns(
        select(*(_held(slot).label(f"h{k}") for k, slot in enumerate(slots))), "h_session_id"
    ).subquery("held")
    last = _last_request("h_session_id").subquery("last")
    joined: Any = held
    totals = []
    for w, (index, period) in enumerate(wanted):
        t = TOTALS.alias(f"t{w}")
        totals.append(t)
        joined = joined.outerjoin(t, _window(t, names[index], period))
    joined = joined.outerjoin(last, literal_column("1") == literal_column("1"))
    text = bindparam("text", type_=BigInteger)
    admitted: list[ColumnElement[Any]] = []
    amounts: dict[Slot, list[ColumnElement[Any]]] = {}
    for i, (w, unit, slot) in enumerate(terms):
        expected, spent = _expected_and_spent(totals[w], last, text, unit, bounded=bounded)
        others = held.c[f"h{slots.index(slot)}"]
        left = bindparam(f"l{i}", type_=BigInteger) - spent - others
        if bounded and unit == "usd":  # its expected cost is NULL where it would overflow
            admitted.append(expected.is_not(None))
        admitted.append(and_(left > _zero(), or_(expected <= left, others == _zero())))
        amounts.setdefault(slot, []).append(greater_of(lesser_of(expected, left), _number(1)))
    values: dict[str, ColumnElement[Any]] = {
        name: bindparam(f"h_{name}", type_=RESERVATIONS.c[name].type) for name in _HOLD_COLUMNS[:5]
    }
    for slot in SLOTS:
        found = amounts.get(slot)
        column = _column(slot)
        if not found:
            values[column] = sa_cast(null(), BigInteger) if bounded else literal_column("NULL")
        else:
            values[column] = found[0] if len(found) == 1 else lesser_of(*found)
    return _Admission(values, joined, and_(*admitted))


def _locks_gate(accounts: int) -> ColumnElement[bool]:
    """PostgreSQL: the accounts' advisory locks (``k0``…) tried, never waited on, and true
    only if all were taken and no transaction ended between the statement's snapshot and a
    snapshot taken after them (``usage_locked_snapshot``, migration 0013): then the
    statement's reads saw what every earlier holder of the locks committed."""
    tried = and_(
        *(
            func.pg_try_advisory_xact_lock(bindparam(f"k{i}", type_=BigInteger))
            for i in range(accounts)
        )
    )
    return func.usage_locked_snapshot(tried) == sa_cast(func.pg_current_snapshot(), Text)


@functools.cache
def _admitting(accounts: int, wanted: Wanted, slots: Slots, terms: Terms) -> Prepared:
    """SQLite: the read, the decision and the reservation in one statement, an ``INSERT …
    SELECT`` of ``_admission``'s row, so a claim within its budgets runs one statement where
    it ran two, and no Python over the rows read. A claim it does not admit goes the ordinary
    way (``_read`` and the rules in Python), which words the refusal; that way also decides
    whenever the two would differ, so this statement is only ever a faster route to what the
    rules admit (``tests/test_budget_reservations.py`` holds them equal around every budget's
    edge)."""
    return Prepared(_reserving(sqlite, accounts, wanted, slots, terms))


@functools.cache
def _extending_at_once(accounts: int, wanted: Wanted, slots: Slots, terms: Terms) -> Prepared:
    """PostgreSQL: a running turn's later request's step (``UsageLedger.extend``) as
    ``_admitting``'s one statement, the accounts' advisory locks tried in it as a claim's
    (``_claim_at_once``, ``_locks_gate``): one autocommitted round trip where the waiting way
    takes four (BEGIN and the locks, the read, the reservation, COMMIT). It writes nothing when
    it cannot decide so, and the caller takes the waiting way, which words a refusal."""
    return Prepared(_reserving(postgresql, accounts, wanted, slots, terms, _locks_gate(accounts)))


def _reserving(
    dialect: Any, accounts: int, wanted: Wanted, slots: Slots, terms: Terms, gate: Any = None
) -> Insert:
    """``_admission``'s row inserted, or put in place of the session's earlier one, where every
    budget admits the turn (and ``gate`` holds, when given)."""
    rules = _admission(accounts, wanted, slots, terms, bounded=dialect is postgresql)
    chosen = select(*(value.label(name) for name, value in rules.values.items()))
    where = rules.admitted if gate is None else and_(gate, rules.admitted)
    return _in_place(
        dialect.insert(RESERVATIONS).from_select(
            list(rules.values), chosen.select_from(rules.source).where(where)
        )
    )


def _claiming(
    stamp: bool, accounts: int, wanted: Wanted, slots: Slots, terms: Terms, gate: Any = None
) -> Insert:
    """The claim, the admission, the reservation and the user message as one statement (see
    ``_claim_admitting``); ``gate``, when given, a further condition of the admission."""
    rules = _admission(accounts, wanted, slots, terms, bounded=True)
    admitted = (
        select(*(v.label(n) for n, v in rules.values.items() if n != "lock_token"))
        .select_from(rules.source)
        .where(rules.admitted if gate is None else and_(gate, rules.admitted))
        .cte("admitted")
    )
    claimed = claimed_cte(
        stamp=stamp, only_if=select(literal_column("1")).select_from(admitted).exists()
    )
    columns = [
        claimed.c.lock_token if name == "lock_token" else admitted.c[name] for name in rules.values
    ]
    held = _in_place(
        postgresql.insert(RESERVATIONS).from_select(
            list(rules.values), select(*columns).select_from(admitted.join(claimed, true()))
        )
    ).cte("held")
    return insert_claimed(claimed).add_cte(held)


@functools.cache
def _claim_admitting(
    stamp: bool, accounts: int, wanted: Wanted, slots: Slots, terms: Terms
) -> Prepared:
    """PostgreSQL: the claim, the budget's admission, the reservation and the user message in
    one statement, run under the accounts' advisory locks taken by an earlier statement of
    its transaction (``core.storage.advisory``), so its snapshot sees what every earlier
    holder of those locks committed. ``_admission``'s row (none when a budget does not admit
    the turn) is a CTE; the claim (``queries.claimed_cte``) holds only if that row exists; the
    reservation is written from the two (its token is the claim's); the user message is
    inserted from the claim (``queries.insert_claimed``). Nothing is written unless the claim
    and every budget hold; the caller then goes the ordinary way, which says which refused.

    The reservation's upsert may replace this session's row of an earlier turn in place; the
    trigger that deletes a replaced token's row (migration 0007) fires at the statement's end
    and deletes rows of the old token only, so it leaves the new one."""
    return Prepared(_claiming(stamp, accounts, wanted, slots, terms))


@functools.cache
def _claim_at_once(
    stamp: bool, accounts: int, wanted: Wanted, slots: Slots, terms: Terms
) -> Prepared:
    """PostgreSQL: ``_claim_admitting`` taking the accounts' advisory locks itself, one
    autocommitted statement: one round trip where the waiting way (``advisory.locked``) takes
    three. READ COMMITTED took its snapshot before it takes the locks, so it admits only
    when ``_locks_gate`` holds: every lock taken at once, and the snapshot as good as one
    taken after them. Otherwise (a lock held elsewhere, a transaction ended meanwhile) it
    writes nothing and the caller takes the waiting way, which also words any refusal. It
    never waits on the locks, so a caller cancelled meanwhile leaves nothing behind that the
    waiting way's rollback would have undone (it can wait on the session's row, as the claim
    without budgets does)."""
    return Prepared(_claiming(stamp, accounts, wanted, slots, terms, _locks_gate(accounts)))


_HOLD: Final = {"postgresql": Prepared(_hold(postgresql)), "sqlite": Prepared(_hold(sqlite))}
_INSERT_HOLDING: Final = _insert_holding()


@dataclass(frozen=True)
class _View:
    totals: dict[tuple[str, str], WindowTotals]  # (account, period)
    held: dict[Slot, int]  # what other live turns hold on the payer's accounts
    last: LastRequest | None


async def _view(
    conn: Conn,
    keys: Sequence[str],
    wanted: Wanted,
    slots: Slots,
    owners: dict[str, str],
    now: datetime,
    session_id: int | None,
    staleness: float,
) -> _View:
    """``owners``: the payer's user and workspace accounts (``user``, ``workspace``) that some
    slot names."""
    params: dict[str, Any] = {f"a{i}": key for i, key in enumerate(keys)}
    params.update(owners)
    for _, period in wanted:
        if period not in params:
            params[period] = window(period, now).start
    params["sid"] = -1 if session_id is None else session_id
    params["since"] = -float(staleness)
    rows = await _read(len(keys), wanted, slots).all(conn, params)
    totals: dict[tuple[str, str], WindowTotals] = {}
    held: dict[Slot, int] = {}
    last: LastRequest | None = None
    for kind, account, label, n1, n2, n3, n4, n5, *_more in rows:
        if kind == SPENT:
            totals[(account, label)] = WindowTotals(int(n1), int(n2), int(n3), int(n4), int(n5))
        elif kind == HELD:
            held = dict(zip(slots, map(int, (n1, n2, n3, n4, n5, *_more)), strict=False))
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


def _owners(pairs: Sequence[tuple[Budget, str]]) -> dict[str, str]:
    """The payer's user and workspace accounts its budgets name (``user``, ``workspace``)."""
    return {budget.scope: key for budget, key in pairs if budget.scope != "all"}


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
    view = await _view(
        conn,
        keys,
        _wanted(pairs, keys),
        _slots(pairs),
        _owners(pairs),
        now,
        exclude_session,
        staleness_seconds,
    )
    accounts = []
    for budget, key in pairs:
        totals = view.totals.get((key, budget.period), WindowTotals())
        held = view.held.get((budget.scope, budget.unit), 0)
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
    the totals and slots read, the payer's accounts the slots name, their advisory-lock keys,
    each budget's limit in its stored unit, and the reservation's columns that stay the same
    from turn to turn (its accounts, and NULL for every slot no budget limits)."""

    pairs: list[tuple[Budget, str]]
    keys: list[str]
    wanted: Wanted
    slots: Slots
    owners: dict[str, str]
    locks: dict[str, int]
    limits: list[tuple[Budget, str, Slot, int]]
    hold: dict[str, Any]
    admitting: Prepared
    extending: Prepared  # PostgreSQL's later request's step, trying the locks itself
    claiming: dict[bool, Prepared]  # PostgreSQL's, by whether the claim stamps the model
    at_once: dict[bool, Prepared]  # likewise, trying the locks itself (``_claim_at_once``)
    admit: dict[str, Any]  # the admitting statements' parameters that stay the same
    in_sql: bool  # the admitting statements may decide (every limit well inside 64 bits)


@functools.lru_cache(maxsize=1024)
def _plan(budgets: tuple[Budget, ...], payer: Payer | None) -> _Plan:
    """Per budgets and payer, once (a person's turns reuse it)."""
    pairs = applicable(budgets, payer)
    keys = sorted({key for _, key in pairs})
    owners = _owners(pairs)
    hold: dict[str, Any] = {f"h_{_column(slot)}": None for slot in SLOTS}
    hold["h_user_account"] = owners.get("user")
    hold["h_workspace_account"] = owners.get("workspace")
    wanted = _wanted(pairs, keys)
    slots = _slots(pairs)
    terms = tuple(
        (wanted.index((keys.index(key), budget.period)), budget.unit, (budget.scope, budget.unit))
        for budget, key in pairs
    )
    admit: dict[str, Any] = {f"a{i}": key for i, key in enumerate(keys)}
    admit.update(owners)
    admit.update({f"l{i}": _limit(budget) for i, (budget, _) in enumerate(pairs)})
    admit["h_user_account"] = hold["h_user_account"]
    admit["h_workspace_account"] = hold["h_workspace_account"]
    return _Plan(
        pairs,
        keys,
        wanted,
        slots,
        owners,
        {f"k{i}": lock_key(key) for i, key in enumerate(keys)},
        [(budget, key, (budget.scope, budget.unit), _limit(budget)) for budget, key in pairs],
        hold,
        _admitting(len(keys), wanted, slots, terms),
        _extending_at_once(len(keys), wanted, slots, terms),
        {
            stamp: _claim_admitting(stamp, len(keys), wanted, slots, terms)
            for stamp in (False, True)
        },
        {stamp: _claim_at_once(stamp, len(keys), wanted, slots, terms) for stamp in (False, True)},
        admit,
        all(_limit(budget) < SQL_LIMIT for budget, _ in pairs),
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
        self._plan = plan
        self.staleness_seconds = staleness_seconds
        self.clock = clock
        self.text_tokens = 0
        self.session_id: int | None = None
        self.token: str | None = None

    @property
    def in_sql(self) -> bool:
        """Whether these budgets' rules run in SQL (limits the database's integers hold): the
        steps that can go at once (``claim_admitting``'s ``at_once``, ``extend_at_once``)."""
        return self._plan.in_sql

    @property
    def lock_keys(self) -> list[int]:
        """PostgreSQL: the accounts' advisory-lock keys, in the accounts' sorted order, the one
        order every holder takes them in (``core.storage.advisory.locked``)."""
        return list(self._plan.locks.values())

    async def claim_admitting(
        self, conn: Conn, params: dict[str, Any], *, stamp: bool, at_once: bool = False
    ) -> tuple[str, int] | None:
        """PostgreSQL: the claim (``params``: ``core.storage.queries``'s, the user message's
        included), the admission, the reservation and the user message in one statement: the
        token and the message's position, or None when it wrote nothing (the claim or a budget
        refused, or the rules are Python's to apply).

        Under the accounts' advisory locks (``core.storage.advisory.locked``:
        ``_claim_admitting``), the caller then goes the ordinary way, in the same transaction,
        which says which. ``at_once``: on a connection outside any transaction
        (``Database.autocommit``), the statement that tries the locks itself
        (``_claim_at_once``), which also writes nothing when a lock was held elsewhere or a
        transaction ended while it took them; the caller then takes the waiting way."""
        plan = self._plan
        row = None
        if plan.in_sql:
            session_id = int(params["sid"])
            run = params | self._admit_params(session_id, "", False)
            statement = plan.at_once[stamp] if at_once else plan.claiming[stamp]
            try:
                row = (await statement.run(conn, run | plan.locks if at_once else run)).row
            except IntegrityError as exc:
                raise message_integrity_error(exc) from exc
        if row is None:
            return None
        token = str(row[1])
        self.session_id, self.token = session_id, token
        return token, int(row[0])

    async def extend_at_once(self, conn: Conn, session_id: int, token: str) -> bool:
        """PostgreSQL, on a connection outside any transaction: a running turn's later
        request's step with the accounts' locks tried in the same statement
        (``_extending_at_once``); False when it wrote nothing (a lock was held elsewhere, a
        transaction ended while it took them, a budget refused, or the rules are Python's to
        apply): the caller then takes the waiting way, which reserves or says why not."""
        plan = self._plan
        if not plan.in_sql:
            return False
        params = self._admit_params(session_id, token, True) | plan.locks
        return (await plan.extending.run(conn, params)).rowcount > 0

    async def take(
        self,
        conn: Conn,
        session_id: int,
        token: str,
        *,
        during_turn: bool = False,
    ) -> None:
        """Refuse (``AgentSessionBudgetExceeded``, rolling the claim back) or reserve. On
        PostgreSQL only in a transaction holding the accounts' advisory locks
        (``core.storage.advisory.locked``), as every caller's does."""
        if not self.pairs:
            return
        sqlite = conn.dialect.name == "sqlite"
        if sqlite and await self._admit(conn, session_id, token, during_turn):
            self.session_id, self.token = session_id, token
            return
        params = await self._decide(conn, session_id, token, during_turn)
        await _HOLD[conn.dialect.name].run(conn, params)
        self.session_id, self.token = session_id, token

    async def _admit(self, conn: Conn, session_id: int, token: str, during_turn: bool) -> bool:
        """SQLite: the check and the reservation in one statement (``_admitting``); False when
        it wrote nothing (the turn is to be refused, or the ordinary way is to decide)."""
        if not self._plan.in_sql:
            return False
        params = self._admit_params(session_id, token, during_turn)
        return (await self._plan.admitting.run(conn, params)).rowcount > 0

    def _admit_params(self, session_id: int, token: str, during_turn: bool) -> dict[str, Any]:
        """The admitting statements' parameters (``_admission``)."""
        plan = self._plan
        now = self.clock()
        params = plan.admit.copy()
        for _, period in plan.wanted:
            params[period] = window(period, now).start
        params["h_session_id"] = session_id
        params["h_lock_token"] = token
        params["h_created_at"] = now
        params["since"] = -float(self.staleness_seconds)
        params["text"] = 0 if during_turn else self.text_tokens
        return params

    async def take_inserting(
        self, conn: Conn, session_id: int, token: str, message: dict[str, Any]
    ) -> int:
        """PostgreSQL, under the accounts' advisory locks, after the claim (whose stale guard
        held) when the one statement (``claim_admitting``) did not admit it: the check in
        Python, then the user message inserted (``message``:
        ``core.storage.queries.user_params``) by the statement that writes the reservation.
        Returns the message's position. A refusal for the budget comes first, with nothing
        written."""
        params = await self._decide(conn, session_id, token, False)
        row = (await _INSERT_HOLDING.run(conn, message | params)).row
        assert row is not None  # an INSERT … SELECT of constants: one row
        self.session_id, self.token = session_id, token
        return int(row[0])

    async def _decide(
        self, conn: Conn, session_id: int, token: str, during_turn: bool
    ) -> dict[str, Any]:
        """The read and the decision: the hold's parameters, or the refusal."""
        plan = self._plan
        now = self.clock()
        view = await _view(
            conn,
            plan.keys,
            plan.wanted,
            plan.slots,
            plan.owners,
            now,
            session_id,
            self.staleness_seconds,
        )
        text = 0 if during_turn else self.text_tokens
        params = plan.hold.copy()
        params.update(h_session_id=session_id, h_lock_token=token, h_created_at=now)
        for budget, key, slot, limit in plan.limits:
            totals = view.totals.get((key, budget.period), _NOTHING)
            others = view.held.get(slot, 0)
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
            column = f"h_{_column(slot)}"
            held = params[column]
            params[column] = amount if held is None else min(held, amount)
        return params


__all__ = ["NANO", "WINDOW_START", "Reservation", "applicable", "lock_key", "read_accounts"]

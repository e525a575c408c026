"""Spending limits (``BUDGETS``) without SQL: parsing, the period windows, and the decision.

An entry is ``SCOPE:PERIOD:LIMIT``, comma-separated:

- ``SCOPE``: ``user`` (each acting user has their own account), ``workspace`` (each Slack
  workspace), ``all`` (one account for the whole deployment);
- ``PERIOD``: ``day`` or ``month``, calendar periods in UTC (a day starts at 00:00 UTC, a month
  on its 1st), so every replica and every operator agrees on when a limit resets;
- ``LIMIT``: a whole number of ``tokens`` (input + output, cached included: what the model
  read and wrote) or a decimal amount of ``usd``; ``0`` blocks every turn.

Scope, period and unit are case-insensitive; ``_`` may group digits (``200_000tokens``). Each
(scope, period, unit) may appear once. A limit is at most ``MAX_TOKENS`` tokens or ``MAX_USD``
dollars: the ledger adds amounts as 64-bit integers (dollars in billionths), and a larger limit
is no limit anyway, while one past 64 bits would break every turn of its payer. A malformed
entry raises ``ConfigError`` with one line naming it, so ``BUDGETS`` stops start-up and
``budget set`` refuses before changing anything.

``admits`` is the whole rule, given what the storage layer read: a turn may start (or make
its next model request) while, for every budget that applies to it, what is left (the limit
less what the window has spent and what other running turns hold) is positive and the
request's expected cost (``expected_tokens``, ``expected_nanousd``) fits in it, or, when no
other turn holds anything, into the last bit: so the last bit of a budget is used, by one
request at a time, and concurrent turns overshoot a budget by at most one request in total.
``decide`` names the exhausted account of a set (a report's view: spent and held at the limit).
A dollar budget counts only requests whose price is known (an unpriced request has no dollar
amount to count): an operator whose provider has no price in the table should use a token
budget, or state the custom provider's own prices. A token budget counts estimated tokens for
requests whose provider reported none.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Final, Literal, NamedTuple, cast

from core.errors import AgentSessionBudgetExceeded, ConfigError

Scope = Literal["user", "workspace", "all"]
Period = Literal["day", "month"]
Unit = Literal["tokens", "usd"]

SCOPES: tuple[Scope, ...] = ("user", "workspace", "all")
PERIODS: tuple[Period, ...] = ("day", "month")
_LIMIT = re.compile(r"(?P<amount>[0-9][0-9_]*(?:\.[0-9]+)?)\s*(?P<unit>[a-z]+)")
_UNITS: dict[str, Unit] = {"tokens": "tokens", "token": "tokens", "usd": "usd"}
# The largest limits: a million times a heavy month of one model (about a billion tokens or a
# thousand dollars), and far enough below 2**63 that sums of reservations and spending, in
# tokens or billionths of a dollar, never overflow a BIGINT.
MAX_TOKENS: Final = Decimal(10**15)
MAX_USD: Final = Decimal(10**9)


@dataclass(frozen=True)
class Budget:
    scope: Scope
    period: Period
    unit: Unit
    amount: Decimal  # whole tokens, or US dollars

    def __str__(self) -> str:
        """The entry as ``BUDGETS`` writes it (canonical: what ``budget show`` prints)."""
        amount = f"{self.amount:f}" if self.unit == "usd" else str(int(self.amount))
        return f"{self.scope}:{self.period}:{amount}{self.unit}"

    def amount_text(self) -> str:
        """``200,000 tokens`` or ``$50.00``: the limit as a person reads it."""
        if self.unit == "tokens":
            return f"{int(self.amount):,} tokens"
        cents = self.amount.quantize(Decimal("0.01"))
        return f"${cents:,.2f}" if cents == self.amount else f"${self.amount:,f}"

    def describe(self) -> str:
        """``the per-user budget of 200,000 tokens a day`` (refusals, ``budget show``)."""
        owner = {"user": "per-user", "workspace": "workspace", "all": "shared"}[self.scope]
        return f"the {owner} budget of {self.amount_text()} a {self.period}"


def parse_budget(entry: str) -> Budget:
    """One ``SCOPE:PERIOD:LIMIT`` entry, or ``ConfigError`` naming it and what is wrong."""
    text = entry.strip()

    def bad(reason: str) -> ConfigError:
        return ConfigError(f"BUDGETS: {text!r}: {reason}")

    parts = [part.strip().lower() for part in text.split(":")]
    if len(parts) != 3 or not all(parts):
        raise bad("expected SCOPE:PERIOD:LIMIT, e.g. user:day:200000tokens or all:month:500usd")
    scope, period, limit = parts
    if scope not in SCOPES:
        raise bad(f"scope {scope!r} is not user, workspace or all")
    if period not in PERIODS:
        raise bad(f"period {period!r} is not day or month")
    match = _LIMIT.fullmatch(limit)
    if match is None or match["unit"] not in _UNITS:
        raise bad(f"limit {limit!r} is not a number followed by tokens or usd (e.g. 50usd)")
    unit = _UNITS[match["unit"]]
    try:
        amount = Decimal(match["amount"].replace("_", ""))
    except InvalidOperation:
        raise bad(f"limit {limit!r} is not a number") from None
    if unit == "tokens" and amount != amount.to_integral_value():
        raise bad(f"limit {limit!r}: tokens are counted whole")
    most = MAX_TOKENS if unit == "tokens" else MAX_USD
    if amount > most:
        largest = f"{int(most):_}{unit}"
        raise bad(f"limit {limit!r} is past the largest a budget takes ({largest})")
    return Budget(scope, period, unit, amount)


def parse_budgets(value: str) -> tuple[Budget, ...]:
    """Every entry of a ``BUDGETS`` value (empty: no limits), or ``ConfigError`` for the first
    malformed or repeated one."""
    budgets: list[Budget] = []
    seen: set[tuple[str, str, str]] = set()
    for entry in value.split(","):
        if not entry.strip():
            continue
        budget = parse_budget(entry)
        key = (budget.scope, budget.period, budget.unit)
        if key in seen:
            raise ConfigError(
                f"BUDGETS: {entry.strip()!r}: a {budget.scope} {budget.period} limit in "
                f"{budget.unit} is already given"
            )
        seen.add(key)
        budgets.append(budget)
    return tuple(budgets)


@dataclass(frozen=True)
class Window:
    """A period's span in UTC: ``start`` inclusive, ``end`` exclusive (when the limit resets)."""

    start: datetime
    end: datetime

    def __contains__(self, moment: datetime) -> bool:
        return self.start <= moment < self.end


def window(period: Period, now: datetime) -> Window:
    """The calendar day or month (UTC) that contains ``now`` (an aware datetime)."""
    if now.tzinfo is None:
        raise ValueError("window() needs an aware datetime; budgets are kept in UTC")
    return _window(period, now.astimezone(UTC).date())


@functools.lru_cache(maxsize=64)
def _window(period: Period, day: date) -> Window:
    """``window`` by the UTC date (a claim and a ledger row each ask for two: cached)."""
    moment = datetime(day.year, day.month, day.day, tzinfo=UTC)
    if period == "day":
        start = moment
        return Window(start, start + timedelta(days=1))
    start = moment.replace(day=1)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return Window(start, end)


@dataclass(frozen=True)
class Payer:
    """Whose accounts a turn draws on: the acting user (an external id such as
    ``slack:T1:U1``) and the Slack workspace of the session (``None``: none, e.g. a terminal
    session of no workspace, which then no workspace budget limits)."""

    user: str
    workspace: str | None = None


def account_key(budget: Budget, actor: Payer) -> str | None:
    """The account of ``actor`` that ``budget`` limits (``user:…``, ``workspace:…``, ``all``),
    or ``None`` when it limits none of the actor's (a workspace budget, no workspace)."""
    if budget.scope == "user":
        return f"user:{actor.user}"
    if budget.scope == "workspace":
        return None if actor.workspace is None else f"workspace:{actor.workspace}"
    return "all"


@dataclass(frozen=True)
class Account:
    """One budget applied to one account, as the storage layer summed it for the window.

    ``spent`` is what requests recorded in ``window`` used (tokens, or dollars of priced
    requests), ``reserved`` what other running turns hold and have not yet spent, both in the
    budget's unit.
    """

    budget: Budget
    window: Window
    spent: Decimal
    reserved: Decimal = Decimal(0)

    @property
    def used(self) -> Decimal:
        return self.spent + self.reserved

    @property
    def exhausted(self) -> bool:
        return self.used >= self.budget.amount


def decide(accounts: Sequence[Account]) -> Account | None:
    """The account that refuses the turn (or its next request), ``None`` when all have room.

    Of several exhausted ones the one that resets last is named: telling a person "try again
    tomorrow" when this month's budget is also gone would send them back for nothing.
    """
    exhausted = [account for account in accounts if account.exhausted]
    if not exhausted:
        return None
    return max(exhausted, key=lambda account: account.window.end)


def refusal(account: Account, *, during_turn: bool = False) -> AgentSessionBudgetExceeded:
    """The error a surface maps to its refusal; the message is a plain-English default."""
    budget = account.budget
    resets = account.window.end.strftime("%Y-%m-%d %H:%M UTC")
    if during_turn:
        message = f"Stopped: {budget.describe()} ran out during this answer; it resets {resets}"
    else:
        message = f"Not started: {budget.describe()} is used up; it resets {resets}"
    return AgentSessionBudgetExceeded(
        message,
        limit=str(budget),
        scope=budget.scope,
        period=budget.period,
        unit=budget.unit,
        amount=budget.amount,
        spent=account.used,
        resets_at=account.window.end,
        during_turn=during_turn,
    )


def refused_budget(error: AgentSessionBudgetExceeded) -> Budget:
    """The limit a refusal names, for a surface to describe (``describe``, ``amount_text``)."""
    return Budget(
        cast(Scope, error.scope), cast(Period, error.period), cast(Unit, error.unit), error.amount
    )


def resets_text(error: AgentSessionBudgetExceeded) -> str:
    """When the refusing limit resets, as every surface writes it: ``2026-12-03 00:00 UTC``."""
    return error.resets_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


# What a claim expects a request to cost when its account has no history to go by: a short
# conversation's input (system prompt, tools, a few messages) and a short answer.
DEFAULT_INPUT_TOKENS: Final = 1_000
DEFAULT_OUTPUT_TOKENS: Final = 1_000


class WindowTotals(NamedTuple):
    """What one account spent in one window, as ``usage_totals`` keeps it (dollars in
    billionths). A tuple: a claim builds one per window it reads, and a frozen dataclass's
    construction was a measurable part of the budget check's CPU."""

    tokens: int = 0
    nanousd: int = 0
    output_tokens: int = 0
    requests: int = 0
    priced_requests: int = 0


@dataclass(frozen=True)
class LastRequest:
    """A session's latest model request: what its next request re-reads (its input and its
    output are the next one's input) and what it cost (``None``: unpriced)."""

    counted_tokens: int
    nanousd: int | None


def expected_tokens(last: LastRequest | None, totals: WindowTotals, text_tokens: int) -> int:
    """What a turn's next model request is expected to count: the session's conversation as
    its last request left it (or, for a new session, the account's average input), the new
    text, and the account's average output in the window."""
    requests = totals.requests
    output = totals.output_tokens // requests if requests else DEFAULT_OUTPUT_TOKENS
    if last is not None:
        sent = last.counted_tokens
    elif requests:
        sent = max(totals.tokens - totals.output_tokens, 0) // requests
    else:
        sent = DEFAULT_INPUT_TOKENS
    return sent + text_tokens + output


def expected_nanousd(tokens: int, last: LastRequest | None, totals: WindowTotals) -> int:
    """The expected request's cost in billionths of a dollar: ``tokens`` at the session's last
    request's price per token, else the account's average priced request, else nothing known
    (0: a dollar budget cannot expect a cost it has never seen)."""
    if last is not None and last.nanousd is not None and last.counted_tokens > 0:
        return -(-last.nanousd * tokens // last.counted_tokens)
    if totals.priced_requests:
        return totals.nanousd // totals.priced_requests
    return 0


def admits(left: int, expected: int, others_hold: int) -> bool:
    """The claim's rule, per budget, in the budget's stored unit: a turn is admitted while
    ``left`` (the limit less what the window spent and what *other* live turns hold) is
    positive and its expected cost fits in it, or, when nothing else is held, into the last
    bit of the budget (so one turn at a time may run past it, by at most one request)."""
    if left <= 0:
        return False
    return expected <= left or others_hold == 0

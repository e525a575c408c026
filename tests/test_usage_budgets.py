"""BUDGETS: parsing (one line per bad entry), the UTC windows at their edges, and the decision."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from core.errors import AgentSessionBudgetExceeded, ConfigError
from core.settings import load_settings
from core.usage.budgets import (
    MAX_TOKENS,
    MAX_USD,
    Account,
    Budget,
    Payer,
    account_key,
    decide,
    parse_budget,
    parse_budgets,
    refusal,
    window,
)


def test_parse__the_documented_example() -> None:
    budgets = parse_budgets("user:day:200000tokens,workspace:month:50usd,all:month:500usd")

    assert budgets == (
        Budget("user", "day", "tokens", Decimal(200000)),
        Budget("workspace", "month", "usd", Decimal(50)),
        Budget("all", "month", "usd", Decimal(500)),
    )
    assert [str(b) for b in budgets] == [
        "user:day:200000tokens",
        "workspace:month:50usd",
        "all:month:500usd",
    ]


def test_parse__case_spaces_grouping_and_cents() -> None:
    assert parse_budgets(" User : Day : 200_000 Tokens , all:month:12.50USD ,") == (
        Budget("user", "day", "tokens", Decimal(200000)),
        Budget("all", "month", "usd", Decimal("12.50")),
    )
    assert parse_budgets("") == ()
    assert parse_budget("all:day:0usd").amount == 0  # a zero limit blocks every turn


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("user:day", "BUDGETS: 'user:day': expected SCOPE:PERIOD:LIMIT"),
        ("team:day:5usd", "BUDGETS: 'team:day:5usd': scope 'team' is not user, workspace or all"),
        ("user:week:5usd", "BUDGETS: 'user:week:5usd': period 'week' is not day or month"),
        ("user:day:5eur", "BUDGETS: 'user:day:5eur': limit '5eur' is not a number followed by"),
        ("user:day:usd", "BUDGETS: 'user:day:usd': limit 'usd' is not a number followed by"),
        ("user:day:-5usd", "BUDGETS: 'user:day:-5usd': limit '-5usd' is not a number followed"),
        ("user:day:1.5tokens", "BUDGETS: 'user:day:1.5tokens': limit '1.5tokens': tokens are"),
        (
            "user:day:5usd,all:day:1usd,user:day:9usd",
            "BUDGETS: 'user:day:9usd': a user day limit in usd is already given",
        ),
    ],
)
def test_parse__a_malformed_entry_is_one_line_naming_it(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_budgets(value)

    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_parse__a_limit_past_the_largest_is_refused_in_one_line() -> None:
    # 2**63 tokens overflowed the reservation's BIGINT (a raw OverflowError on SQLite).
    largest_tokens = int(MAX_TOKENS)
    assert parse_budget(f"user:day:{largest_tokens}tokens").amount == MAX_TOKENS
    assert parse_budget(f"all:month:{MAX_USD}usd").amount == MAX_USD
    for entry in (f"user:day:{2**63}tokens", f"user:day:{largest_tokens + 1}tokens"):
        with pytest.raises(ConfigError) as info:
            parse_budgets(entry)
        assert str(info.value).startswith(f"BUDGETS: {entry!r}: limit ")
        assert str(info.value).endswith(
            f"past the largest a budget takes ({largest_tokens:_}tokens)"
        )
    with pytest.raises(ConfigError, match="past the largest"):
        parse_budgets(f"all:month:{MAX_USD}.01usd")
    with pytest.raises(ConfigError, match="past the largest"):
        load_settings(budgets=f"workspace:day:{2**64}tokens")


def test_settings__budgets_are_parsed_at_load_and_a_bad_entry_stops_it() -> None:
    settings = load_settings(budgets="user:day:1000tokens")
    assert settings.budgets == (Budget("user", "day", "tokens", Decimal(1000)),)
    assert load_settings().budgets == ()

    with pytest.raises(ConfigError) as info:
        load_settings(budgets="user:day:1000tokens,user:fortnight:3usd")
    assert str(info.value) == (
        "BUDGETS: 'user:fortnight:3usd': period 'fortnight' is not day or month"
    )


def test_settings__budgets_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUDGETS", "all:month:500usd")

    assert load_settings().budgets == (Budget("all", "month", "usd", Decimal(500)),)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        ("2026-03-14T15:09:26+00:00", "2026-03-14T00:00:00+00:00", "2026-03-15T00:00:00+00:00"),
        ("2026-03-14T00:00:00+00:00", "2026-03-14T00:00:00+00:00", "2026-03-15T00:00:00+00:00"),
        (
            "2026-03-14T23:59:59.999999+00:00",
            "2026-03-14T00:00:00+00:00",
            "2026-03-15T00:00:00+00:00",
        ),
        # A local time is placed in its UTC day: 01:30 in UTC+2 is still yesterday in UTC.
        ("2026-03-15T01:30:00+02:00", "2026-03-14T00:00:00+00:00", "2026-03-15T00:00:00+00:00"),
    ],
)
def test_window__a_day_is_the_utc_calendar_day(now: str, start: str, end: str) -> None:
    span = window("day", at(now))

    assert (span.start, span.end) == (at(start), at(end))
    assert at(now) in span
    assert span.end not in span  # the reset instant belongs to the next day


@pytest.mark.parametrize(
    ("now", "start", "end"),
    [
        ("2026-02-28T23:59:59+00:00", "2026-02-01T00:00:00+00:00", "2026-03-01T00:00:00+00:00"),
        ("2028-02-29T12:00:00+00:00", "2028-02-01T00:00:00+00:00", "2028-03-01T00:00:00+00:00"),
        ("2026-12-31T23:59:59+00:00", "2026-12-01T00:00:00+00:00", "2027-01-01T00:00:00+00:00"),
        ("2027-01-01T00:00:00+00:00", "2027-01-01T00:00:00+00:00", "2027-02-01T00:00:00+00:00"),
    ],
)
def test_window__a_month_runs_from_the_first_to_the_next_first_utc(
    now: str, start: str, end: str
) -> None:
    span = window("month", at(now))

    assert (span.start, span.end) == (at(start), at(end))


def test_window__a_naive_datetime_is_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        window("day", datetime(2026, 1, 1))


def test_account_key__each_scope_names_its_account() -> None:
    actor = Payer("slack:T1:U1", "T1")
    user, workspace, shared = parse_budgets("user:day:1usd,workspace:day:1usd,all:day:1usd")

    assert account_key(user, actor) == "user:slack:T1:U1"
    assert account_key(workspace, actor) == "workspace:T1"
    assert account_key(shared, actor) == "all"
    assert account_key(workspace, Payer("terminal:me")) is None


DAY = parse_budget("user:day:1000tokens")
MONTH = parse_budget("all:month:5usd")
NOW = at("2026-03-14T15:00:00+00:00")


def account(budget: Budget, spent: str, reserved: str = "0", now: datetime = NOW) -> Account:
    return Account(budget, window(budget.period, now), Decimal(spent), Decimal(reserved))


def test_decide__below_every_limit_the_turn_may_start() -> None:
    assert decide([account(DAY, "999"), account(MONTH, "4.99")]) is None
    assert decide([]) is None


def test_decide__exactly_at_the_limit_is_over() -> None:
    assert decide([account(DAY, "1000")]) == account(DAY, "1000")


def test_decide__other_turns_reservations_count_as_spent() -> None:
    # 600 spent, 400 held by a turn running on another replica: nothing left to start on.
    assert decide([account(DAY, "600", reserved="400")]) is not None
    assert decide([account(DAY, "600", reserved="399")]) is None


def test_decide__of_two_exhausted_limits_the_one_resetting_last_is_named() -> None:
    refusing = decide([account(DAY, "1000"), account(MONTH, "5")])

    assert refusing is not None
    assert refusing.budget == MONTH


def test_decide__yesterdays_spending_belongs_to_yesterdays_window() -> None:
    # The storage layer sums per window; just before and just after midnight are two windows.
    before = at("2026-03-14T23:59:59+00:00")
    after = before + timedelta(seconds=1)

    assert window("day", before) != window("day", after)
    assert window("day", after).start == after
    assert decide([account(DAY, "1000", now=before)]) is not None
    assert decide([account(DAY, "0", now=after)]) is None


def test_refusal__names_the_limit_and_when_it_resets() -> None:
    error = refusal(account(DAY, "1200", reserved="50"))

    assert isinstance(error, AgentSessionBudgetExceeded)
    assert error.code == "agent_session_budget_exceeded"
    assert error.limit == "user:day:1000tokens"
    assert (error.scope, error.period, error.unit) == ("user", "day", "tokens")
    assert error.amount == 1000
    assert error.spent == 1250
    assert error.resets_at == datetime(2026, 3, 15, tzinfo=UTC)
    assert not error.during_turn
    assert str(error) == (
        "Not started: the per-user budget of 1,000 tokens a day is used up; "
        "it resets 2026-03-15 00:00 UTC"
    )


def test_refusal__during_a_turn_says_it_stopped() -> None:
    error = refusal(account(MONTH, "5.20"), during_turn=True)

    assert error.during_turn
    assert str(error) == (
        "Stopped: the shared budget of $5.00 a month ran out during this answer; "
        "it resets 2026-04-01 00:00 UTC"
    )
    assert error.resets_at.utcoffset() == timedelta(0)

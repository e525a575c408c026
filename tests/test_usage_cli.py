"""``slack-agent usage``, ``budget`` and the usage lines of ``sessions show``, as an operator
runs them: a real process on a real database."""

from __future__ import annotations

import json

import pytest

from core.agent.accounting import Attribution, Payer
from core.agent.loop import Agent
from core.agent.model_choice import ProviderCache
from core.messages import user_message
from core.providers.base import Usage
from core.settings import Settings
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from core.storage.usage import LedgerEntry, UsageLedger
from core.usage.totals import RequestUsage
from tests.helpers import new_session
from tests.test_cli import cli, one_line_error

pytestmark = pytest.mark.slow


async def test_budget__set_show_clear_and_a_bad_value_changes_nothing(database_url: str) -> None:
    env = {"BUDGETS": "user:day:200000tokens"}
    shown = cli("budget", "show", database_url=database_url, **env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "user:day:200000tokens            the per-user budget of 200,000 tokens a day "
        "(set in the environment)"
    ]
    set_ = cli("budget", "set", "all:month:50usd", database_url=database_url, **env)
    assert set_.returncode == 0, set_.stderr
    assert "all:month:50usd" in set_.stdout
    assert "the shared budget of $50.00 a month (set in the run time); used $0.0000" in set_.stdout
    bad = cli("budget", "set", "all:fortnight:5usd", database_url=database_url, **env)
    assert one_line_error(bad) == (
        "slack-agent: usage_error: budget set: 'all:fortnight:5usd': "
        "period 'fortnight' is not day or month"
    )
    absurd = cli("budget", "set", f"user:day:{2**63}tokens", database_url=database_url, **env)
    assert one_line_error(absurd).endswith(
        f"limit '{2**63}tokens' is past the largest a budget takes (1_000_000_000_000_000tokens)"
    )
    after = cli("budget", "show", database_url=database_url, **env)
    assert after.stdout == set_.stdout
    cleared = cli("budget", "clear", "user:day", database_url=database_url, **env)
    assert cleared.stdout.splitlines()[0].startswith("all:month:50usd")
    assert len(cleared.stdout.splitlines()) == 1
    back = cli("budget", "clear", database_url=database_url, **env)
    assert back.stdout == shown.stdout


def test_budgets__a_malformed_entry_stops_start_up_in_one_line(database_url: str) -> None:
    bad = cli("budget", "show", database_url=database_url, BUDGETS="user:day:lots")
    assert one_line_error(bad).startswith(
        "slack-agent: config_invalid: BUDGETS: 'user:day:lots': limit 'lots' is not a number"
    )


async def test_usage__by_user_and_json_and_sessions_show_per_message(
    store: SessionStore, db: Database, database_url: str
) -> None:
    ledger = UsageLedger(db, staleness_seconds=60)
    priced = RequestUsage("openai", "gpt-x", Usage(1000, 50, 800), None)
    await ledger.record(LedgerEntry(priced, "answer", 1050, False, payer=Payer("slack:T1:U1")))
    _, session = await new_session(store)
    cache = ProviderCache(Settings(model_provider="offline"))
    try:
        await Agent(store, cache).run_turn(
            session.id,
            user_message=user_message("hello"),
            last_message_id=None,
            attribution=Attribution("terminal", Payer("cli:me")),
        )
    finally:
        await cache.aclose()

    report = cli("usage", "--by", "user", database_url=database_url)
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    assert lines[0].split() == ["user", "requests", "input", "output", "cached", "cost"]
    assert lines[1].startswith("cli:me")
    assert "(1 estimated)" in lines[1]
    assert lines[2].split()[:5] == ["slack:T1:U1", "1", "1,000", "50", "800"]
    assert "1 unpriced (not in the cost)" in lines[2]

    as_json = json.loads(cli("usage", "--by", "model", "--json", database_url=database_url).stdout)
    keys = {line["key"] for line in as_json["lines"]}
    assert keys == {"openai/gpt-x", "offline/offline-stand-in"}
    future = cli("usage", "--since", "2999-01-01", database_url=database_url)
    assert future.stdout.strip() == "no model requests recorded since 2999-01-01"
    bad = cli("usage", "--since", "yesterday", database_url=database_url)
    assert one_line_error(bad) == (
        "slack-agent: usage_error: usage --since: 'yesterday' is not a date (YYYY-MM-DD)"
    )

    shown = cli("sessions", "show", str(session.id), database_url=database_url)
    assert shown.returncode == 0, shown.stderr
    usage_lines = [line.strip() for line in shown.stdout.splitlines() if "usage:" in line]
    assert len(usage_lines) == 1
    assert usage_lines[0].startswith("usage: offline/")
    assert usage_lines[0].endswith("$0.0000 (estimated)")

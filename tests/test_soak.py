"""The soak, short: three ``serve`` processes on one database under load and every fault at
once (a replica killed mid-turn and started again, the database gone for a few seconds, Slack
answering 429s and 500s, the model timing out and cutting streams), then every promise checked
(``bench.soak``). The full run and its figures are in docs/reliability.md."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.soak import SoakConfig, run_soak
from bot.standin import FaultSchedule

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow


async def test_soak__every_promise_holds_under_load_and_faults(database_url: str) -> None:
    report = await run_soak(
        SoakConfig(database_url=database_url, messages=180, threads=18, seconds=24.0, seed=5)
    )
    assert report.ok, report.violations
    assert report.acknowledged == report.distinct_messages == 180
    assert report.turns == 180  # each answered once
    # Every kind of fault really happened.
    assert report.slack_faults.get("429"), report.slack_faults
    assert report.slack_faults.get("500"), report.slack_faults
    assert report.model_faults.get("timeout")
    assert report.model_faults.get("cut")
    assert report.model_errors >= 1  # the model's failures were shown, not hidden
    faults = [r.fault for r in report.recoveries]
    assert any("SIGKILL" in f for f in faults)
    if database_url.startswith("postgresql"):
        assert any("database unreachable" in f for f in faults)
    assert report.exit_statuses == [0, 0, 0]  # SIGTERM at the end, every replica exits cleanly


def test_fault_schedule__every_kind_at_its_share_whatever_the_run_length() -> None:
    schedule = FaultSchedule(rate_limited=0.05, server_error=0.01, never=0.0)
    met = Counter(schedule.next() for _ in range(200))
    assert met["rate_limited"] == 10
    assert met["server_error"] == 2
    assert "never" not in met
    assert met[None] == 188
    # A rare fault comes within its first period, not at the end of a run.
    first = FaultSchedule(cut=0.01)
    assert "cut" in [first.next() for _ in range(60)]

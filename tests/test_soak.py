"""The soak, short: three ``serve`` processes on one database under load and every fault at
once (a replica killed mid-turn and started again, the database gone for a few seconds, one
replica cut off from it past the staleness window, Slack answering 429s and 500s, the model
timing out and cutting streams), then every promise checked (``bench.soak.run``). The full run and
its figures are in docs/reliability.md."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text as sql

from bench.soak.profile import summary
from bench.soak.run import FAULTS, SoakConfig, database_sessions, parse_faults, run_soak
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from standins.faults import FaultSchedule
from tests.test_cli import cli, one_line_error

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow


async def test_soak__every_promise_holds_under_load_and_faults(database_url: str) -> None:
    report = await run_soak(
        SoakConfig(database_url=database_url, messages=180, threads=18, seconds=24.0, seed=5)
    )
    assert report.ok, "\n".join(report.violations)  # whole: each may carry a trace
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
        # One replica cut off by a blackhole past the window: it stopped its turns before the
        # others took them over (``report.ok``: never two model calls at once for a session).
        assert any("cut off from the database" in f for f in faults)
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


async def test_soak__faults_switched_off_stay_off_and_the_profile_says_where_time_went(
    database_url: str, tmp_path: Path
) -> None:
    folder = tmp_path / "profile"
    report = await run_soak(
        SoakConfig(
            database_url=database_url,
            messages=60,
            threads=6,
            seconds=10.0,
            seed=3,
            faults=frozenset({"slack-429", "model-cut"}),
            profile_dir=str(folder),
        )
    )
    assert report.ok, "\n".join(report.violations)  # whole: each may carry a trace
    assert report.slack_faults.get("429")
    assert not report.slack_faults.get("500")
    assert report.model_faults.get("cut")
    assert not report.model_faults.get("timeout")
    assert report.recoveries == []  # neither the kill nor the database outage
    # Every request the load generator sent was timed inside the replica that answered it.
    answers = json.loads((folder / "answers.json").read_text())["answers"]
    assert len(answers) == report.answers_2xx == sum(report.status_counts.values())
    probes = [json.loads((folder / f"replica-{i}.1.json").read_text()) for i in range(3)]
    for i, probe in enumerate(probes):
        assert probe["ack_handler_ms"]["n"] == sum(1 for a in answers if a["replica"] == i)
        assert probe["loop_lag_ms"]["n"] > 0
    assert json.loads((folder / "cpu.json").read_text())["rows"]
    stacks = (folder / "replica-1.pyspy.txt").read_text()
    assert "MainThread" in stacks
    assert "DeliveryWorker" in stacks
    shown = summary(folder)
    assert "acknowledgements, client side (200s): p50" in shown
    assert "replica-1.pyspy.txt (MainThread):" in shown


def test_faults__all_none_some_or_all_but_some() -> None:
    assert parse_faults("all") == frozenset(FAULTS)
    assert parse_faults("none") == frozenset()
    assert parse_faults("kill,outage") == {"kill", "outage"}
    assert parse_faults("all,-outage,-kill") == frozenset(FAULTS) - {"outage", "kill"}


@pytest.mark.parametrize("value", ["bogus", "-outage", "all,kill", "kill,-outage", "none,kill"])
def test_faults__a_list_that_means_nothing_is_refused_in_one_line(value: str) -> None:
    line = one_line_error(cli("soak", f"--faults={value}"))
    assert line.startswith("slack-agent: usage_error: --faults:"), line


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)  # pg_stat_activity's own
async def test_soak_diagnosis__names_a_database_session_left_in_a_transaction(
    db: Database, replica: SessionStore
) -> None:
    """What a soak whose replicas did not settle reports: the sessions of its database that
    are not idle, here one whose transaction another connection left open."""
    assert await database_sessions(db) == []
    async with replica.db.read() as conn:
        await conn.execute(sql("SELECT 1"))  # the read's transaction is open, and left idle
        found = await database_sessions(db)
    assert len(found) == 1, found
    assert "idle in transaction" in found[0]
    assert "SELECT 1" in found[0]
    assert await database_sessions(db) == []

"""The benchmark: its result has the documented shape on both databases, it leaves
nothing behind, and a claim round that does not have exactly one winner fails the run.

No timing is asserted here: timings depend on the machine; the figures live in the README.
"""

from __future__ import annotations

import dataclasses
import importlib
import tempfile
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from bench import parts
from bench.costs.storage import QUICK, BenchError, claim_round, format_table, run_bench
from bench.costs.tools import bench_tools
from bench.load.profile import summarise
from bench.parts import PARTS
from core.errors import AgentSessionBusy, UsageError
from core.messages import Message
from core.records import ModelChoice, TurnLease
from core.storage.engine import create_database
from core.storage.models import AgentSession, AgentSessionMessage

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

TIMINGS = ("turn", "append_message", "claim_round_50", "truncate", "branch")


def assert_timing(value: Any) -> None:
    assert set(value) == {"p50", "p95", "n"}
    assert isinstance(value["n"], int)
    assert value["n"] > 0
    assert 0 <= value["p50"] <= value["p95"]


async def count_rows(url: str) -> tuple[int, int]:
    db = create_database(url)
    try:
        async with db.read() as conn:
            sessions = await conn.scalar(select(func.count()).select_from(AgentSession))
            messages = await conn.scalar(select(func.count()).select_from(AgentSessionMessage))
    finally:
        await db.dispose()
    return int(sessions or 0), int(messages or 0)


async def test_bench__quick_run_has_every_core_key_and_leaves_the_database_clean(
    database_url: str, backend: str
) -> None:
    result = await run_bench(database_url, quick=True)

    assert result["database"] == backend
    assert result["quick"] is True
    for key in TIMINGS:
        assert_timing(result[key])
    assert result["claim_round_50"]["n"] == QUICK.claim_rounds  # every round had one winner
    assert result["turn_history"] == QUICK.turn_history
    assert result["long_session"] == QUICK.long_session
    for key in ("history_load", "history_load_no_checkpoint"):
        assert sorted(result[key], key=int) == [str(size) for size in QUICK.history_sizes]
        for timing in result[key].values():
            assert_timing(timing)
    assert result["sweep_sessions_per_second"] > 0
    for key in ("snapshot_store", "snapshot_restore"):
        assert_timing(result[key])
    assert 0 < result["snapshot_bytes_per_message"] < result["snapshot_workspace_bytes"]
    # The Slack surface's measurements come from `slack-agent bench`, not the core's run.
    for key in ("ack", "idle_rss_bytes"):
        assert key not in result

    table = format_table(result)
    for label in (backend, "claim_round_50", "history_load [1,000 msgs]", "sessions/s"):
        assert label in table

    assert await count_rows(database_url) == (0, 0)  # every bench session was deleted


async def test_bench__default_database_is_a_temporary_file_removed_afterwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tiny = dataclasses.replace(
        QUICK,
        turn_samples=3,
        append_samples=3,
        history_sizes=(50,),
        history_samples=3,
        history_full_samples=2,
        claim_rounds=2,
        long_session=40,
        truncate_samples=2,
        branch_samples=2,
        sweep_sessions=20,
        warmup=1,
    )
    result = await run_bench(None, sizes=tiny)
    assert result["database"] == "sqlite"
    assert result["claim_round_50"]["n"] == 2
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240 (a test, after the run)


class _FakeStore:
    """Claims as scripted: ``winners`` of them succeed, the rest are busy."""

    def __init__(self, winners: int, error: Exception | None = None) -> None:
        self.winners = winners
        self.error = error
        self.calls = 0

    async def start_turn(
        self,
        session_id: int,
        *,
        user_message: Message | None,
        last_message_id: Any,
        model: ModelChoice | None = None,
    ) -> TurnLease:
        self.calls += 1
        if self.calls <= self.winners:
            return TurnLease(
                session_id=session_id, token=f"t{self.calls}", tail=None, next_position=0
            )
        if self.error is not None and self.calls == self.winners + 1:
            raise self.error
        raise AgentSessionBusy("busy")


async def test_claim_round__exactly_one_winner_passes() -> None:
    held: dict[str, TurnLease] = {}
    _elapsed, lease = await claim_round(_FakeStore(1), 7, None, 50, held)
    assert lease.token == "t1"
    assert held == {"t1": lease}


@pytest.mark.parametrize("winners", [0, 2])
async def test_claim_round__anything_but_one_winner_fails_the_run(winners: int) -> None:
    held: dict[str, TurnLease] = {}
    with pytest.raises(BenchError, match="exactly one winner"):
        await claim_round(_FakeStore(winners), 7, None, 50, held)
    assert len(held) == winners  # handed back so the caller can release them


async def test_claim_round__a_driver_error_fails_the_run() -> None:
    with pytest.raises(BenchError, match="unexpected error"):
        await claim_round(_FakeStore(1, error=RuntimeError("boom")), 7, None, 50)


def test_turn_profile__sums_the_replicas_samples_recorded_either_way(tmp_path: Path) -> None:
    """``bench.load.profile``: a profile of every process of the benchmark counts only the
    replica's samples; a profile attached to the replica alone counts all of them; idle
    samples (the loop waiting) count in neither."""
    turn = "main (slack_agent/cli.py:1);Deliveries.move (core/storage/deliveries.py:5)"
    slack = "main (slack_agent/cli.py:1);AsyncBaseClient.api_call (slack_sdk/x.py:9)"
    idle = "main (slack_agent/cli.py:1);EpollSelector.select (selectors.py:468)"
    replica = 'process 1:"python -m bench.load.turns";process 2:"python -m bot serve"'
    other = 'process 1:"python -m bench.load.turns";process 3:"python -m standins.slack"'
    everything = tmp_path / "all.raw"
    everything.write_text(
        f"{replica};{turn} 3\n{replica};{slack} 1\n{replica};{idle} 50\n{other};{turn} 40\n"
    )
    attached = tmp_path / "wave.raw"
    attached.write_text(f"{turn} 3\n{slack} 1\n{idle} 50\n")
    for path in (everything, attached):
        assert dict(summarise(path)) == {
            "storage (core/storage, SQLAlchemy, drivers)": 0.75,
            "Slack Web API calls (slack_sdk, aiohttp)": 0.25,
        }


@pytest.mark.parametrize("part", sorted(PARTS))
def test_bench_parts__every_part_is_a_command_of_the_product(part: str) -> None:
    """No measurement is reachable only as a script: each part names a module that runs it."""
    module = importlib.import_module(PARTS[part][0])
    assert callable(module.run_part)


def test_bench_parts__a_part_that_reads_a_file_refuses_to_run_without_one() -> None:
    with pytest.raises(UsageError, match=r"turns-profile: .*FILE"):
        parts.run("turns-profile", [])


def test_bench_parts__the_turns_profile_part_prints_the_shares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text("main (slack_agent/cli.py:1);Deliveries.move (core/storage/deliveries.py:5) 3\n")
    parts.run("turns-profile", [str(raw)])
    assert capsys.readouterr().out == "100.0%  storage (core/storage, SQLAlchemy, drivers)\n"


@pytest.mark.slow
async def test_bench_tools__a_call_and_an_approval_round_trip_measured_through_the_door(
    database_url: str,
) -> None:
    """The approval figure is the one a surface pays: a turn stopped at a call, then one
    ``decide`` that records and carries it out (the offline model and the stdio notes server)."""
    result = await bench_tools(database_url, quick=True)
    for name in (
        "turn_without_tool",
        "mcp_call_overhead",
        "approval_round_trip",
        "approval_click_to_call",
    ):
        assert result[name]["n"] == 20, name
    assert result["approval_round_trip"]["p50"] > 0
    # The click to the call is part of the round trip, which also holds the asking turn.
    assert 0 < result["approval_click_to_call"]["p50"] < result["approval_round_trip"]["p50"]
    assert result["approval_click_to_call_in_plain_turns"] > 0

"""The Slack surface's benchmark keys (``ack``, ``idle_rss_bytes``) come out measured."""

from __future__ import annotations

import pstats
from pathlib import Path

import pytest

from bench.load.ack import bench_slack
from bench.load.slack_calls import bench_slack_calls
from bench.load.turns import (
    bench_ack_during_fork_and_sweep,
    bench_concurrent_turns,
    format_lines,
    replica_env,
)
from core.settings import load_settings

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow


async def test_bench_slack__reports_ack_percentiles_and_idle_rss(database_url: str) -> None:
    result = await bench_slack(database_url, events=10)
    ack = result["ack"]
    assert ack["n"] == 10
    assert 0 < ack["p50"] <= ack["p95"] <= ack["p99"]
    assert result["idle_rss_bytes"] > 10 * 1024 * 1024


async def test_concurrent_turns__small_n_reports_what_it_measured() -> None:
    result = await bench_concurrent_turns(None, sizes=(3,), stream_seconds=1.5, probes=3)
    row = result["3"]
    assert row["turns"] == 3
    assert row["ack"]["n"] == 3
    assert row["cpu_ms_per_turn"] > 0
    assert row["running_at_once"] == 3
    assert row["turns_started_per_second"] > 0
    assert row["model_calls_failed"] == 0
    assert row["messages_shed"] == 0
    assert format_lines({"concurrent_turns": result})


def test_concurrent_turns__the_replica_holds_the_whole_wave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """N = 500 and its 50 probes run at once only if the replica keeps all 550: past
    MAX_HELD_MESSAGES it records them for another replica (there is none) instead."""
    for name, value in replica_env(550, "http://127.0.0.1:1").items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.max_concurrent_turns >= 550
    assert settings.max_held_messages >= 550


async def test_concurrent_turns__counts_what_a_turn_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--counts``: the replica under ``bench.load.counts``; every turn (3 and the probe)
    opened a stream and called the model once, on loop passes of its own. With
    ``BENCH_CPROFILE`` the turns' loop is profiled over the wave: its turns are in it."""
    profile = tmp_path / "turns.prof"
    monkeypatch.setenv("BENCH_CPROFILE", str(profile))
    result = await bench_concurrent_turns(
        None, sizes=(3,), stream_seconds=1.0, probes=1, counts=True
    )
    profiled = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    assert any(name == "take_turn" for _, _, name in profiled), "no turn in the profile"
    per_turn = result["3"]["per_turn"]
    # Each turn ran once: a turn that failed and was retried (as when the counting broke a
    # read's signature) sets its status and may open its stream again.
    assert per_turn["slack.agents.sessions.setStatus"] == 1.0, per_turn
    assert per_turn["slack.chat.startStream"] == 1.0, per_turn
    assert per_turn["slack.chat.stopStream"] == 1.0, per_turn
    assert per_turn["db_write_transactions"] >= 3, per_turn
    assert per_turn["db_reads_alone"] >= 3, per_turn  # the session, the thread, the line …
    assert per_turn["loop_passes"] >= 10, per_turn
    assert per_turn["callbacks"] >= per_turn["loop_passes"] / 2, per_turn
    split = result["3"]["cpu_split"]
    assert 0 < split["turns_loop"] <= 1
    assert any("per turn" in line for line in format_lines({"concurrent_turns": result}))


async def test_concurrent_turns__the_floor_makes_a_turns_calls(database_url: str) -> None:
    """``--floor``: ``bench.load.floor`` in the replica's place answered every mention with
    the product's Slack calls (its status, a stream started and stopped) and one model call
    each, on either database; counted, so the floor's CPU is that of the same work."""
    result = await bench_concurrent_turns(
        database_url,
        sizes=(3,),
        stream_seconds=2.0,
        probes=1,
        counts=True,
        floor=True,
    )
    row = result["3"]
    assert row["running_at_once"] == 3
    assert row["model_calls_failed"] == 0
    per_turn = row["per_turn"]
    assert per_turn["slack.agents.sessions.setStatus"] == 1.0, per_turn
    assert per_turn["slack.chat.startStream"] == 1.0, per_turn
    assert per_turn["slack.chat.stopStream"] == 1.0, per_turn
    assert row["cpu_ms_per_turn"] > 0


async def test_slack_calls__both_clients_measured_per_round() -> None:
    """``bench.load.slack_calls``: each client's calls reached the stand-in (the bare POST checks
    Slack's ``ok``, slack_sdk raises on a refusal) and cost measurable CPU, round by round."""
    result = await bench_slack_calls(calls=20, rounds_of=2)
    assert set(result) == {"slack_sdk", "aiohttp"}
    for client in result.values():
        assert len(client["rounds_ms"]) == 2
        assert client["median_ms"] > 0


async def test_ack_during_fork_and_sweep__both_happen_within_the_window() -> None:
    result = await bench_ack_during_fork_and_sweep(
        None, fork_messages=200, sweep_sessions=50, window_seconds=6.0, spacing=0.5
    )
    assert result["fork_done"], result
    assert result["sweep_done"], result
    assert result["ack"]["n"] == result["ack_baseline"]["n"] == 12
    assert format_lines({"ack_during_fork_and_sweep": result})

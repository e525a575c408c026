"""The Slack surface's benchmark keys (SPEC §13 ``ack``, ``idle_rss_bytes``) come out measured."""

from __future__ import annotations

from bench.slack import bench_slack


async def test_bench_slack__reports_ack_percentiles_and_idle_rss(database_url: str) -> None:
    result = await bench_slack(database_url, events=10)
    ack = result["ack"]
    assert ack["n"] == 10
    assert 0 < ack["p50"] <= ack["p95"] <= ack["p99"]
    assert result["idle_rss_bytes"] > 10 * 1024 * 1024

"""The soak, short: three ``serve`` processes on one database under load and every fault at
once (a replica killed mid-turn and started again, the database gone for a few seconds, Slack
answering 429s and 500s, the model timing out and cutting streams), then every promise checked
(``bench.soak``). The full run and its figures are in docs/reliability.md."""

from __future__ import annotations

from bench.soak import SoakConfig, run_soak


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
    assert report.model_faults.get("timeout"), report.model_faults
    assert report.model_faults.get("cut"), report.model_faults
    assert report.model_errors >= 1  # the model's failures were shown, not hidden
    faults = [r.fault for r in report.recoveries]
    assert any("SIGKILL" in f for f in faults)
    if database_url.startswith("postgresql"):
        assert any("database unreachable" in f for f in faults)
    assert report.exit_statuses == [0, 0, 0]  # SIGTERM at the end, every replica exits cleanly

"""What the person who runs it sees and relies on: ``/metrics`` and ``/healthz``
in both modes, start-up refusals of settings that cannot work, and Slack failing mid-reply."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text as sql

import bot.http as http_listener
from bot.gc_tuning import FULL_COLLECTION_AFTER, tune_garbage_collection
from core.errors import DatabaseError
from core.messages import message_text
from core.storage.engine import Database, create_database
from core.storage.migrate import known_revisions, this_builds_head
from core.storage.sessions import SessionStore
from standins import metrics
from standins.http_proxy import HttpProxy
from standins.metrics import value
from standins.openai import GatedModel
from standins.slack import SlackClient, SlackStandIn
from standins.tcp_proxy import TcpProxy
from tests.helpers import ROOT, statements
from tests.slack_harness import ServeProcess, running_bot
from tests.test_delivery import TerminalTurn, model_env, transcript

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

METRICS = [
    "slack_agent_turns_started",
    "slack_agent_turns_finished",
    "slack_agent_turn_duration_seconds",
    "slack_agent_turn_refusals",
    "slack_agent_lock_takeovers",
    "slack_agent_locks_lost",
    "slack_agent_deliveries",
    "slack_agent_delivery_oldest_age_seconds",
    "slack_agent_waiting_messages",
    "slack_agent_deliveries_taken_over",
    "slack_agent_deliveries_finished",
    "slack_agent_model_request_seconds",
    "slack_agent_model_errors",
    "slack_agent_model_tokens",
    "slack_agent_slack_api_errors",
    "slack_agent_slack_api_rate_limited",
    "slack_agent_sweeper_deleted",
]


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        return response.status, await response.text()


async def scrape(url: str) -> metrics.Samples:
    """``/metrics`` parsed as Prometheus exposition, with every family the product promises."""
    status, body = await get(url + "/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(body))
    assert {f.name for f in families} >= set(METRICS)
    return metrics.parse(body)


async def test_metrics__parse_as_prometheus_and_move_with_turns_refusals_and_slack(
    database_url: str, slack: SlackStandIn, store: SessionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_listener, "METRICS_REFRESH_SECONDS", 0)  # each scrape reads them
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        before = await scrape(bot.url)
        slack.rate_limit_next["chat.startStream"] = [1]
        root = await client.message("count me", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        terminal = await TerminalTurn(store, root).start()
        await client.message("wait for it", thread_ts=root)
        await slack.wait_for(lambda: slack.ephemerals())
        after = await scrape(bot.url)
        await terminal.finish()
    for name, labels, delta in [
        # The terminal's turn runs in this test's process, so it counts here too.
        ("slack_agent_turns_started_total", {}, 2),
        ("slack_agent_turns_finished_total", {"outcome": "answered"}, 1),
        ("slack_agent_turn_duration_seconds_count", {"outcome": "answered"}, 1),
        ("slack_agent_model_request_seconds_count", {"provider": "offline"}, 1),
        ("slack_agent_turn_refusals_total", {"reason": "busy"}, 1),
        ("slack_agent_slack_api_rate_limited_total", {"method": "chat.startStream"}, 1),
        ("slack_agent_deliveries_finished_total", {"state": "done"}, 1),
    ]:
        moved = value(after, name, **labels) - value(before, name, **labels)
        assert moved == delta, (name, labels)
    # Read from the database: the message waiting on the terminal's turn.
    assert value(after, "slack_agent_deliveries", state="waiting", reason="ask") == 1
    assert value(after, "slack_agent_waiting_messages") == 1
    assert value(after, "slack_agent_delivery_oldest_age_seconds", state="waiting") >= 0


async def test_metrics__slack_errors_on_a_request_are_counted_by_method_and_error(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # A message's answer is made with the client Bolt built for its request: its failed calls
    # count like those of every other client.
    slack.errors["agents.sessions.setStatus"] = "not_allowed_token_type"
    labels = {"method": "agents.sessions.setStatus", "error": "not_allowed_token_type"}
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        before = await scrape(bot.url)
        await client.message("count my errors", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        after = await scrape(bot.url)
    failed = len(slack.named("agents.sessions.setStatus"))
    assert failed >= 1
    moved = value(after, "slack_agent_slack_api_errors_total", **labels) - value(
        before, "slack_agent_slack_api_errors_total", **labels
    )
    assert moved == failed


async def test_healthz_and_readyz__503_while_the_database_is_gone_then_200_and_working_again(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    parts = urlsplit(database_url)
    async with TcpProxy("127.0.0.1", parts.port or 5432) as proxy:
        url = database_url
        if parts.scheme.startswith("postgresql"):
            url = urlunsplit(parts._replace(netloc=f"postgres@127.0.0.1:{proxy.port}"))
        async with running_bot(url, slack) as bot, SlackClient(bot.url) as client:
            assert (await get(bot.url + "/healthz"))[0] == 200
            path = Path(parts.path)
            if parts.scheme.startswith("postgresql"):
                proxy.cut()
            else:
                os.rename(path, path.with_suffix(".away"))
            assert await get(bot.url + "/healthz") == (503, "database unavailable")
            assert await get(bot.url + "/readyz") == (503, "database unavailable")
            assert await get(bot.url + "/livez") == (200, "ok")  # never the database
            # /metrics still answers (its counters), without the database's gauges.
            assert (await get(bot.url + "/metrics"))[0] == 200
            if parts.scheme.startswith("postgresql"):
                proxy.restore()
            else:
                os.rename(path.with_suffix(".away"), path)
            assert (await get(bot.url + "/healthz"))[0] == 200
            assert await get(bot.url + "/readyz") == (200, "ok")
            root = await client.message("after the blip", mention=True)
            await slack.wait_for(lambda: slack.named("chat.stopStream"))
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]


@pytest.mark.parametrize("backend", ["sqlite"])  # a file that goes away: SQLite's case
async def test_sqlite__a_connection_opened_while_the_file_is_away_never_makes_an_empty_one(
    database_url: str, backend: str
) -> None:
    """A new pooled connection opened while the database file is away (renamed, deleted, its
    volume gone) used to create an empty database in its place and keep it after the real one
    was back: "no such table" from then on, on that connection. It fails instead, and once the
    file is back every connection reads it."""
    path = Path(urlsplit(database_url).path)
    db = create_database(database_url)
    try:
        async with db.read() as held:  # held open, so the next read needs a new connection
            assert await held.scalar(sql("SELECT count(*) FROM deliveries")) == 0
            os.rename(path, path.with_suffix(".away"))
            try:
                with pytest.raises(DatabaseError):
                    async with db.read() as conn:
                        await conn.scalar(sql("SELECT count(*) FROM deliveries"))
                assert not os.path.exists(path)  # noqa: ASYNC240 (a test, one stat)
            finally:
                os.rename(path.with_suffix(".away"), path)
        for _ in range(3):
            async with db.read() as conn:
                assert await conn.scalar(sql("SELECT count(*) FROM deliveries")) == 0
            async with db.write() as conn:
                await conn.execute(sql("DELETE FROM deliveries"))
    finally:
        await db.dispose()


async def test_socket_mode__healthz_and_metrics_on_the_small_http_listener(
    database_url: str, slack: SlackStandIn
) -> None:
    a = ServeProcess(database_url, slack, SLACK_APP_TOKEN="xapp-test", SLACK_SIGNING_SECRET="")
    try:
        await slack.wait_for(lambda: slack.sockets, within=30)
        await a.ready()
        status, body = await get(a.url + "/metrics")
        assert status == 200
        assert "slack_agent_turns_started_total" in body
        async with aiohttp.ClientSession() as http, http.post(a.url + "/slack/events") as r:
            assert r.status == 404  # events come over the socket; nothing to post here
    finally:
        output = await a.astop()
    assert a.proc.returncode == 0, output


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("TURN_HEARTBEAT_SECONDS", "45", "TURN_HEARTBEAT_SECONDS: 45 is not well below"),
        ("BUSY_POLL_SECONDS", "900", "BUSY_POLL_SECONDS: 900 is longer than"),
        ("MAX_CONCURRENT_TURNS", "0", "MAX_CONCURRENT_TURNS"),
    ],
)
def test_serve__settings_that_cannot_work_stop_start_up_with_one_line(
    variable: str, value: str, named: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bot", "serve"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "SLACK_BOT_TOKEN": "xoxb-x",
            "SLACK_SIGNING_SECRET": "s",
            variable: value,
        },
        check=False,
        timeout=60,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"slack-agent: config_invalid: {named}"), line


async def test_slack_5xx_and_dropped_connections__retried_and_the_reply_posted_once(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    slack.fail_next["chat.startStream"] = [500]
    slack.fail_next["chat.stopStream"] = [0]  # the connection drops without an answer
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("despite the hiccups", mention=True)
        await slack.wait_for(lambda: [c for c in slack.named("chat.stopStream") if c.result["ok"]])
    started = [c for c in slack.named("chat.startStream") if c.result["ok"]]
    assert len(started) == 1
    assert "despite the hiccups" in slack.shown(root)
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"]


async def test_stream_that_breaks_midway__the_rest_is_posted_never_cut_off(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with GatedModel(early="the first half, ") as model:
        env = {
            "model_provider": "openai",
            "openai_api_key": "sk-test",
            "openai_base_url": model.base_url,
        }
        async with running_bot(database_url, slack, **env) as bot, SlackClient(bot.url) as client:
            root = await client.message("write a lot", mention=True)
            await slack.wait_for(lambda: slack.named("chat.startStream"))
            slack.errors["chat.appendStream"] = "internal_error"
            slack.errors["chat.stopStream"] = "internal_error"
            model.gate.set()
            await slack.wait_for(lambda: slack.named("chat.postMessage"))
    shown = slack.shown(root)
    assert "the first half" in shown
    assert "answer 1" in shown
    assert message_text((await transcript(store, root))[1].message).endswith("answer 1")


async def test_busy_notice_that_cannot_be_posted__the_message_is_still_answered(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack, busy_mode="queue") as bot,
        SlackClient(bot.url) as client,
    ):
        root = await client.message("first", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        terminal = await TerminalTurn(store, root).start()
        slack.fail_next["chat.postEphemeral"] = [500] * 10  # more than the retries
        await client.message("unannounced", thread_ts=root)
        await slack.wait_for(lambda: len(slack.named("chat.postEphemeral")) >= 4)
        await terminal.finish()
        await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
    assert not [c for c in slack.named("chat.postEphemeral") if c.result.get("ok")]
    assert "unannounced" in [message_text(m.message) for m in await transcript(store, root)]


async def fail_delivery_writes(store: SessionStore, on: bool) -> None:
    """Make recording a received message fail, as a full disk or a lost database would."""
    async with store.db.write() as conn:
        if store.db.dialect == "sqlite":
            statement = (
                "CREATE TRIGGER refuse BEFORE INSERT ON deliveries "
                "BEGIN SELECT RAISE(FAIL, 'disk full'); END"
                if on
                else "DROP TRIGGER refuse"
            )
            await conn.execute(sql(statement))
            return
        if on:
            await conn.execute(
                sql(
                    "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'disk full'; END $$"
                )
            )
            await conn.execute(
                sql(
                    "CREATE TRIGGER refuse BEFORE INSERT ON deliveries "
                    "FOR EACH ROW EXECUTE FUNCTION refuse()"
                )
            )
        else:
            await conn.execute(sql("DROP TRIGGER refuse ON deliveries"))


async def test_message_that_cannot_be_recorded__is_not_acknowledged_so_slack_sends_it_again(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        await fail_delivery_writes(store, True)
        ts = client.new_ts()
        event = {
            "type": "app_mention",
            "user": "U1",
            "text": "<@UBOT> please record me",
            "ts": ts,
            "channel": "C1",
            "event_ts": ts,
            "channel_type": "channel",
        }
        assert await client.event(event) == 500  # not "received": Slack will retry
        assert not slack.named("chat.startStream")
        await fail_delivery_writes(store, False)
        assert await client.event(event, retry=1) == 200
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
    assert [m.role for m in await transcript(store, ts)] == ["user", "assistant"]


async def test_slack_answering_a_page_not_json__is_a_slack_error_the_callers_handle() -> None:
    """A proxy in front of Slack answering a plain-text error page must end in the
    ``SlackApiError`` every caller handles, counted on /metrics, not in an AttributeError
    from reading an ``error`` field out of a string."""
    from aiohttp import web
    from slack_sdk.errors import SlackApiError

    from bot.slack_api import web_client
    from core.settings import Settings
    from standins.server import serve_app

    async def not_json(_: web.Request) -> web.Response:
        return web.Response(status=405, text="405: Method Not Allowed")

    app = web.Application()
    app.router.add_route("*", "/api/{method}", not_json)
    runner, url = await serve_app(app)
    try:
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            SLACK_BOT_TOKEN="xoxb-test",
            SLACK_SIGNING_SECRET="s",
            SLACK_API_URL=f"{url}/api/",
        )
        with pytest.raises(SlackApiError):
            await web_client(settings, "xoxb-test").conversations_replies(channel="C1", ts="1.0")
    finally:
        await runner.cleanup()


async def test_slack_calls__go_through_https_proxy_whatever_no_proxy_says(
    database_url: str, slack: SlackStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the README promises an operator behind a proxy: the Slack Web API client takes
    ``HTTPS_PROXY`` for every call (slack_sdk's own rule, even to a plain-http API URL) and
    does not read ``NO_PROXY``; the model's requests follow the standard rules instead
    (``tests/test_providers_openai.py``)."""
    async with HttpProxy() as proxy:
        for name in ("http_proxy", "https_proxy", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
            monkeypatch.delenv(name.upper(), raising=False)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
            ts = await client.message("through the proxy, please", mention=True)
            await slack.wait_for(lambda: slack.named("chat.stopStream"))
        assert slack.replies(ts)
        methods = {c.method for c in slack.calls}
        assert {"chat.startStream", "chat.stopStream"} <= methods
        assert {urlsplit(url).path.rsplit("/", 1)[-1] for url in proxy.forwarded} == methods
        assert len(proxy.forwarded) == len(slack.calls)


def test_serve__start_up_freezes_its_heap_and_spaces_full_collections() -> None:
    """What ``serve`` does as it starts (``tune_garbage_collection``): what start-up made
    leaves later collections, and a full collection waits for 100 middle ones."""
    before_threshold, before_frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        tune_garbage_collection()
        assert gc.get_freeze_count() > before_frozen
        assert gc.get_threshold() == (*before_threshold[:2], FULL_COLLECTION_AFTER)
        assert before_threshold[2] < FULL_COLLECTION_AFTER
    finally:
        gc.unfreeze()
        gc.set_threshold(*before_threshold)


async def test_second_signal_while_stopping__exits_at_once_with_one_line(
    database_url: str, slack: SlackStandIn, tmp_path: Path
) -> None:
    # A grace of an hour: only the second signal can end this stop before the test's timeout.
    env = {"SHUTDOWN_GRACE_SECONDS": "3600"}
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, log=tmp_path / "serve.log", **model_env(model, **env))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                await to_a.message("hold on", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
            a.proc.send_signal(signal.SIGTERM)
            await slack.wait_for(lambda: "waiting up to 3600s for 1 running turn" in a.logged())
            a.proc.send_signal(signal.SIGINT)
            assert await a.wait() == 128 + signal.SIGINT
        finally:
            output = await a.astop()
    forced = [line for line in output.splitlines() if "again while stopping" in line]
    assert len(forced) == 1, output
    assert "SIGINT again while stopping: exiting now" in forced[0]


async def test_readyz__503_while_the_schema_is_behind_this_build_ready_when_it_is_ahead(
    database_url: str, slack: SlackStandIn, db: Database
) -> None:
    """Behind (rolled back, or not yet migrated): this build's statements would miss tables.
    A revision this build does not know is a newer build's migration during a rolling
    upgrade: the old replicas stay ready."""
    head = this_builds_head()
    older = next(r for r in known_revisions() if r != head)
    async with running_bot(database_url, slack, intake=True) as bot:
        assert await get(bot.url + "/readyz") == (200, "ok")
        for revision, expected in [
            (older, (503, f"database schema at {older}; this build needs {head}")),
            ("f0000000newer", (200, "ok")),
            (head, (200, "ok")),
        ]:
            async with db.write() as conn:
                await conn.execute(
                    sql("UPDATE alembic_version SET version_num = :r"), {"r": revision}
                )
            assert await get(bot.url + "/readyz") == expected
        assert await get(bot.url + "/livez") == (200, "ok")


async def test_serve__asks_slack_who_it_is_before_it_listens_so_no_acknowledgement_waits_on_slack(
    database_url: str, slack: SlackStandIn, store: SessionStore, tmp_path: Path
) -> None:
    """Bolt asks ``auth.test`` on the first request an app handles, inside its
    acknowledgement: a 429 there (a second's ``Retry-After``) held a restarted replica's first
    message past the acknowledgement deadline on a busy machine (the soak's 503). ``serve``
    asks once, before it listens, for both of its apps (the intake's, which records messages,
    and the turns' loop's, which takes the rest)."""
    slack.rate_limit_next["auth.test"] = [1]
    a = ServeProcess(database_url, slack, log=tmp_path / "serve.log")
    try:
        await a.ready()
        asked = len(slack.named("auth.test"))
        assert asked == 2, a.logged()  # the 429 and the answer, before /healthz answered
        async with SlackClient(a.url) as client:
            root = await client.message("hello", mention=True)  # the intake's app
            await slack.wait_for(lambda: slack.named("chat.stopStream"))
            assert await client.stop_button(root) == 200  # the turns' loop's app
        assert len(slack.named("auth.test")) == asked
    finally:
        output = await a.astop()
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"], output


async def test_stopping__readyz_503_and_livez_200_while_a_turn_drains_then_exit_0(
    database_url: str, slack: SlackStandIn, store: SessionStore, tmp_path: Path
) -> None:
    """The drain an orchestrator sees: from SIGTERM until the running turn ends, the listener
    still answers; /readyz says stopping (no new traffic), /livez that the process is alive
    (no restart), Slack's requests get 503 (sent again elsewhere); the turn finishes."""
    env = {"SHUTDOWN_GRACE_SECONDS": "60"}
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, log=tmp_path / "serve.log", **model_env(model, **env))
        try:
            await a.ready()
            assert await get(a.url + "/readyz") == (200, "ok")
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("hold on", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                a.proc.send_signal(signal.SIGTERM)
                await slack.wait_for(lambda: "waiting up to 60s for 1 running turn" in a.logged())
                assert await get(a.url + "/readyz") == (503, "stopping")
                assert await get(a.url + "/livez") == (200, "ok")
                late = {"type": "app_mention", "user": "U1", "text": "too late", "ts": "9.1"}
                assert await to_a.event({**late, "channel": "C1", "event_ts": "9.1"}) == 503
            model.release()
            assert await a.wait() == 0
        finally:
            output = await a.astop()
    assert [m.role for m in await transcript(store, root)] == ["user", "assistant"], output


async def test_metrics_port__healthz_and_metrics_on_their_own_listener_only(
    database_url: str, slack: SlackStandIn
) -> None:
    apart = {"intake": True, "metrics_port": 0, "metrics_host": "127.0.0.1"}
    async with running_bot(database_url, slack, **apart) as bot, SlackClient(bot.url) as client:
        assert bot.metrics_url is not None
        assert bot.metrics_url != bot.url
        await client.message("still answered", mention=True)  # Slack's requests: on PORT
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        for path in ("/healthz", "/livez", "/readyz"):
            assert (await get(bot.metrics_url + path)) == (200, "ok")
        samples = await scrape(bot.metrics_url)
        assert value(samples, "slack_agent_deliveries_finished_total", state="done") >= 1
        for path in ("/healthz", "/livez", "/readyz", "/metrics"):  # not on the public one
            assert (await get(bot.url + path))[0] == 404
        events = bot.metrics_url + "/slack/events"
        async with aiohttp.ClientSession() as http, http.post(events, data="{}") as r:
            assert r.status == 404  # and Slack's requests are not taken there


async def test_metrics__scrapes_share_one_read_of_the_delivery_gauges_per_refresh_period(
    database_url: str, slack: SlackStandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted in statements, not timed: with a refresh period longer than the test, twenty
    scrapes (ten of them at once) read the database once; with none, once each."""

    def gauge_reads(seen: list[tuple[str, Any]]) -> int:
        return sum(1 for statement, _ in seen if "GROUP BY deliveries.state" in statement)

    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        await client.message("something to count", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        monkeypatch.setattr(http_listener, "METRICS_REFRESH_SECONDS", 3600)
        with statements(bot.bot.deliveries.db) as seen:
            for _ in range(10):
                await scrape(bot.url)
            await asyncio.gather(*(scrape(bot.url) for _ in range(10)))
        assert gauge_reads(seen) == 1
        monkeypatch.setattr(http_listener, "METRICS_REFRESH_SECONDS", 0)
        with statements(bot.bot.deliveries.db) as seen:
            for _ in range(3):
                samples = await scrape(bot.url)
        assert gauge_reads(seen) == 3
    assert value(samples, "slack_agent_deliveries_finished_total", state="done") >= 1

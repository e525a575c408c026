"""Real ``slack-agent serve`` processes on one database: busy across replicas, a replica killed
mid-turn, SIGTERM mid-turn, the sweeper thread, start-up errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import insert, select

from bot import texts as text
from core.messages import message_text
from core.records import StoredMessage
from core.storage.dialect import ago
from core.storage.models import Delivery
from core.storage.sessions import SessionStore
from standins.openai import GatedModel
from standins.slack import SlackClient, SlackStandIn
from tests.helpers import ROOT
from tests.slack_harness import ServeProcess

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow


def model_env(model: GatedModel, **extra: Any) -> dict[str, Any]:
    return {
        "MODEL_PROVIDER": "openai",
        "OPENAI_API_KEY": "sk-test",
        "OPENAI_BASE_URL": model.base_url,
        **extra,
    }


async def started(*procs: ServeProcess) -> None:
    await asyncio.gather(*(p.ready() for p in procs))


async def transcript(store: SessionStore, root: str) -> list[StoredMessage]:
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    return await store.messages(session.id)


def assert_positions(messages: list[StoredMessage]) -> None:
    assert [m.position for m in messages] == list(range(len(messages)))
    assert len({m.message_id for m in messages}) == len(messages)


async def test_two_replicas__a_follow_up_on_the_other_waits_and_never_two_model_calls(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, **model_env(model))
        b = ServeProcess(database_url, slack, **model_env(model))
        try:
            await started(a, b)
            async with SlackClient(a.url) as to_a, SlackClient(b.url) as to_b:
                root = await to_a.message("on replica a", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                await to_b.message("on replica b", thread_ts=root)
                # The thread's own turn runs on replica a: replica b's message waits in line.
                await slack.wait_for(
                    lambda: text.follow_up_notice() in [c.text for c in slack.ephemerals()]
                )
                model.gate.set()
                await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
                assert not [c for c in slack.ephemerals() if c.args.get("blocks")]
        finally:
            await asyncio.gather(a.astop(), b.astop())
    messages = await transcript(store, root)
    assert [message_text(m.message) for m in messages] == [
        "on replica a",
        "answer 1",
        "on replica b",
        "answer 2",
    ]
    assert_positions(messages)
    assert model.max_in_flight == 1


async def test_retry_storm__two_processes_one_turn_per_message(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    a = ServeProcess(database_url, slack)
    b = ServeProcess(database_url, slack)
    try:
        await started(a, b)
        async with SlackClient(a.url) as to_a, SlackClient(b.url) as to_b:
            stamps = [to_a.new_ts() for _ in range(4)]
            await asyncio.gather(
                *(
                    c.message(f"storm {i}", ts=ts, mention=True, kind=kind, retry=retry)
                    for i, ts in enumerate(stamps)
                    for c in (to_a, to_b)
                    for kind in ("app_mention", "message")
                    for retry in (None, 1, 2)
                )
            )
            await slack.wait_for(lambda: len(slack.named("chat.stopStream")) >= 4)
    finally:
        await asyncio.gather(a.astop(), b.astop())
    for ts in stamps:
        assert len(slack.replies(ts)) == 1
        messages = await transcript(store, ts)
        assert [m.role for m in messages] == ["user", "assistant"]


async def test_replica_killed_mid_turn__another_resumes_the_turn_then_answers_the_next(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    # A window of a few seconds: a turn stops itself when its heartbeat goes unconfirmed for
    # 0.8 of the window, and a loaded machine can delay one by most of a second.
    lock = {"TURN_LOCK_STALENESS_SECONDS": "3", "TURN_HEARTBEAT_SECONDS": "0.5"}
    async with GatedModel() as model:
        a = ServeProcess(database_url, slack, **model_env(model, **lock))
        b = ServeProcess(database_url, slack, **model_env(model, **lock))
        try:
            await started(a, b)
            async with SlackClient(a.url) as to_a, SlackClient(b.url) as to_b:
                root = await to_a.message("doomed turn", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                a.kill()
                await a.wait()
                model.gate.set()
                await to_b.message("after the crash", thread_ts=root)
                await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2, within=30)
        finally:
            await asyncio.gather(a.astop(), b.astop())
    messages = await transcript(store, root)
    # The killed turn's user message is answered once, from where it was (never stored twice),
    # and the thread is told; the follow-up waited in line behind it.
    assert [message_text(m.message) for m in messages] == [
        "doomed turn",
        "answer 2",
        "after the crash",
        "answer 3",
    ]
    assert any(text.resumed() in c.text for c in slack.named("chat.startStream"))
    assert_positions(messages)
    assert model.count == 3


async def test_sweeper_thread__deletes_old_finished_delivery_records(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    table = Delivery.__table__
    row = {
        "surface": "slack",
        "thread_key": "T1/C1/1",
        "author": "U1",
        "message_id": "00000000-0000-4000-8000-000000000000",
        "text": "hi",
        "context": {},
    }
    async with store.db.write() as conn:
        await conn.execute(
            insert(table).values(event_key="old", state="done", updated_at=ago(2 * 86400), **row)
        )
        await conn.execute(insert(table).values(event_key="fresh", state="done", **row))
        # An offer still waits for its click within a day; an older one nobody answered goes.
        await conn.execute(
            insert(table).values(
                event_key="recent-offer", state="offered", updated_at=ago(3600), **row
            )
        )
        await conn.execute(
            insert(table).values(
                event_key="old-offer", state="offered", updated_at=ago(2 * 86400), **row
            )
        )
    a = ServeProcess(
        database_url, slack, SWEEPER_INTERVAL_SECONDS="0.1", SWEEPER_JITTER_SECONDS="0"
    )
    try:
        await a.ready()
        for _ in range(200):
            async with store.db.read() as conn:
                keys = set((await conn.execute(select(table.c.event_key))).scalars())
            if not keys & {"old", "old-offer"}:
                break
            await asyncio.sleep(0.05)
    finally:
        output = await a.astop()
    assert keys == {"fresh", "recent-offer"}, output
    assert "sweeper: deleted" in output
    # The sweeper thread runs by default, and a SIGTERM with it running still exits cleanly.
    assert a.proc.returncode == 0, output


def test_serve__incomplete_oauth_settings_name_the_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bot", "serve"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "SLACK_CLIENT_ID": "123", "SLACK_SIGNING_SECRET": "s"},
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "slack-agent: config_invalid: SLACK_CLIENT_SECRET: required with SLACK_CLIENT_ID "
        "(multi-workspace OAuth installs)"
    ]


async def test_socket_mode__events_arrive_over_the_websocket_and_are_acknowledged(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    a = ServeProcess(database_url, slack, SLACK_APP_TOKEN="xapp-test", SLACK_SIGNING_SECRET="")
    try:
        await slack.wait_for(lambda: slack.sockets, within=30)
        ts = "1700000999.000001"
        event = {
            "type": "app_mention",
            "user": "U1",
            "text": "<@UBOT> over the socket",
            "ts": ts,
            "channel": "C1",
            "event_ts": ts,
            "channel_type": "channel",
        }
        await slack.push(
            {
                "envelope_id": "env-1",
                "type": "events_api",
                "accepts_response_payload": False,
                "retry_attempt": 0,
                "retry_reason": "",
                "payload": {
                    "team_id": "T1",
                    "api_app_id": "A1",
                    "type": "event_callback",
                    "event_id": "EvSocket1",
                    "event_time": 1700000999,
                    "event": event,
                },
            }
        )
        await slack.wait_for(lambda: slack.named("chat.stopStream"), within=30)
    finally:
        output = await a.astop()
    assert {"envelope_id": "env-1"} in [
        {"envelope_id": ack.get("envelope_id")} for ack in slack.socket_acks
    ], output
    assert slack.named("apps.connections.open")
    assert [m.role for m in await transcript(store, ts)] == ["user", "assistant"]

"""Real ``slack-agent serve`` processes on one database: busy across replicas, a replica killed
mid-turn, SIGTERM mid-turn, the sweeper thread, start-up errors (SPEC §4, §6, §9, §10)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

from sqlalchemy import insert, select

from bot import messages as text
from core.db import ago
from core.messages import message_text
from core.models import ProcessedEvent
from core.records import StoredMessage
from core.store import SessionStore
from tests.fake_slack import FakeSlack, GatedModel, SlackClient
from tests.helpers import ROOT
from tests.slack_harness import ServeProcess


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


async def test_two_replicas__busy_on_one_never_two_model_calls_at_once(
    database_url: str, slack: FakeSlack, store: SessionStore
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
                await slack.wait_for(
                    lambda: text.busy_notice() in [c.text for c in slack.ephemerals()]
                )
                model.gate.set()
                offers = await slack.wait_for(
                    lambda: [c for c in slack.ephemerals() if c.args.get("blocks")]
                )
                (actions,) = [b for b in offers[0].args["blocks"] if b["type"] == "actions"]
                await to_a.button(text.SEND_DRAFT, actions["elements"][0]["value"])
                await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 2)
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
    database_url: str, slack: FakeSlack, store: SessionStore
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


async def test_replica_killed_mid_turn__another_takes_over_after_the_staleness_window(
    database_url: str, slack: FakeSlack, store: SessionStore
) -> None:
    lock = {
        "TURN_LOCK_STALENESS_SECONDS": "1",
        "TURN_HEARTBEAT_SECONDS": "0.2",
        "BUSY_MODE": "queue",
    }
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
                await slack.wait_for(lambda: slack.named("chat.stopStream"), within=30)
        finally:
            await asyncio.gather(a.astop(), b.astop())
    messages = await transcript(store, root)
    assert [message_text(m.message) for m in messages][:2] == ["doomed turn", "after the crash"]
    assert messages[-1].role == "assistant"
    assert_positions(messages)


async def test_sigterm_mid_turn__partial_output_kept_and_lock_released(
    database_url: str, slack: FakeSlack, store: SessionStore
) -> None:
    async with GatedModel(early="partial words") as model:
        a = ServeProcess(database_url, slack, **model_env(model))
        try:
            await a.ready()
            async with SlackClient(a.url) as to_a:
                root = await to_a.message("interrupt me", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)
                await slack.wait_for(lambda: slack.named("chat.startStream"))
                a.terminate()
                assert await a.wait() == 0
        finally:
            output = await a.astop()
    messages = await transcript(store, root)
    assert [m.role for m in messages] == ["user", "assistant"], output
    assert messages[1].message["metadata"]["interrupted"] is True
    assert "partial words" in message_text(messages[1].message)
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    assert not await store.is_turn_active(session.id)  # released, not left to go stale


async def test_sweeper_thread__deletes_old_processed_events(
    database_url: str, slack: FakeSlack, store: SessionStore
) -> None:
    table = ProcessedEvent.__table__
    async with store.db.write() as conn:
        await conn.execute(
            insert(table).values(surface="slack", event_key="old", created_at=ago(2 * 86400))
        )
        await conn.execute(insert(table).values(surface="slack", event_key="fresh"))
    a = ServeProcess(
        database_url, slack, SWEEPER_INTERVAL_SECONDS="0.1", SWEEPER_JITTER_SECONDS="0"
    )
    try:
        await a.ready()
        for _ in range(200):
            async with store.db.read() as conn:
                keys = set((await conn.execute(select(table.c.event_key))).scalars())
            if "old" not in keys:
                break
            await asyncio.sleep(0.05)
    finally:
        output = await a.astop()
    assert keys == {"fresh"}, output
    assert "sweeper: deleted" in output


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
        "slack-agent: config_invalid: SLACK_CLIENT_SECRET: required with the other "
        "SLACK_CLIENT_* OAuth settings"
    ]


async def test_socket_mode__events_arrive_over_the_websocket_and_are_acknowledged(
    database_url: str, slack: FakeSlack, store: SessionStore
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

"""The intake on its own thread and event loop (``bot.intake``), as ``serve`` runs it, on SQLite
and PostgreSQL: an acknowledgement never waits for the turns' loop, what it acknowledges is
recorded and answered, a saturated replica leaves recorded messages to a replica with room,
and ``/metrics`` shows the intake's queue and the acknowledgements' latency."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from sqlalchemy import select

from core import metrics
from core.storage.deliveries import DELIVERIES
from core.storage.engine import create_database
from standins.metrics import scrape, value
from standins.openai import GatedModel
from standins.slack import SlackClient, SlackStandIn
from tests.slack_harness import running_bot

# Lease upkeep (renewals, take-overs) every quarter second, so a replica with room takes a shed
# message over within the test. The staleness window stays the default minute: a shed record
# has no lease to lapse (it is taken at once), and the only leases that could lapse here are of
# turns that must stay where they run. A 2 s window let one pause of this process (a full
# collection, a loaded machine) hand the saturated replica's running turn to the other one.
LEASES = {"turn_heartbeat_seconds": 0.25}


def gated(model: GatedModel) -> dict[str, object]:
    return {
        "model_provider": "openai",
        "openai_api_key": "sk-test",
        "openai_base_url": model.base_url,
    }


async def test_an_acknowledgement_does_not_wait_for_the_turns_loop(
    database_url: str, slack: SlackStandIn
) -> None:
    """The turns' loop (this test's) is held still until the acknowledgement arrives: with
    the intake on that loop it never could."""
    async with running_bot(database_url, slack, intake=True) as running:
        async with SlackClient(running.url) as client:
            first = await client.message("warm up", mention=True)  # Bolt's auth.test, once
            await slack.wait_for(lambda: slack.replies(first))
        sent: dict[str, str] = {}
        acknowledged = threading.Event()

        def post_from_elsewhere() -> None:
            async def post() -> None:
                async with SlackClient(running.url) as other:
                    sent["ts"] = await other.message("while the turns' loop is held", mention=True)

            asyncio.run(post())
            acknowledged.set()

        sender = threading.Thread(target=post_from_elsewhere)
        sender.start()
        held_until_acknowledged = acknowledged.wait(60)  # blocks this loop: nothing of it runs
        await asyncio.to_thread(sender.join)
        assert held_until_acknowledged
        # Acknowledged means recorded; the worker answers it once its loop runs again.
        await slack.wait_for(lambda: slack.replies(sent["ts"]))


async def test_a_saturated_replica_leaves_recorded_messages_to_a_replica_with_room(
    database_url: str, slack: SlackStandIn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="core.conversation.intake")
    shed_before = metrics.MESSAGES_SHED._value.get()
    async with GatedModel() as model:
        settings = {**gated(model), **LEASES}
        async with (
            running_bot(database_url, slack, intake=True, max_held_messages=1, **settings) as full,
            running_bot(database_url, slack, **settings) as roomy,
            SlackClient(full.url) as client,
        ):
            held = await client.message("first: holds the only place", mention=True)
            await asyncio.wait_for(model.arrived.wait(), 30)
            left = await client.message("second: no room here", mention=True)
            db = create_database(database_url)
            try:

                async def owner_of_second() -> str | None:
                    async with db.read() as conn:
                        return await conn.scalar(
                            select(DELIVERIES.c.owner).where(DELIVERIES.c.event_key.contains(left))
                        )

                # Recorded before its acknowledgement, nobody's: the other replica takes it.
                async def taken() -> bool:
                    return await owner_of_second() == roomy.bot.deliveries.owner

                for _ in range(300):
                    if await taken():
                        break
                    await asyncio.sleep(0.1)
                assert await owner_of_second() == roomy.bot.deliveries.owner
            finally:
                await db.dispose()
            assert full.bot.worker.held == 1
            model.release()
            await slack.wait_for(lambda: slack.replies(held) and slack.replies(left))
    assert metrics.MESSAGES_SHED._value.get() == shed_before + 1
    assert any("saturated" in r.getMessage() for r in caplog.records)


async def test_a_follow_up_parked_behind_its_threads_turn_leaves_room_for_a_new_thread(
    database_url: str, slack: SlackStandIn
) -> None:
    """Room for two: a running turn and its thread's follow-up, which waits for that turn
    (it would wait as long on any replica). Counting it, the replica was full and left a new
    thread's message to others though one of its two places did nothing."""
    shed_before = metrics.MESSAGES_SHED._value.get()
    async with GatedModel() as model:
        settings = {**gated(model), **LEASES}
        async with (
            running_bot(database_url, slack, intake=True, max_held_messages=2, **settings) as one,
            SlackClient(one.url) as client,
        ):
            worker = one.bot.worker
            root = await client.message("first: its turn runs", mention=True)
            await asyncio.wait_for(model.arrived.wait(), 30)
            await client.message("a follow-up in the same thread", thread_ts=root)
            for _ in range(600):
                if worker.parked == 1:
                    break
                await asyncio.sleep(0.05)
            assert (worker.parked, worker.held) == (1, 1)
            other = await client.message("a new thread", mention=True)
            db = create_database(database_url)
            try:
                async with db.read() as conn:
                    owner = await conn.scalar(
                        select(DELIVERIES.c.owner).where(DELIVERIES.c.event_key.contains(other))
                    )
            finally:
                await db.dispose()
            assert owner == one.bot.deliveries.owner  # kept, not shed
            model.release()
            await slack.wait_for(lambda: slack.replies(other) and len(slack.replies(root)) >= 2)
    assert metrics.MESSAGES_SHED._value.get() == shed_before


async def test_metrics__the_intake_queue_and_acknowledgement_latency(
    database_url: str, slack: SlackStandIn
) -> None:
    async with (
        running_bot(database_url, slack, intake=True) as running,
        SlackClient(running.url) as client,
    ):
        ts = await client.message("counted", mention=True)
        await slack.wait_for(lambda: slack.replies(ts))
        samples = await scrape(running.url)
    assert ("slack_agent_intake_queue", ()) in samples
    assert ("slack_agent_held_messages", ()) in samples
    assert value(samples, "slack_agent_ack_seconds_count", kind="message") >= 1

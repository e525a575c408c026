"""Budgets and trace links as a Slack user meets them: the real Bolt app over signed HTTP, the
Slack stand-in, the offline model, both databases."""

from __future__ import annotations

from core.storage.sessions import SessionStore
from standins.otlp import OtlpReceiver
from standins.slack import SlackClient, SlackStandIn
from tests.slack_harness import running_bot


async def test_over_budget__an_ephemeral_names_the_limit_and_nothing_is_added(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with (
        running_bot(database_url, slack, budgets="user:day:0tokens") as bot,
        SlackClient(bot.url) as client,
    ):
        ts = await client.message("are you there?", mention=True)
        (notice,) = await slack.wait_for(lambda: slack.ephemerals("U1"))
    assert notice.text.startswith(
        ":no_entry: Not sent to the agent: the per-user budget of 0 tokens a day is used up. "
        "It resets "
    )
    assert "UTC" in notice.text
    assert slack.replies(ts) == []  # no reply: no model was called
    session = await store.find_session("slack", f"T1/C1/{ts}")
    assert session is None or await store.messages(session.id) == []


async def test_trace_url_template__the_finished_reply_links_to_its_trace(
    database_url: str, slack: SlackStandIn
) -> None:
    async with OtlpReceiver() as collector:
        async with (
            running_bot(
                database_url,
                slack,
                otel_exporter_otlp_traces_endpoint=collector.endpoint,
                trace_url_template="http://phoenix:6006/projects/p/traces/{trace_id}",
            ) as bot,
            SlackClient(bot.url) as client,
        ):
            ts = await client.message("hello", mention=True)
            await slack.wait_for(lambda: "View trace" in slack.shown(ts))
        # The bot flushed its spans when it closed.
        (trace_id,) = collector.traces()
    assert f"[View trace](http://phoenix:6006/projects/p/traces/{trace_id})" in slack.shown(ts)

"""``ReplyStream`` against the Slack stand-in: text that arrives in small pieces, as a model
writes it, still reaches Slack whole, neutralised, and within Slack's limits."""

from __future__ import annotations

import pytest
from slack_sdk.web.async_client import AsyncWebClient

from bot.render import ZWJ, open_fence
from bot.reply import SMALL_PIECE, SMALL_PIECE_WAITS, ReplyStream, StreamPacer
from bot.slack_api import retry_handlers
from standins.slack import MARKDOWN_LIMIT, MESSAGE_LIMIT, SlackFaults, SlackStandIn

THREAD = "1700000000.000001"


def stream(slack: SlackStandIn) -> ReplyStream:
    client = AsyncWebClient(token="xoxb-test", base_url=slack.api_url)
    return ReplyStream(client, channel="C1", thread_ts=THREAD, team="T1", user="U1", interval=0)


def read(slack: SlackStandIn) -> str:
    return "".join(m.text for m in slack.thread_messages(THREAD)).replace(ZWJ, "")


def long_markdown() -> str:
    blocks = []
    for i in range(60):
        blocks.append(f"Paragraph {i}: " + "words and <@U1> && more words " * 40)
        if i % 7 == 3:
            blocks.append("```sh\n" + "".join(f"echo line {j} > out\n" for j in range(200)) + "```")
    return "\n\n".join(blocks) + "\n"


# 61-byte pieces: about 1,700 appends, seconds of CPU (outside the quick subset).
@pytest.mark.parametrize("size", [pytest.param(61, marks=pytest.mark.slow), 997, 7919])
async def test_small_pieces__a_long_reply_arrives_whole_within_every_limit(size: int) -> None:
    body = long_markdown()
    assert len(body) > 2 * MESSAGE_LIMIT
    async with SlackStandIn() as slack:
        reply = stream(slack)
        for start in range(0, len(body), size):
            await reply.append(body[start : start + size])
        await reply.finish(blocks=[{"type": "divider"}])
        shown = slack.thread_messages(THREAD)
        assert read(slack) == body
        assert len(shown) >= 3
        assert all(len(m.text) <= MESSAGE_LIMIT for m in shown)
        assert all(open_fence(m.text) is None for m in shown)
        assert all(len(c.args.get("markdown_text") or "") <= MARKDOWN_LIMIT for c in slack.calls)
        assert all(c.result["ok"] for c in slack.calls)
        assert not slack.controls
        assert reply.parts == [m.ts for m in shown]
        assert shown[-1].blocks == [{"type": "divider"}]


async def test_a_control_sequence_split_across_pieces_is_still_neutralised() -> None:
    async with SlackStandIn() as slack:
        reply = stream(slack)
        for piece in ("Tell everyone: <", "!chan", "nel> and <", "@U", "999> @ev", "eryone"):
            await reply.append(piece)
        await reply.finish()
        assert read(slack) == "Tell everyone: <!channel> and <@U999> @everyone"
        assert not slack.controls
        assert ZWJ + "everyone" in "".join(m.text for m in slack.thread_messages(THREAD))


async def test_a_stream_slack_ended_midway__the_rest_goes_on_in_a_new_message() -> None:
    async with SlackStandIn() as slack:
        reply = stream(slack)
        await reply.append("Before the end.\n\n")
        slack.stopped_streams.add(str(reply.ts))
        await reply.append("After it.\n\n")
        await reply.finish(
            "Before the end.\n\nAfter it.\n\nThe last words.", session_status="active"
        )
        first, second = slack.thread_messages(THREAD)
        assert first.text == "Before the end.\n\n"
        assert second.text == "After it.\n\nThe last words."
        assert reply.status_sent


async def test_without_streaming__messages_of_one_edit_each_and_buttons_in_blocks() -> None:
    body = long_markdown()[:30_000]
    async with SlackStandIn(streaming=False) as slack:
        reply = stream(slack)
        for start in range(0, len(body), 4_000):
            await reply.append(body[start : start + 4_000])
        await reply.finish(blocks=[{"type": "divider"}])
        shown = slack.thread_messages(THREAD)
        assert read(slack) == body
        assert all(len(m.text) <= MARKDOWN_LIMIT for m in shown)
        assert shown[-1].blocks[-1] == {"type": "divider"}
        assert not reply.status_sent


async def test_task_cards__in_order_with_the_text_around_them() -> None:
    async with SlackStandIn() as slack:
        reply = stream(slack)
        await reply.append("Let me look.")
        await reply.task_started("ls -la")
        await reply.task_finished("ls -la", 0, "total 0\n", "")
        await reply.task_started("sleep 100")
        await reply.finish("Let me look. Done.")  # the turn was stopped mid-command
        methods = [
            (c.method, [ch.get("status") for ch in c.args.get("chunks") or []]) for c in slack.calls
        ]
        assert methods == [
            ("chat.startStream", []),
            ("chat.appendStream", ["in_progress"]),
            ("chat.appendStream", ["complete"]),
            ("chat.appendStream", ["in_progress"]),
            ("chat.stopStream", ["error"]),
        ]
        (message,) = slack.thread_messages(THREAD)
        assert message.text == "Let me look. Done."
        assert message.tasks["task_1"]["output"] == "total 0"


async def test_pacer__replies_streaming_at_once_share_the_budget_of_updates() -> None:
    # Four replies on a budget of two updates a second: each may update every two seconds;
    # as they finish, the interval comes back to the base.
    pacer = StreamPacer(0.5, budget=2.0)
    async with SlackStandIn() as slack:
        client = AsyncWebClient(token="xoxb-test", base_url=slack.api_url)
        replies = [
            ReplyStream(
                client,
                channel="C1",
                thread_ts=f"17000000{i}0.000001",
                team="T1",
                user="U1",
                pacer=pacer,
            )
            for i in range(4)
        ]
        assert replies[0].interval == 0.5  # nothing streams yet
        for reply in replies:
            await reply.append("first words")
        assert all(reply.interval == 2.0 for reply in replies)
        for reply in replies[:3]:
            await reply.finish()
        assert replies[3].interval == 0.5
        await replies[3].finish()
        assert len(slack.named("chat.stopStream")) == 4  # each one still arrived whole


async def test_pacing__a_small_piece_waits_for_more_words_a_large_one_goes_at_the_interval() -> (
    None
):
    # A model that trickles a word a second would cost an update per word; a piece of
    # SMALL_PIECE characters is worth one as soon as the interval allows. (Time is moved by
    # setting when the last update went, so nothing here depends on the machine's speed.)
    async with SlackStandIn() as slack:
        client = AsyncWebClient(token="xoxb-test", base_url=slack.api_url)
        reply = ReplyStream(client, channel="C1", thread_ts=THREAD, team="T1", user="U1")
        await reply.append("First words. ")  # the first text goes at once
        assert len(slack.calls) == 1

        reply._last -= reply.interval  # an interval later
        await reply.append("a few more ")
        assert len(slack.calls) == 1  # a small piece waits
        await reply.append("x" * SMALL_PIECE)
        assert len(slack.named("chat.appendStream")) == 1  # now worth an update

        reply._last -= reply.interval * (1 + SMALL_PIECE_WAITS)  # long enough
        await reply.append("last word")
        assert len(slack.named("chat.appendStream")) == 2  # a small piece goes in the end

        await reply.finish()
        assert read(slack) == "First words. a few more " + "x" * SMALL_PIECE + "last word"


async def test_through_slacks_server_errors__the_reply_arrives_whole_and_stopped() -> None:
    """With the replica's retry handlers a reply streamed while every third Web API call is
    answered 500 is shown whole and its stream stopped; the stand-in keeps the calls it
    faulted apart from the ones that changed something, each with when it came."""
    async with SlackStandIn(faults=SlackFaults(server_error=0.34)) as slack:
        client = AsyncWebClient(
            token="xoxb-test", base_url=slack.api_url, retry_handlers=retry_handlers()
        )
        reply = ReplyStream(
            client, channel="C1", thread_ts=THREAD, team="T1", user="U1", interval=0
        )
        for word in ("one ", "two ", "three ", "four "):
            await reply.append(word)  # no interval: a call per word
        await reply.finish()
        assert read(slack) == "one two three four "
        assert not any(m.streaming for m in slack.thread_messages(THREAD))
        assert slack.faulted, "no call met a fault"
        assert all(c.result == {"ok": False, "error": "server_error"} for c in slack.faulted)
        assert all(c.result["ok"] for c in slack.calls)
        times = [c.at for c in slack.calls]
        assert times == sorted(times)

"""What the model and people write reaches Slack as written, on both databases, over real HTTP
with signed requests: Markdown replies neutralised and whole
however long, sandbox commands as task cards, mrkdwn escaped, feedback buttons on every
finished reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bot import texts as text
from bot.render import ZWJ, open_fence
from core.messages import assistant_message, user_message
from core.storage.feedback import votes
from core.storage.sessions import SessionStore
from standins import openai
from standins.openai import GatedModel, OpenAIStandIn
from standins.slack import MARKDOWN_LIMIT, MESSAGE_LIMIT, SlackClient, SlackStandIn
from tests.slack_harness import running_bot
from tests.test_slack_agent import feedback_click

HOSTILE = (
    "Ping <!channel> and <!here>, <@U999>, see <#C999|secret> or "
    "<https://evil.example|your bank>; @everyone && a < b > c &lt;tag&gt;"
)


def gated(model: GatedModel) -> dict[str, Any]:
    return {
        "model_provider": "openai",
        "openai_api_key": "sk-test",
        "openai_base_url": model.base_url,
    }


@pytest.fixture(params=["streaming", "no_streaming"])
async def any_slack(request: pytest.FixtureRequest) -> AsyncIterator[SlackStandIn]:
    """Slack with its streaming methods, and a workspace without them (post and edit)."""
    async with SlackStandIn(streaming=request.param == "streaming") as fake:
        yield fake


def read(slack: SlackStandIn, thread_ts: str) -> str:
    """The reply as a person reads it (the joiners are invisible)."""
    return "".join(m.text for m in slack.thread_messages(thread_ts)).replace(ZWJ, "")


def finished(slack: SlackStandIn, thread_ts: str) -> bool:
    shown = slack.thread_messages(thread_ts)
    return bool(shown) and any(m.blocks for m in shown)


def feedback_values(slack: SlackStandIn, thread_ts: str) -> list[str]:
    values = []
    for shown in slack.thread_messages(thread_ts):
        for block in shown.blocks:
            for element in block.get("elements", []):
                if element.get("type") == "feedback_buttons":
                    values.append(element["positive_button"]["value"])
    return values


async def answer(slack: SlackStandIn, database_url: str, body: str) -> str:
    """One reply whose model writes ``body``; returns the thread."""
    async with (
        GatedModel(early=body) as model,
        running_bot(database_url, slack, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        model.release()
        root = await client.message("write it", mention=True)
        await slack.wait_for(lambda: finished(slack, root))
    return root


async def test_reply__slack_control_sequences_arrive_neutralised_and_read_as_written(
    database_url: str, any_slack: SlackStandIn
) -> None:
    root = await answer(any_slack, database_url, HOSTILE + "\n\n")
    assert HOSTILE in read(any_slack, root)
    assert not any_slack.controls  # nothing became a mention, a special mention or a link
    markdown = [c for c in any_slack.calls if c.args.get("markdown_text")]
    assert markdown
    assert "&&" in "".join(c.args["markdown_text"] for c in markdown)  # Markdown, not mrkdwn


async def test_reply__sixty_thousand_characters_arrive_whole_in_several_messages(
    database_url: str, any_slack: SlackStandIn
) -> None:
    paragraph = "Lorem ipsum dolor sit amet, <@U1> consectetur && adipiscing elit. " * 20
    code = "```python\n" + "print('x < y')\n" * 300 + "```\n\n"
    body = "\n\n".join([paragraph] * 20) + "\n\n" + code + "\n\n".join([paragraph] * 24) + "\n\n"
    assert len(body) > 60_000
    root = await answer(any_slack, database_url, body)
    shown = any_slack.thread_messages(root)
    assert len(shown) > 1
    assert body in read(any_slack, root)  # whole, in order, nothing cut
    assert all(len(m.text) <= MESSAGE_LIMIT for m in shown)
    assert all(open_fence(m.text) is None for m in shown)  # no message ends inside code
    sent = [c.args.get("markdown_text") or "" for c in any_slack.calls]
    assert all(len(piece) <= MARKDOWN_LIMIT for piece in sent)
    refused = [c.result["error"] for c in any_slack.calls if not c.result.get("ok")]
    assert set(refused) <= {"unknown_method"}  # only a workspace without streaming says no
    assert not any_slack.controls
    # The feedback buttons go under the last message only.
    assert [bool(m.blocks) for m in shown] == [False] * (len(shown) - 1) + [True]


async def test_reply__a_stream_slack_ended_continues_in_a_new_message(
    database_url: str, slack: SlackStandIn
) -> None:
    async with (
        GatedModel(early="The first part. ") as model,
        running_bot(database_url, slack, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        root = await client.message("write it", mention=True)
        await asyncio.wait_for(model.arrived.wait(), 20)
        await slack.wait_for(lambda: slack.named("chat.startStream"))
        # Slack ends the stream on its own (its time limit): it can only be edited now.
        slack.stopped_streams |= {str(c.result["ts"]) for c in slack.named("chat.startStream")}
        model.release()
        await slack.wait_for(lambda: finished(slack, root))
    first, second = slack.thread_messages(root)
    assert first.text.startswith("The first part.")
    assert "answer 1" in second.text
    assert second.blocks  # the finished reply still carries its feedback buttons


async def test_sandbox_command__shown_as_a_task_card_in_progress_then_done_or_error(
    database_url: str, slack: SlackStandIn
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("$ echo hello from the sandbox", mention=True)
        await slack.wait_for(lambda: finished(slack, root))
        again = await client.message("$ echo oops >&2; exit 3", thread_ts=root)
        await slack.wait_for(lambda: len(feedback_values(slack, root)) == 2)
    updates = [
        chunk
        for c in slack.calls
        for chunk in c.args.get("chunks") or []
        if chunk.get("type") == "task_update"
    ]
    first = [u for u in updates if u["title"] == "echo hello from the sandbox"]
    assert [u["status"] for u in first] == ["in_progress", "complete"]
    assert first[-1]["output"] == "hello from the sandbox"
    failed = [u for u in updates if u["title"] == "echo oops >&2; exit 3"]
    assert [u["status"] for u in failed] == ["in_progress", "error"]
    assert failed[-1]["output"] == "exit 3: oops"
    assert "`$ " not in read(slack, root)  # a card, not inline code
    assert again


async def test_a_model_starting_with_a_line_break_then_a_command__no_empty_message_is_shown(
    database_url: str, any_slack: SlackStandIn
) -> None:
    """A model may write a line break or two before its first tool call. The reply used to
    start its message with that text (``chat.startStream`` with ``markdown_text="\n\n"``):
    an empty message in the thread above the command's card while it ran. The card (or,
    without streaming, the command's line) starts the reply now; the blank goes nowhere."""
    slack = any_slack
    async with OpenAIStandIn() as model:
        model.push(
            openai.tool_call_reply([("call_1", "shell", {"command": "echo hi"})], text="\n\n"),
            openai.text_reply("Done."),
        )
        settings = {
            "model_provider": "openai",
            "openai_api_key": "sk-test",
            "openai_base_url": model.base_url,
        }
        async with running_bot(database_url, slack, **settings) as bot, SlackClient(bot.url) as c:
            root = await c.message("run it", mention=True)
            await slack.wait_for(lambda: finished(slack, root))
    writes = slack.named(
        "chat.startStream",
        "chat.appendStream",
        "chat.stopStream",
        "chat.postMessage",
        "chat.update",
    )
    texts = [str(w.args["markdown_text"]) for w in writes if "markdown_text" in w.args]
    assert texts
    assert all(t.strip() for t in texts), texts
    (shown,) = slack.thread_messages(root)
    if slack.streaming:
        opened = writes[0]
        assert opened.method == "chat.startStream"
        assert [chunk["type"] for chunk in opened.args["chunks"]] == ["task_update"]
        assert "markdown_text" not in opened.args
        assert shown.text == "Done."
    else:
        assert shown.text.startswith(text.tool_started("echo hi").strip()), shown.text
    assert shown.text.rstrip().endswith("Done.")


async def test_feedback__a_vote_from_a_finished_replys_own_buttons_is_stored(
    database_url: str, any_slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, any_slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("rate me", mention=True)
        await any_slack.wait_for(lambda: feedback_values(any_slack, root))
        (value,) = feedback_values(any_slack, root)
        assert await feedback_click(client, value, root) == 200
        await any_slack.wait_for(
            lambda: text.vote_noted("good") in [c.text for c in any_slack.ephemerals()]
        )
    session = await store.find_session("slack", f"T1/C1/{root}")
    assert session is not None
    _, reply = await store.messages(session.id)
    assert value == f"good:{reply.message_id}"
    assert await votes(store.db, session.id) == {reply.message_id: {"good": 1}}


async def test_mrkdwn__a_quoted_message_is_escaped_in_the_offer(
    database_url: str, slack: SlackStandIn, store: SessionStore
) -> None:
    async with running_bot(database_url, slack) as bot, SlackClient(bot.url) as client:
        root = await client.message("first", mention=True)
        await slack.wait_for(lambda: slack.named("chat.stopStream"))
        session = await store.find_session("slack", f"T1/C1/{root}")
        assert session is not None
        tail = await store.tail(session.id)
        assert tail is not None
        lease = await store.start_turn(
            session.id, user_message=user_message("terminal"), last_message_id=tail.message_id
        )
        await client.message(HOSTILE, thread_ts=root)
        await slack.wait_for(lambda: slack.ephemerals())
        await store.finish(lease, [assistant_message("done")])
        (offer,) = await slack.wait_for(
            lambda: [c for c in slack.ephemerals() if c.args.get("blocks")]
        )
    assert not slack.controls
    section = offer.args["blocks"][0]["text"]
    assert section["type"] == "mrkdwn"
    assert "&amp;&amp;" in section["text"]
    assert "&lt;!channel&gt;" in section["text"]

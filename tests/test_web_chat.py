"""Chat over the HTTP API beside Slack: one lock for both, stops, limits, budgets, loops.

Real HTTP to the real listener on both databases; every answer is parsed by the ``ai``
package's own parser."""

from __future__ import annotations

import asyncio
from typing import Any

from standins.openai import GatedModel
from standins.slack import SlackClient, SlackStandIn
from tests.slack_harness import running_bot
from tests.ui_stream import parse_ui_stream
from tests.web_harness import api_as


def gated(model: GatedModel, **extra: Any) -> dict[str, Any]:
    return {
        "model_provider": "openai",
        "openai_api_key": "sk-test",
        "openai_base_url": model.base_url,
        **extra,
    }


async def test_a_chat_while_a_slack_turn_runs_is_busy_and_writes_nothing(
    database_url: str, slack: SlackStandIn, model: GatedModel
) -> None:
    slack.members["U2"] = ["C1"]
    async with (
        running_bot(database_url, slack, **gated(model)) as bot,
        SlackClient(bot.url) as client,
    ):
        root = await client.message("slack first", mention=True)
        await asyncio.wait_for(model.arrived.wait(), 20)
        web = await api_as(bot, "slack:T1:U2")  # a member of the thread's channel
        (listed,) = (await web.get("/v1/agent_sessions")).body["data"]
        assert listed["place"]["kind"] == "slack"
        path = f"/v1/agent_sessions/{listed['id']}"
        shown = (await web.get(path)).body
        assert shown["isActive"] is True
        busy = await web.post(
            path + "/chat", {"message": "web", "lastMessageId": shown["lastMessageId"]}
        )
        assert busy.status == 409
        assert busy.body["code"] == "agent_session_busy"
        assert len((await web.get(path + "/messages")).body["data"]) == 1
        model.release()
        await slack.wait_for(lambda: "answer 1" in slack.shown(root))
        # The web sees Slack's answer and answers on it.
        for _ in range(100):
            shown = (await web.get(path)).body
            if not shown["isActive"]:
                break
            await asyncio.sleep(0.05)
        chat = await web.post(
            path + "/chat", {"message": "web next", "lastMessageId": shown["lastMessageId"]}
        )
        assert chat.status == 200, chat.body
        message = parse_ui_stream(chat.raw)
        assert any(p.get("text") == "answer 2" for p in message["parts"])
        roles = [m["role"] for m in (await web.get(path + "/messages")).body["data"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        # Someone outside the channel is told the session does not exist.
        outsider = await api_as(bot, "slack:T1:U3")
        assert (await outsider.get(path)).status == 404
        assert (await outsider.get("/v1/agent_sessions")).body["data"] == []


async def test_stop_ends_a_web_turn_keeping_its_partial_answer(
    database_url: str, slack: SlackStandIn
) -> None:
    async with (
        GatedModel(early="partly ") as model,
        running_bot(database_url, slack, **gated(model)) as bot,
    ):
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {})).body
        path = f"/v1/agent_sessions/{session['id']}"
        chatting = asyncio.create_task(
            web.post(path + "/chat", {"message": "go", "lastMessageId": None})
        )
        await asyncio.wait_for(model.arrived.wait(), 20)
        assert (await web.get(path)).body["isActive"] is True
        stopped = await web.post(path + "/stop")
        assert stopped.status == 202
        assert stopped.body == {"stopped": True}
        answer = await asyncio.wait_for(chatting, 20)
        assert answer.status == 200
        message = parse_ui_stream(answer.raw, ai_major=7)
        assert message["metadata"]["interrupted"] is True
        data = (await web.get(path + "/messages")).body["data"]
        assert [m["role"] for m in data] == ["user", "assistant"]
        assert data[1]["metadata"]["interrupted"] is True
        assert "partly" in str(data[1]["parts"])
        assert (await web.post(path + "/stop")).body == {"stopped": False}


async def test_chats_past_the_rate_limit_are_429s(database_url: str, slack: SlackStandIn) -> None:
    async with running_bot(database_url, slack, web_chats_per_minute=1) as bot:
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {})).body
        path = f"/v1/agent_sessions/{session['id']}"
        first = await web.post(path + "/chat", {"message": "one", "lastMessageId": None})
        assert first.status == 200
        last = (await web.get(path)).body["lastMessageId"]
        limited = await web.post(path + "/chat", {"message": "two", "lastMessageId": last})
        assert limited.status == 429
        assert limited.body["code"] == "rate_limited"
        assert int(limited.headers["Retry-After"]) == limited.body["retryAfter"] > 0
        assert len((await web.get(path + "/messages")).body["data"]) == 2
        other = await api_as(bot, "slack:T1:U2")  # a limit per person
        mine = (await other.post("/v1/agent_sessions", {})).body
        chat = await other.post(
            f"/v1/agent_sessions/{mine['id']}/chat", {"message": "hi", "lastMessageId": None}
        )
        assert chat.status == 200


async def test_a_chat_over_budget_is_a_409_that_calls_no_model(
    database_url: str, slack: SlackStandIn, model: GatedModel
) -> None:
    async with running_bot(database_url, slack, budgets="user:day:0tokens", **gated(model)) as bot:
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {})).body
        path = f"/v1/agent_sessions/{session['id']}"
        refused = await web.post(path + "/chat", {"message": "hi", "lastMessageId": None})
        assert refused.status == 409
        assert refused.body["code"] == "agent_session_budget_exceeded"
        assert refused.body["limit"] == "user:day:0tokens"
        assert refused.body["resetsAt"]
        assert (await web.get(path + "/messages")).body["data"] == []
        assert model.requests == []


async def test_the_chat_crosses_from_the_intakes_loop_to_the_turns(
    database_url: str, slack: SlackStandIn
) -> None:
    """As ``serve`` runs it: the listener on the intake's loop, the turn on the turns' loop,
    the stream handed back chunk by chunk; DefaultChatTransport's body."""
    async with running_bot(database_url, slack, intake=True) as bot:
        web = await api_as(bot, "slack:T1:U1")
        session = (await web.post("/v1/agent_sessions", {"title": "t"})).body
        path = f"/v1/agent_sessions/{session['id']}"
        sent = {
            "id": str(session["id"]),
            "trigger": "submit-message",
            "messageId": None,
            "messages": [{"id": "abc", "role": "user", "parts": [{"type": "text", "text": "q"}]}],
        }
        chat = await web.post(path + "/chat", sent)
        assert chat.status == 200, chat.body
        answer = parse_ui_stream(chat.raw, ai_major=6)
        # The next send names the streamed answer as the last message seen: no stale.
        sent["messages"] = [
            *sent["messages"],
            answer,
            {"id": "def", "role": "user", "parts": [{"type": "text", "text": "again"}]},
        ]
        again = await web.post(path + "/chat", sent)
        assert again.status == 200, again.body
        parse_ui_stream(again.raw, ai_major=7)
        assert len((await web.get(path + "/messages")).body["data"]) == 4


async def test_web_turns_past_the_replicas_cap_are_503s(
    database_url: str, slack: SlackStandIn, model: GatedModel
) -> None:
    async with running_bot(database_url, slack, max_concurrent_turns=1, **gated(model)) as bot:
        web = await api_as(bot, "slack:T1:U1")
        first = (await web.post("/v1/agent_sessions", {})).body
        second = (await web.post("/v1/agent_sessions", {})).body
        held = asyncio.create_task(
            web.post(
                f"/v1/agent_sessions/{first['id']}/chat", {"message": "a", "lastMessageId": None}
            )
        )
        await asyncio.wait_for(model.arrived.wait(), 20)
        path = f"/v1/agent_sessions/{second['id']}"
        refused = await web.post(path + "/chat", {"message": "b", "lastMessageId": None})
        assert refused.status == 503
        assert refused.headers["Retry-After"] == "1"
        assert (await web.get(path + "/messages")).body["data"] == []
        model.release()
        assert (await asyncio.wait_for(held, 20)).status == 200

"""Real ``slack-agent serve`` processes on PostgreSQL: the HTTP API on one replica, Slack on
the other, one session. A web turn and a Slack turn never run at once, and an approval decided
through the API clears the Slack card, and one decided in Slack is refused on the web."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from core.settings import load_settings
from core.storage import Storage
from standins.openai import GatedModel
from standins.slack import SlackClient, SlackStandIn
from tests.conftest import fresh_database_url
from tests.mcp_support import notes
from tests.slack_harness import ServeProcess
from tests.test_slack_approvals import ADD, card_updates, cards, click, mcp
from tests.test_slack_replicas import model_env, started
from tests.ui_stream import parse_ui_stream
from tests.web_harness import ApiClient

pytestmark = pytest.mark.slow


@pytest.fixture
def pg_url(tmp_path: Path, pg_template: str | None, sqlite_template: Path) -> Iterator[str]:
    yield from fresh_database_url("postgresql", tmp_path, pg_template, sqlite_template)


@pytest.fixture
async def storage(pg_url: str) -> AsyncIterator[Storage]:
    opened = Storage.open(load_settings(database_url=pg_url))
    try:
        yield opened
    finally:
        await opened.dispose()


async def token_for(storage: Storage, person: str) -> str:
    user_id = await storage.sessions.get_or_create_user(person)
    _, secret = await storage.web_access.create_token(user_id, name=None, expires_days=None)
    return secret


async def free(web: ApiClient, path: str) -> dict[str, object]:
    for _ in range(400):
        shown = (await web.get(path)).body
        if not shown["isActive"]:
            return dict(shown)
        await asyncio.sleep(0.05)
    raise AssertionError("the session stayed busy")


async def test_web_and_slack_turns_on_one_session_never_overlap(
    pg_url: str, storage: Storage, slack: SlackStandIn
) -> None:
    async with GatedModel() as model:
        api_replica = ServeProcess(pg_url, slack, **model_env(model))
        slack_replica = ServeProcess(pg_url, slack, **model_env(model))
        try:
            await started(api_replica, slack_replica)
            web = ApiClient(api_replica.url, await token_for(storage, "slack:T1:U1"))
            async with SlackClient(slack_replica.url) as to_slack:
                # A Slack turn runs on one replica: the API on the other refuses, writes nothing.
                root = await to_slack.message("from slack", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 60)
                (session,) = (await web.get("/v1/agent_sessions")).body["data"]
                path = f"/v1/agent_sessions/{session['id']}"
                assert session["isActive"] is True
                busy = await web.post(
                    path + "/chat", {"message": "web", "lastMessageId": session["lastMessageId"]}
                )
                assert busy.status == 409
                assert busy.body["code"] == "agent_session_busy"
                assert len((await web.get(path + "/messages")).body["data"]) == 1
                model.gate.set()
                shown = await free(web, path)
                # A web turn runs: Slack's message in the thread waits; never two at once.
                model.gate.clear()
                model.arrived.clear()
                chatting = asyncio.create_task(
                    web.post(
                        path + "/chat",
                        {"message": "from the web", "lastMessageId": shown["lastMessageId"]},
                    )
                )
                await asyncio.wait_for(model.arrived.wait(), 60)
                await to_slack.message("slack again", thread_ts=root)
                await slack.wait_for(lambda: slack.ephemerals())
                assert model.in_flight == 1
                model.gate.set()
                answer = await asyncio.wait_for(chatting, 60)
                assert answer.status == 200
                parse_ui_stream(answer.raw)
                await free(web, path)
            assert model.max_in_flight == 1
            data = (await web.get(path + "/messages")).body["data"]
            roles = [m["role"] for m in data]
            assert roles[:4] == ["user", "assistant", "user", "assistant"]
            assert data[2]["metadata"]["author"] == "slack:T1:U1"
        finally:
            await asyncio.gather(api_replica.astop(), slack_replica.astop())


async def test_approvals_across_replicas_clear_the_slack_card_both_ways(
    pg_url: str, storage: Storage, slack: SlackStandIn, tmp_path: Path
) -> None:
    env = {"SESSION_POLL_SECONDS": "0.3", **{k.upper(): v for k, v in mcp(tmp_path).items()}}
    api_replica = ServeProcess(pg_url, slack, **env)
    slack_replica = ServeProcess(pg_url, slack, **env)
    try:
        await started(api_replica, slack_replica)
        web = ApiClient(api_replica.url, await token_for(storage, "slack:T1:U1"))
        async with SlackClient(slack_replica.url) as to_slack:
            # Decided in Slack (on the other replica): nothing pending on the web, and a
            # decision there is refused.
            root = await to_slack.message(ADD, mention=True)
            (first,) = await slack.wait_for(lambda: cards(slack), within=90)
            (session,) = (await web.get("/v1/agent_sessions")).body["data"]
            path = f"/v1/agent_sessions/{session['id']}"
            waiting = session["pendingApproval"]
            assert waiting is not None
            assert await click(to_slack, slack, first) == 200
            await slack.wait_for(lambda: notes(tmp_path), within=60)
            await slack.wait_for(lambda: "answered" in slack.shown(root), within=60)
            late = await web.post(
                path + "/tool_approvals", {"approvalId": waiting["approvalId"], "approved": False}
            )
            assert late.status == 409
            assert late.body["code"] == "tool_approval_already_decided"
            assert (await web.get(path)).body["pendingApproval"] is None
            # Decided through the API: the Slack card, posted by the other replica, shows it.
            await to_slack.message(ADD.replace("plan", "later"), mention=True, thread_ts=root)
            await slack.wait_for(lambda: len(cards(slack)) == 2, within=90)
            second = cards(slack)[1]
            pending = (await web.get(path)).body["pendingApproval"]
            assert pending is not None
            assert pending["approvalId"] != waiting["approvalId"]
            decided = await web.post(
                path + "/tool_approvals", {"approvalId": pending["approvalId"], "approved": True}
            )
            assert decided.status == 200, decided.body
            parse_ui_stream(decided.raw)
            assert set(notes(tmp_path)) == {"plan", "later"}
            await slack.wait_for(
                lambda: any("the call ran" in t for t in card_updates(slack, second)), within=30
            )
    finally:
        await asyncio.gather(api_replica.astop(), slack_replica.astop())

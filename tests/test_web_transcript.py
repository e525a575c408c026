"""Rewind, branch, compact, usage, budgets and the admin's settings over the HTTP API, on both
databases, with the rules the Slack shortcuts keep."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from core.records import ANY_TAIL
from standins.slack import SlackStandIn
from tests.slack_harness import RunningBot, running_bot
from tests.web_harness import ApiClient, api_as


@pytest.fixture
async def running(database_url: str, slack: SlackStandIn) -> AsyncIterator[RunningBot]:
    async with running_bot(
        database_url, slack, admin_user_ids="T1:UADMIN", budgets="user:day:1000000tokens"
    ) as bot:
        yield bot


async def chatted(api: ApiClient, *lines: str) -> str:
    """A new session with ``lines`` said and answered; its path."""
    session = (await api.post("/v1/agent_sessions", {})).body
    path = f"/v1/agent_sessions/{session['id']}"
    for line in lines:
        last = (await api.get(path)).body["lastMessageId"]
        chat = await api.post(path + "/chat", {"message": line, "lastMessageId": last})
        assert chat.status == 200, chat.body
    return path


async def test_truncate_plans_then_rewinds_and_only_for_the_owner(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    admin = await api_as(running, "slack:T1:UADMIN")
    path = await chatted(api, "one", "two")
    messages = (await api.get(path + "/messages")).body["data"]
    second = messages[2]["id"]
    plan = await api.post(path + "/truncate", {"messageId": second, "dryRun": True})
    assert plan.status == 200
    assert plan.body == {"removes": 2, "irreversible": []}
    assert len((await api.get(path + "/messages")).body["data"]) == 4
    other = await api_as(running, "slack:T1:U2")
    assert (await other.post(path + "/truncate", {"messageId": second})).status == 404
    done = await api.post(path + "/truncate", {"messageId": second})
    assert done.status == 200
    assert done.body["removes"] == 2
    assert done.body["draft"] == "two"
    assert done.body["lastMessageId"] == messages[1]["id"]
    assert [m["id"] for m in (await api.get(path + "/messages")).body["data"]] == [
        m["id"] for m in messages[:2]
    ]
    elsewhere = await chatted(api, "three")
    foreign = (await api.get(elsewhere + "/messages")).body["data"][0]["id"]
    wrong = await api.post(path + "/truncate", {"messageId": foreign})
    assert wrong.status == 422
    assert wrong.body["code"] == "unprocessable"
    assert (await api.post(path + "/truncate", {})).status == 400
    # An admin may rewind anyone's session.
    assert (await admin.post(path + "/truncate", {"messageId": messages[1]["id"]})).status == 200


async def test_branch_makes_a_web_session_of_the_brancher(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    path = await chatted(api, "one", "two")
    messages = (await api.get(path + "/messages")).body["data"]
    made = await api.post(path + "/branch", {"messageId": messages[1]["id"]})
    assert made.status == 201, made.body
    branch = made.body
    assert branch["place"]["kind"] == "web"
    assert branch["owner"]["person"] == "slack:T1:U1"
    copied = (await api.get(f"/v1/agent_sessions/{branch['id']}/messages")).body["data"]
    assert [m["parts"] for m in copied] == [m["parts"] for m in messages[:2]]
    assert branch["lastMessageId"] == copied[-1]["id"]
    assert len((await api.get(path + "/messages")).body["data"]) == 4  # the original stays


async def test_compact_adds_a_checkpoint(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    path = await chatted(api, "one", "two")
    compacted = await api.post(path + "/compact")
    assert compacted.status == 200, compacted.body
    checkpoint = compacted.body["checkpointMessageId"]
    data = (await api.get(path + "/messages")).body["data"]
    (marked,) = [m for m in data if m["metadata"]["checkpoint"]]
    assert marked["id"] == checkpoint


async def test_usage_and_budgets_are_the_callers_own(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    other = await api_as(running, "slack:T1:U2")
    await chatted(api, "one")
    (row,) = (await api.get("/v1/usage?by=user")).body["rows"]
    assert row["key"] == "slack:T1:U1"
    assert row["inputTokens"] > 0
    assert row["requests"] == 1
    assert (await other.get("/v1/usage?by=day")).body["rows"] == []
    assert (await other.get("/v1/usage?scope=all")).status == 403
    assert (await api.get("/v1/usage?by=nothing")).status == 400
    assert (await api.get("/v1/usage?since=yesterday")).status == 400
    (budget,) = (await api.get("/v1/budgets")).body["budgets"]
    assert budget["limit"] == "user:day:1000000tokens"
    assert budget["used"] > 0
    assert budget["resetsAt"]
    assert (await other.get("/v1/budgets")).body["budgets"][0]["used"] == 0


async def test_admin_settings_for_admins_only(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    admin = await api_as(running, "slack:T1:UADMIN")
    for path in ("/v1/admin/retention", "/v1/admin/budgets", "/v1/admin/tools"):
        refused = await api.get(path)
        assert refused.status == 403
        assert refused.body["code"] == "forbidden"
        assert (await admin.get(path)).status == 200
    changed = await admin.call("PUT", "/v1/admin/retention", {"maxIdleDays": 7, "maxPerUser": 3})
    assert changed.body == {"maxIdleDays": 7, "maxPerUser": 3}
    assert (await admin.get("/v1/admin/retention")).body == changed.body
    assert (await api.call("PUT", "/v1/admin/retention", {"maxIdleDays": 1})).status == 403
    bad = await admin.call("PUT", "/v1/admin/budgets", {"entries": "user:fortnight:5tokens"})
    assert bad.status == 400
    assert "\n" not in bad.body["message"]
    set_ = await admin.call("PUT", "/v1/admin/budgets", {"entries": "all:month:500usd"})
    assert set_.status == 200
    assert "all:month:500" in (await admin.get("/v1/admin/budgets")).body["entries"]
    assert (await admin.get("/v1/admin/tools")).body == {"servers": []}
    everyone = await admin.get("/v1/usage?scope=all&by=user")
    assert everyone.status == 200


async def test_admin_exports_and_erases_a_person_from_the_api(running: RunningBot) -> None:
    """``user export`` and ``user erase`` as the admin page offers them: admins only, the export
    as JSON lines naming each record, the erase saying what it removed, a malformed person a
    400, and an erase refused (nothing removed) while a turn of theirs holds a session."""
    api = await api_as(running, "slack:T1:U1")
    admin = await api_as(running, "slack:T1:UADMIN")
    path = await chatted(api, "remember the plan")
    people = "/v1/admin/people/T1:U1"
    assert (await api.get(people + "/export")).status == 403
    assert (await api.post(people + "/erase")).status == 403
    assert (await admin.get("/v1/admin/people/nobody/export")).status == 400
    exported = await admin.get(people + "/export")
    assert exported.status == 200
    assert exported.headers["Content-Type"].startswith("application/x-ndjson")
    kinds = {json.loads(line)["record"] for line in exported.raw.decode().splitlines()}
    assert {"person", "session", "message"} <= kinds
    session_id = int(path.rsplit("/", 1)[1])
    sessions = running.bot.runtime.storage.sessions
    lease = await sessions.start_turn(session_id, user_message=None, last_message_id=ANY_TAIL)
    busy = await admin.post(people + "/erase")
    assert busy.status == 409
    assert busy.body["code"] == "agent_session_busy"
    assert (await api.get(path)).status == 200  # nothing removed
    await sessions.release(lease)
    erased = await admin.post(people + "/erase")
    assert erased.status == 200
    assert erased.body["erased"]["sessions"] == 1
    assert erased.body["erased"]["tokens"] == 1  # the token the test used
    assert (await api.get(path)).status == 401  # its token went with them
    assert (await admin.get(path)).status == 404


async def test_an_admin_sees_their_workspace_and_the_terminal_never_another_workspace(
    running: RunningBot,
) -> None:
    """``ADMIN_USER_IDS`` names an admin of one workspace (``T1:UADMIN``): over the API they see
    every session of T1 and the terminal's, and another workspace's are a 404 to them, as to
    anyone (a deployment serving several workspaces keeps them apart); everyone's usage is
    everyone's of T1."""
    admin = await api_as(running, "slack:T1:UADMIN")
    ours = await chatted(await api_as(running, "slack:T1:U1"), "ours")
    theirs = await chatted(await api_as(running, "slack:T2:U9"), "theirs")
    terminal = running.bot.runtime.conversations("cli")
    operator = await terminal.person("cli:root", admin=True)
    console = await terminal.open("root/1", owner=operator, title="from the terminal")
    listed = {s["id"] for s in (await admin.get("/v1/agent_sessions?scope=all")).body["data"]}
    assert int(ours.rsplit("/", 1)[1]) in listed
    assert console.id in listed
    assert int(theirs.rsplit("/", 1)[1]) not in listed
    assert (await admin.get(ours)).status == 200
    assert (await admin.get(theirs)).status == 404
    assert (await admin.call("DELETE", theirs)).status == 404
    # Their usage too: everyone of T1 (the web turns charged to T1), nobody of T2.
    users = {r["key"] for r in (await admin.get("/v1/usage?scope=all&by=user")).body["rows"]}
    assert "slack:T1:U1" in users
    assert "slack:T2:U9" not in users
    spaces = {r["key"] for r in (await admin.get("/v1/usage?scope=all&by=workspace")).body["rows"]}
    assert spaces == {"T1"}

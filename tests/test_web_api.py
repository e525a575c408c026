"""The HTTP API over real HTTP on both databases: sessions, transcripts, chat, who sees what."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from standins.otlp import OtlpReceiver
from standins.slack import SlackStandIn
from tests.slack_harness import RunningBot, running_bot
from tests.ui_stream import parse_ui_stream
from tests.web_harness import ApiClient, api_as, person_token


@pytest.fixture
async def running(database_url: str, slack: SlackStandIn) -> AsyncIterator[RunningBot]:
    async with running_bot(database_url, slack, admin_user_ids="T1:UADMIN") as bot:
        yield bot


async def test_a_session_is_made_listed_chatted_in_renamed_and_deleted(
    running: RunningBot,
) -> None:
    api = await api_as(running, "slack:T1:U1")
    me = await api.get("/v1/me")
    assert me.status == 200
    assert me.body["person"] == "slack:T1:U1"
    assert me.body["admin"] is False
    assert me.body["csrfToken"] is None

    made = await api.post("/v1/agent_sessions", {"title": "first"})
    assert made.status == 201, made.body
    session = made.body
    assert session["title"] == "first"
    assert session["place"]["kind"] == "web"
    assert session["isActive"] is False
    assert session["lastMessageId"] is None
    path = f"/v1/agent_sessions/{session['id']}"

    listed = await api.get("/v1/agent_sessions")
    assert [s["id"] for s in listed.body["data"]] == [session["id"]]

    for major in (6, 7):
        last = (await api.get(path)).body["lastMessageId"]
        chat = await api.post(path + "/chat", {"message": f"hello {major}", "lastMessageId": last})
        assert chat.status == 200, chat.raw
        assert chat.headers["x-vercel-ai-ui-message-stream"] == "v1"
        message = parse_ui_stream(chat.raw, ai_major=major)
        assert message["role"] == "assistant"
        assert any(p["type"] == "text" and p["text"] for p in message["parts"])
        assert (await api.get(path)).body["lastMessageId"] == message["id"]

    page = await api.get(path + "/messages?limit=3")
    assert page.status == 200
    assert [m["role"] for m in page.body["data"]] == ["user", "assistant", "user"]
    assert page.body["data"][0]["metadata"]["author"] == "slack:T1:U1"
    assert page.body["data"][0]["metadata"]["createdAt"].endswith("Z")
    usage = page.body["data"][1]["metadata"]["usage"]
    assert usage["inputTokens"] > 0
    assert "costUsd" in usage
    rest = await api.get(path + f"/messages?cursor={page.body['nextCursor']}")
    assert [m["role"] for m in rest.body["data"]] == ["assistant"]
    assert rest.body["nextCursor"] is None

    renamed = await api.call("PATCH", path, {"title": "renamed"})
    assert renamed.status == 200
    assert renamed.body["title"] == "renamed"
    gone = await api.call("DELETE", path)
    assert gone.status == 204
    assert (await api.get(path)).status == 404


async def test_chat_refusals_are_409s_that_write_nothing(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    session = (await api.post("/v1/agent_sessions", {})).body
    path = f"/v1/agent_sessions/{session['id']}"
    first = await api.post(path + "/chat", {"message": "one", "lastMessageId": None})
    assert first.status == 200
    # The client has not seen the answer: stale, with how many it missed.
    stale = await api.post(path + "/chat", {"message": "two", "lastMessageId": None})
    assert stale.status == 409
    assert stale.body["code"] == "agent_session_messages_stale"
    assert stale.body["unseen"] == 2
    messages = (await api.get(path + "/messages")).body["data"]
    assert len(messages) == 2


async def test_who_sees_what(running: RunningBot) -> None:
    owner = await api_as(running, "slack:T1:U1")
    other = await api_as(running, "slack:T1:U2")
    stranger = await api_as(running, "slack:T2:U1")
    admin = await api_as(running, "slack:T1:UADMIN")
    session = (await owner.post("/v1/agent_sessions", {"title": "mine"})).body
    path = f"/v1/agent_sessions/{session['id']}"
    for someone in (other, stranger):
        assert (await someone.get(path)).status == 404
        assert (await someone.get(path + "/messages")).status == 404
        chat = await someone.post(path + "/chat", {"message": "x", "lastMessageId": None})
        assert chat.status == 404
        assert (await someone.call("DELETE", path)).status == 404
        assert (await someone.get("/v1/agent_sessions")).body["data"] == []
    assert (await admin.get(path)).status == 200
    assert (await other.get("/v1/agent_sessions?scope=all")).status == 403
    everything = await admin.get("/v1/agent_sessions?scope=all")
    assert [s["id"] for s in everything.body["data"]] == [session["id"]]
    assert (await owner.get(path + "/messages")).body["data"] == []


async def test_keys_that_open_nothing(running: RunningBot) -> None:
    storage = running.bot.runtime.storage
    assert (await ApiClient(running.url).get("/v1/me")).status == 401
    assert (await ApiClient(running.url, "sat_nothing").get("/v1/me")).status == 401
    _, expired = await person_token(running, "slack:T1:U1", expires_days=-1)
    assert (await ApiClient(running.url, expired).get("/v1/me")).body["code"] == "unauthenticated"
    _, revoked = await person_token(running, "slack:T1:U1")
    token_id = max(t.id for t in await storage.web_access.tokens())
    await storage.web_access.revoke_token(token_id)
    assert (await ApiClient(running.url, revoked).get("/v1/me")).status == 401


async def test_a_cookie_changes_nothing_without_its_csrf_token(running: RunningBot) -> None:
    storage = running.bot.runtime.storage
    user_id = await storage.sessions.get_or_create_user("slack:T1:U1")
    cookie = await storage.web_access.sign_in(user_id, lifetime_seconds=600)
    browser = ApiClient(running.url, cookie=cookie)
    me = await browser.get("/v1/me")
    assert me.status == 200
    assert me.body["csrfToken"]
    refused = await browser.post("/v1/agent_sessions", {})
    assert refused.status == 403
    assert refused.body["code"] == "csrf_failed"
    wrong = ApiClient(running.url, cookie=cookie, csrf="nope")
    assert (await wrong.post("/v1/agent_sessions", {})).status == 403
    right = ApiClient(running.url, cookie=cookie, csrf=me.body["csrfToken"])
    assert (await right.post("/v1/agent_sessions", {})).status == 201
    assert len((await browser.get("/v1/agent_sessions")).body["data"]) == 1


BAD_BODIES = [
    (b"{not json", 400, "bad_request"),
    (b"[1, 2]", 400, "bad_request"),
    (b'{"message": 5, "lastMessageId": null}', 400, "bad_request"),
    (b'{"message": "hi"}', 400, "bad_request"),
    (b'{"message": "hi", "lastMessageId": 7}', 400, "bad_request"),
    (b'{"messages": [], "trigger": "submit-message"}', 400, "bad_request"),
    (b'{"message": "' + b"x" * (1 << 20) + b'", "lastMessageId": null}', 413, "too_large"),
]


async def test_bad_bodies_are_one_line_4xx_that_write_nothing(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    session = (await api.post("/v1/agent_sessions", {})).body
    path = f"/v1/agent_sessions/{session['id']}"
    for data, status, code in BAD_BODIES:
        answer = await api.call(
            "POST", path + "/chat", data=data, headers={"Content-Type": "application/json"}
        )
        assert answer.status == status, (data[:40], answer.raw[:200])
        assert answer.body["code"] == code
        assert "\n" not in answer.body["message"]
    assert (await api.get(path + "/messages")).body["data"] == []
    assert (await api.get("/v1/agent_sessions/99999999")).status == 404
    assert (await api.get("/v1/agent_sessions/abc")).status == 404
    assert (await api.get("/v1/agent_sessions?limit=0")).status == 400
    assert (await api.get("/v1/agent_sessions?cursor=%%%")).status == 400
    assert (await api.get("/v1/nothing")).body["code"] == "not_found"


async def test_a_nul_the_database_refuses_is_a_400_naming_it_that_changes_nothing(
    running: RunningBot, backend: str
) -> None:
    """PostgreSQL refuses a NUL in a text (SQLSTATE 22021). Where one reaches it from a
    request (an id, a search), the request is at fault and would be refused again: a 400
    ``database_value_refused`` in one line, not the 503 "try again" of a database that failed.
    SQLite stores a NUL, so there the same requests get their ordinary answers. Where the API
    writes text (a title, a message), NUL is dropped or replaced first, on both databases."""
    api = await api_as(running, "slack:T1:U1")
    session = (await api.post("/v1/agent_sessions", {"title": "a\u0000b"})).body
    assert session["title"] == "ab"
    path = f"/v1/agent_sessions/{session['id']}"
    sent = await api.post(path + "/chat", {"message": "x\u0000y", "lastMessageId": None})
    assert sent.status == 200
    before = (await api.get(path + "/messages")).body["data"]
    assert before[0]["parts"][0]["text"] == "x\ufffdy"
    last = before[-1]["id"]
    nul_id = f"{last}\u0000"
    refused = backend == "postgresql"
    for method, target, body, elsewise in [
        ("GET", "/v1/agent_sessions?q=a%00b", None, 200),
        ("POST", path + "/chat", {"message": "again", "lastMessageId": nul_id}, 409),
        ("POST", path + "/truncate", {"messageId": nul_id}, 422),
        ("POST", path + "/branch", {"messageId": nul_id}, 422),
    ]:
        answer = await api.call(method, target, body)
        assert answer.status == (400 if refused else elsewise), (target, answer.raw[:300])
        if refused:
            assert answer.body["code"] == "database_value_refused"
            assert "0x00" in answer.body["message"]
            assert "\n" not in answer.body["message"]
    assert (await api.get(path + "/messages")).body["data"] == before
    assert [s["id"] for s in (await api.get("/v1/agent_sessions")).body["data"]] == [session["id"]]
    assert (await api.get(path)).body["isActive"] is False


async def test_a_message_id_sent_twice_is_stored_once(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    session = (await api.post("/v1/agent_sessions", {})).body
    path = f"/v1/agent_sessions/{session['id']}"
    mine = {
        "id": "0190e0c8-7a51-7cc2-9d1e-5b2f6f0a1b2c",
        "role": "user",
        "parts": [{"type": "text", "text": "once"}],
    }
    first = await api.post(path + "/chat", {"message": mine, "lastMessageId": None})
    assert first.status == 200
    stored = (await api.get(path + "/messages")).body["data"]
    assert stored[0]["id"] == mine["id"]
    last = stored[-1]["id"]
    again = await api.post(path + "/chat", {"message": mine, "lastMessageId": last})
    assert again.status == 409
    assert again.body["code"] == "agent_session_message_duplicate"
    assert len((await api.get(path + "/messages")).body["data"]) == 2


async def test_the_list_pages_newest_first_and_finds_words(running: RunningBot) -> None:
    api = await api_as(running, "slack:T1:U1")
    made = [(await api.post("/v1/agent_sessions", {"title": f"plan {n}"})).body for n in range(3)]
    await api.call("PATCH", f"/v1/agent_sessions/{made[0]['id']}", {"title": "Plan zero"})
    seen: list[int] = []
    cursor = ""
    for _ in range(4):
        page = (await api.get(f"/v1/agent_sessions?limit=1{cursor}")).body
        seen += [s["id"] for s in page["data"]]
        if page["nextCursor"] is None:
            break
        cursor = f"&cursor={page['nextCursor']}"
    assert seen == [made[0]["id"], made[2]["id"], made[1]["id"]]  # the renamed one is newest
    found = (await api.get("/v1/agent_sessions?q=ZERO")).body["data"]
    assert [s["id"] for s in found] == [made[0]["id"]]
    own = (await api.get("/v1/agent_sessions?scope=own")).body["data"]
    assert len(own) == 3


TRACES = "http://phoenix:6006/projects/p/traces/{trace_id}"


async def test_an_answer_links_to_its_trace_when_streamed_and_when_read_back(
    database_url: str, slack: SlackStandIn
) -> None:
    """The answer keeps its turn's trace id (``metadata.trace_id``), so the transcript read
    later links to the same trace the stream's ``finish`` chunk did, with the template
    configured when it is read; without tracing an answer has neither."""
    async with OtlpReceiver() as collector:
        async with running_bot(
            database_url,
            slack,
            otel_exporter_otlp_traces_endpoint=collector.endpoint,
            trace_url_template=TRACES,
        ) as bot:
            api = await api_as(bot, "slack:T1:U1")
            path = f"/v1/agent_sessions/{(await api.post('/v1/agent_sessions', {})).body['id']}"
            chat = await api.post(path + "/chat", {"message": "hello", "lastMessageId": None})
            assert chat.status == 200, chat.raw
            streamed = parse_ui_stream(chat.raw, ai_major=6)["metadata"]["traceUrl"]
            user, answer = (await api.get(path + "/messages")).body["data"]
        (trace_id,) = collector.traces()
    assert streamed == answer["metadata"]["traceUrl"] == TRACES.format(trace_id=trace_id)
    assert answer["metadata"]["trace_id"] == trace_id
    assert "traceUrl" not in user["metadata"]
    # A replica started without a template shows no link to the same stored answer.
    async with running_bot(database_url, slack) as bot:
        api = await api_as(bot, "slack:T1:U1")
        (_, answer) = (await api.get(path + "/messages")).body["data"]
        assert "traceUrl" not in answer["metadata"]
        chat = await api.post(path + "/chat", {"message": "again", "lastMessageId": answer["id"]})
        assert "traceUrl" not in (parse_ui_stream(chat.raw, ai_major=6)["metadata"] or {})
        untraced = (await api.get(path + "/messages")).body["data"][-1]
        assert "trace_id" not in untraced["metadata"]

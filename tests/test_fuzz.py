"""Bad input at the door, fuzzed (hypothesis): ``/slack/events`` and the interactivity payloads
that arrive on it, on both databases.

- Unsigned, forged, stale, truncated, oversized or wrongly encoded requests get a 4xx, and
  nothing of theirs reaches the database (every table's row count is unchanged).
- Correctly signed payloads whose values are of the wrong JSON type anywhere (at the top level
  and in every field, where Bolt or the app expects an object, a list or a string) never get a
  5xx and never crash the process: it answers a real message afterwards.

The bot runs in its own thread and event loop, so the (synchronous) hypothesis tests drive it
over real HTTP as Slack would, many examples against one process.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from core.storage.engine import create_database
from core.storage.models import Base
from standins.slack import BOT_USER, SIGNING_SECRET, SlackStandIn, signed_headers
from tests.conftest import run_isolated
from tests.slack_harness import running_bot

# Hypothesis warns when the global ``random`` state changes while it draws an example, taking
# it for a strategy using ``random``. Here the bot under test runs in another thread of this
# process, and what it runs draws from ``random`` (aiohttp's connection pool shuffles its
# waiters with it; slack_sdk's retry backoff adds jitter), at moments that depend on timing: the
# warning names nothing these strategies do, and it failed one run in a few.
# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning"),
]

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass
class LiveBot:
    url: str
    slack: SlackStandIn
    loop: asyncio.AbstractEventLoop

    def calls(self, method: str) -> int:
        return len(self.slack.named(method))


@pytest.fixture
def live_bot(database_url: str) -> Iterator[LiveBot]:
    ready: dict[str, Any] = {}
    started, stopping = threading.Event(), None

    async def serve() -> None:
        nonlocal stopping
        stopping = asyncio.Event()
        async with SlackStandIn() as slack, running_bot(database_url, slack) as bot:
            ready["bot"] = LiveBot(bot.url, slack, asyncio.get_running_loop())
            started.set()
            await stopping.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(60), "the bot did not start"
    live: LiveBot = ready["bot"]
    yield live
    assert stopping is not None
    live.loop.call_soon_threadsafe(stopping.set)
    thread.join(60)


def row_counts(database_url: str) -> dict[str, int]:
    async def count() -> dict[str, int]:
        db = create_database(database_url)
        try:
            async with db.read() as conn:
                return {
                    name: int(await conn.scalar(select(func.count()).select_from(table)))
                    for name, table in Base.metadata.tables.items()
                }
        finally:
            await db.dispose()

    result: dict[str, int] = run_isolated(count)
    return result


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    with httpx.Client(timeout=30) as client:
        return client.post(url + "/slack/events", content=body, headers=headers).status_code


# -- unsigned, forged, stale, truncated, oversized, wrongly encoded -------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def event_body(text: str = "hello") -> dict[str, Any]:
    ts = f"{int(time.time())}.{time.perf_counter_ns() % 1_000_000:06d}"
    return {
        "token": "legacy",
        "team_id": "T1",
        "api_app_id": "A1",
        "type": "event_callback",
        "event_id": f"Ev{ts}",
        "event_time": int(time.time()),
        "event": {
            "type": "app_mention",
            "user": "U1",
            "text": f"<@{BOT_USER}> {text}",
            "ts": ts,
            "channel": "C1",
            "event_ts": ts,
            "channel_type": "channel",
        },
    }


def _signature(body: bytes, timestamp: str, secret: str = SIGNING_SECRET) -> str:
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


# What an HTTP header can carry (an HTTP client refuses anything else).
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=80)
FORGERIES = st.sampled_from(
    ["none", "garbage", "wrong_secret", "stale", "future", "truncated", "other_body", "no_ts"]
)


@st.composite
def forged_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    kind = draw(FORGERIES)
    payload = draw(st.one_of(st.just(event_body()), JSON))
    body = json.dumps(payload).encode()
    now = str(int(time.time()))
    headers = {
        "Content-Type": draw(
            st.sampled_from(["application/json", "application/x-www-form-urlencoded", "text/plain"])
        )
    }
    if kind == "garbage":
        headers.update({"X-Slack-Request-Timestamp": now, "X-Slack-Signature": draw(HEADER_TEXT)})
    elif kind == "wrong_secret":
        headers.update(
            {
                "X-Slack-Request-Timestamp": now,
                "X-Slack-Signature": _signature(body, now, "not-the-secret"),
            }
        )
    elif kind in ("stale", "future"):
        when = str(int(time.time()) + (-600 if kind == "stale" else 600))
        headers.update(
            {"X-Slack-Request-Timestamp": when, "X-Slack-Signature": _signature(body, when)}
        )
    elif kind == "truncated":
        headers.update(
            {"X-Slack-Request-Timestamp": now, "X-Slack-Signature": _signature(body, now)}
        )
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    elif kind == "other_body":
        other = json.dumps(event_body("something else")).encode()
        headers.update(
            {"X-Slack-Request-Timestamp": now, "X-Slack-Signature": _signature(other, now)}
        )
    elif kind == "no_ts":
        headers["X-Slack-Signature"] = _signature(body, now)
    return body, headers


def test_fuzz__unsigned_forged_stale_and_truncated_requests_get_4xx_and_write_nothing(
    live_bot: LiveBot, database_url: str
) -> None:
    before = row_counts(database_url)

    @FUZZ
    @given(forged_requests())
    def attempt(request: tuple[bytes, dict[str, str]]) -> None:
        body, headers = request
        assert post(live_bot.url, body, headers) in (400, 401, 413)

    attempt()
    assert row_counts(database_url) == before
    assert live_bot.calls("chat.startStream") == 0


def test_fuzz__oversized_and_wrongly_encoded_bodies_get_4xx(
    live_bot: LiveBot, database_url: str
) -> None:
    before = row_counts(database_url)
    now = str(int(time.time()))
    huge = json.dumps(event_body("x" * (2 << 20))).encode()
    headers = {"X-Slack-Request-Timestamp": now, "X-Slack-Signature": _signature(huge, now)}
    assert post(live_bot.url, huge, {**headers, "Content-Type": "application/json"}) == 413
    for bad in (
        b"\xff\xfe{\x00}",
        b'{"type": "event_callback", "event": "\xc3\x28"}',
        b"\x80" * 64,
    ):
        signed = {"X-Slack-Request-Timestamp": now, "X-Slack-Signature": _signature(bad, now)}
        for content_type in ("application/json", "application/x-www-form-urlencoded"):
            assert post(live_bot.url, bad, {**signed, "Content-Type": content_type}) == 400
    assert row_counts(database_url) == before


# -- signed, with values of the wrong type anywhere -----------------------------------------------


def interaction_payloads() -> list[dict[str, Any]]:
    team = {"id": "T1", "domain": "test"}
    user = {"id": "U1", "team_id": "T1"}
    return [
        {
            "type": "block_actions",
            "team": team,
            "user": user,
            "channel": {"id": "C1"},
            "container": {"type": "message", "channel_id": "C1", "is_ephemeral": True},
            "trigger_id": "trig",
            "response_url": "http://127.0.0.1:1/unused",
            "actions": [
                {"type": "button", "action_id": "draft_send", "value": "1", "block_id": "b"}
            ],
        },
        {
            "type": "block_actions",
            "team": team,
            "user": user,
            "channel": {"id": "C1"},
            "trigger_id": "trig",
            "actions": [{"type": "button", "action_id": "compact_pick:x", "value": "[1, null]"}],
        },
        *(
            {
                "type": "message_action",
                "callback_id": callback,
                "trigger_id": "trig",
                "team": team,
                "user": user,
                "channel": {"id": "C1", "name": "general"},
                "message": {
                    "type": "message",
                    "ts": "1700000000.000001",
                    "thread_ts": "1700000000.000001",
                },
                "message_ts": "1700000000.000001",
                "response_url": "http://127.0.0.1:1/unused",
            }
            for callback in ("rewind_session", "fork_session", "compact_session")
        ),
    ]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += _paths(inner, (*prefix, index))
    return found


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = json.loads(json.dumps(value))
    target = copy
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return copy


@st.composite
def type_confused(draw: st.DrawFn) -> tuple[bytes, str]:
    """A payload Slack could send, with one value (or the whole) swapped for another JSON type."""
    kind = draw(st.sampled_from(["event", "event", "interaction", "command"]))
    if kind == "command":
        fields = {
            "token": "legacy",
            "team_id": "T1",
            "channel_id": "C1",
            "user_id": "U1",
            "command": "/compact",
            "text": "https://test.slack.com/archives/C1/p1700000000000001",
            "response_url": "http://127.0.0.1:1/unused",
            "trigger_id": "trig",
        }
        key = draw(st.sampled_from(sorted(fields)))
        fields[key] = draw(st.one_of(st.text(max_size=60), JSON.map(json.dumps)))
        return urllib.parse.urlencode(fields).encode(), "application/x-www-form-urlencoded"
    base: Any = event_body() if kind == "event" else draw(st.sampled_from(interaction_payloads()))
    path = draw(st.sampled_from(_paths(base)))
    mutated = _replace(base, path, draw(JSON))
    if kind == "event":
        return json.dumps(mutated).encode(), "application/json"
    body = urllib.parse.urlencode({"payload": json.dumps(mutated)})
    return body.encode(), "application/x-www-form-urlencoded"


def test_fuzz__signed_payloads_of_the_wrong_types_never_get_a_5xx(live_bot: LiveBot) -> None:
    @FUZZ
    @given(type_confused())
    def attempt(request: tuple[bytes, str]) -> None:
        body, content_type = request
        headers = {**signed_headers(body.decode()), "Content-Type": content_type}
        status = post(live_bot.url, body, headers)
        assert status < 500, (status, body[:300])

    attempt()
    # Still serving: a real mention is acknowledged and answered.
    body = json.dumps(event_body("still there?"))
    assert (
        post(
            live_bot.url,
            body.encode(),
            {**signed_headers(body), "Content-Type": "application/json"},
        )
        == 200
    )
    deadline = time.monotonic() + 30
    while not live_bot.calls("chat.stopStream") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_bot.calls("chat.stopStream") >= 1


def test_fuzz__a_nul_in_an_id_is_a_malformed_payload_not_a_5xx(
    live_bot: LiveBot, database_url: str, backend: str
) -> None:
    """Found by the test above: PostgreSQL refuses a NUL in text (SQLSTATE 22021, a data
    exception), so a user id holding one failed the record with a 500 that Slack would send
    again forever. The value is the payload's fault (``database_value_refused``): a 400
    there, and nothing was written (SQLite stores the value, and the message is taken)."""
    raw = json.dumps(_replace(event_body(), ["event", "user"], "\u0000")).encode()
    headers = {**signed_headers(raw.decode()), "Content-Type": "application/json"}
    before = row_counts(database_url)
    if backend == "postgresql":
        assert post(live_bot.url, raw, headers) == 400
        assert row_counts(database_url) == before
    else:
        assert post(live_bot.url, raw, headers) == 200

"""Slack permalinks to sessions (``terminal.permalinks``), on both databases: by the thread, by the
message when the thread is unknown, and the refusals."""

from __future__ import annotations

import pytest

from core.conversation.places import (
    Place,
    SlackThread,
    place_of,
    workspace_keys,
    workspace_of,
)
from core.errors import AgentSessionNotFound, UsageError
from core.storage.sessions import SessionStore
from core.storage.surface_state import SurfaceState
from terminal.permalinks import (
    Permalink,
    parse_permalink,
    permalink_of_session,
    session_for_permalink,
)
from tests.helpers import conversations_of, new_session


@pytest.mark.parametrize(
    ("link", "expected"),
    [
        (
            "https://acme.slack.com/archives/C0ABC/p1700000000000100",
            Permalink("C0ABC", "1700000000.000100", "1700000000.000100"),
        ),
        (
            "https://acme.slack.com/archives/C0ABC/p1700000000000200"
            "?thread_ts=1700000000.000100&cid=C0ABC",
            Permalink("C0ABC", "1700000000.000200", "1700000000.000100"),
        ),
        (
            "acme.enterprise.slack.com/archives/D01/p1700000000000300/",
            Permalink("D01", "1700000000.000300", "1700000000.000300"),
        ),
    ],
)
def test_parse__channel_message_and_thread(link: str, expected: Permalink) -> None:
    assert parse_permalink(link) == expected


@pytest.mark.parametrize(
    "link",
    [
        "https://acme.slack.com/archives/C0ABC",
        "https://acme.slack.com/archives/C0ABC/p17000",
        "https://evil.example/archives/C0ABC/p1700000000000100",
        "https://acme.slack.com/archives/C0ABC/p1700000000000200?thread_ts=yesterday",
    ],
)
def test_parse__malformed_links_are_usage_errors(link: str) -> None:
    with pytest.raises(UsageError):
        parse_permalink(link)


async def test_lookup__by_thread_then_by_message_and_unknown_is_not_found(
    store: SessionStore,
) -> None:
    _, session = await new_session(store, key="T1/C0ABC/1700000000.000100")
    _, forked = await new_session(store, key="T1/C0ABC/1700000000.000900")
    state = SurfaceState(store.db, "slack")
    await state.bind_thread("T1/C0ABC/1700000000.000100", session.id)
    await state.add_ref("T1/C0ABC/1700000000.000500", forked.id, "m-1", "reply")
    slack = conversations_of(store)
    base = "https://acme.slack.com/archives/C0ABC/p"
    reply = f"{base}1700000000000200?thread_ts=1700000000.000100"
    assert await session_for_permalink(slack, reply) == session.id
    assert await session_for_permalink(slack, f"{base}1700000000000100") == session.id
    assert await session_for_permalink(slack, f"{base}1700000000000500") == forked.id
    with pytest.raises(AgentSessionNotFound):
        await session_for_permalink(slack, f"{base}1700000000000777")
    with pytest.raises(AgentSessionNotFound):  # same ts, another channel
        await session_for_permalink(
            slack, "https://acme.slack.com/archives/C0XYZ/p1700000000000100"
        )
    assert await permalink_of_session(slack, session.id) == (
        "https://slack.com/archives/C0ABC/p1700000000000100"
    )
    assert await permalink_of_session(slack, forked.id) is None


@pytest.mark.parametrize("key", ["", "T1/C1", "T1//1.2", "T1/C1/1.2/x", "/C1/1.2"])
def test_places__a_key_that_names_no_thread_is_no_place(key: str) -> None:
    assert SlackThread.parse(key) is None
    assert place_of("slack", key) == Place("slack")


def test_places__a_thread_key_reads_back_and_links_to_what_the_terminal_follows() -> None:
    thread = SlackThread("T1", "D42", "1700000000.000100")
    assert SlackThread.parse(thread.key) == thread
    assert thread.surface == "dm"
    assert SlackThread("T1", "C1", "1.2").surface == "channel"
    link = parse_permalink(thread.permalink)
    assert (link.channel, link.ts, link.thread_ts) == ("D42", thread.ts, thread.ts)
    place = place_of("slack", thread.key)
    assert (place.kind, place.surface, place.url) == ("slack", "dm", thread.permalink)
    assert place_of("cli", "me/123").kind == "terminal"
    assert place_of("web", "slack:T1:U1/123").kind == "web"
    assert place_of("elsewhere", "x").kind == "other"


def test_places__the_workspace_a_session_belongs_to() -> None:
    assert workspace_of("slack", "T1/C1/1.2") == "T1"
    assert workspace_of("web", "slack:T2:U9/8f0c") == "T2"
    assert workspace_of("cli", "root/1") is None  # the operator's: no workspace
    assert workspace_of("slack", "broken") == ""  # names none: no admin's
    assert workspace_of("web", "someone/1") == ""
    assert workspace_keys("T1") == [("slack", "T1/"), ("web", "slack:T1:")]

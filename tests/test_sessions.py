"""Sessions and users: get-or-create under concurrency, listing, titles, deletion rules."""

from __future__ import annotations

import asyncio

import pytest

from core.errors import AgentSessionBusy, AgentSessionForbidden, AgentSessionNotFound
from core.messages import user_message
from core.records import Actor
from core.storage.engine import create_database
from core.storage.sessions import SessionStore
from tests.helpers import add_exchange, backdate, new_session, statements


async def test_get_or_create_session__concurrent_callers_share_one_row(
    store: SessionStore, database_url: str
) -> None:
    owner = await store.get_or_create_user("slack:T1:U1")
    late = await store.get_or_create_user("slack:T1:U2")
    replica = SessionStore(create_database(database_url))
    try:
        results = await asyncio.gather(
            store.get_or_create_session("slack", "T1/C1/1.0", user_id=owner),
            replica.get_or_create_session("slack", "T1/C1/1.0", user_id=late),
        )
    finally:
        await replica.db.dispose()
    (first, first_created), (second, second_created) = results
    assert first.id == second.id
    assert sorted([first_created, second_created]) == [False, True]
    assert len(await store.list_sessions()) == 1


async def test_get_or_create_user__is_idempotent(store: SessionStore) -> None:
    a = await store.get_or_create_user("slack:T1:U1", "Ann")
    with statements(store.db) as seen:
        b = await store.get_or_create_user("slack:T1:U1", "Ann again")
    assert a == b
    # Every turn asks; a known user costs one read, no write transaction.
    assert [s.split()[0].upper() for s, _ in seen if s != "BEGIN"] == ["SELECT"]


async def test_temporary_session__expires_on_database_clock(store: SessionStore) -> None:
    owner = await store.get_or_create_user("slack:T1:U1")
    session, _ = await store.get_or_create_session(
        "slack", "T1/D1/1.0", user_id=owner, temporary=True
    )
    assert session.expires_at is not None
    hours = (session.expires_at - session.created_at).total_seconds() / 3600
    assert 23.9 < hours < 24.1


async def test_list_sessions__per_user_most_recent_first(store: SessionStore) -> None:
    owner, first = await new_session(store, key="a")
    _, second = await new_session(store, key="b")
    _, foreign = await new_session(store, owner="slack:T1:U9", key="c")
    await backdate(store.db, [first.id, second.id], updated_at=60)  # tied: the later id first
    await add_exchange(store, first.id)  # touches updated_at: first is now the most recent
    listed = await store.list_sessions(user_id=owner)
    assert [s.id for s in listed] == [first.id, second.id]
    assert foreign.id not in [s.id for s in listed]


async def test_set_title__owner_only(store: SessionStore) -> None:
    owner, session = await new_session(store)
    stranger = await store.get_or_create_user("slack:T1:U2")
    with pytest.raises(AgentSessionForbidden):
        await store.set_title(session.id, "mine now", Actor(stranger))
    await store.set_title(session.id, "  A   better\ttitle ", Actor(owner))
    assert (await store.get_session(session.id)).title == "A better title"


async def test_title__is_first_user_message_shortened(store: SessionStore) -> None:
    _, session = await new_session(store)
    long_text = "Please look at the deployment logs of the payments service " * 4
    lease = await store.start_turn(
        session.id, user_message=user_message(long_text), last_message_id=None
    )
    await store.release(lease)
    title = (await store.get_session(session.id)).title
    assert title is not None
    assert title.endswith("…")
    assert len(title) <= 80
    assert long_text.startswith(title[:-1])


async def test_delete_session__rules(store: SessionStore) -> None:
    owner, session = await new_session(store)
    ids = await add_exchange(store, session.id)
    stranger = await store.get_or_create_user("slack:T1:U2")
    with pytest.raises(AgentSessionForbidden):
        await store.delete_session(session.id, Actor(stranger))
    lease = await store.start_turn(
        session.id, user_message=user_message("q"), last_message_id=ids[-1]
    )
    with pytest.raises(AgentSessionBusy):
        await store.delete_session(session.id, Actor(owner))
    await store.release(lease)
    await store.delete_session(session.id, Actor(owner))
    with pytest.raises(AgentSessionNotFound):
        await store.get_session(session.id)
    with pytest.raises(AgentSessionNotFound):
        await store.delete_session(session.id, Actor(owner, admin=True))
    assert await store.find_message(ids[0]) is None


async def test_custom_provider_deleted__is_derived(store: SessionStore, db: object) -> None:
    from sqlalchemy import delete, insert

    from core.records import ModelChoice
    from core.storage.models import CustomProvider

    _, session = await new_session(store)
    async with store.db.write() as conn:
        provider_id = (
            await conn.execute(
                insert(CustomProvider.__table__).values(
                    name="team-llm",
                    kind="openai",
                    base_url="http://127.0.0.1:9/v1",
                    api_key_env="TEAM_KEY",
                )
            )
        ).inserted_primary_key[0]
    lease = await store.start_turn(
        session.id,
        user_message=user_message("q"),
        last_message_id=None,
        model=ModelChoice("team-llm", "m1", provider_id, "openai"),
    )
    await store.release(lease)
    assert not (await store.get_session(session.id)).custom_provider_deleted
    async with store.db.write() as conn:
        await conn.execute(delete(CustomProvider.__table__))
    after = await store.get_session(session.id)
    assert after.custom_provider_id is None
    assert after.custom_provider_deleted

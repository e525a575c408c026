"""The ORM keeps ``message_id == message.id`` and UUID ids; a refused message stores nothing."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from core.errors import InvalidMessage
from core.messages import user_message
from core.storage.engine import Database
from core.storage.models import AgentSessionMessage
from core.storage.sessions import SessionStore
from tests.helpers import new_session


async def stored_count(db: Database) -> int:
    async with db.read() as conn:
        return int(
            await conn.scalar(select(func.count()).select_from(AgentSessionMessage.__table__)) or 0
        )


async def test_orm__message_id_is_derived_from_message(store: SessionStore, db: Database) -> None:
    _, session = await new_session(store)
    message = user_message("hi")

    def add(connection: Connection) -> str:
        with Session(bind=connection) as orm:
            row = AgentSessionMessage(session_id=session.id, position=0, message=message)
            orm.add(row)
            orm.flush()
            return row.message_id

    async with db.write() as conn:
        assert await conn.run_sync(add) == message["id"]
    assert await stored_count(db) == 1


async def test_orm__refuses_a_message_id_that_differs(store: SessionStore, db: Database) -> None:
    _, session = await new_session(store)
    with pytest.raises(InvalidMessage, match="differs"):
        AgentSessionMessage(
            session_id=session.id,
            position=0,
            message=user_message("hi"),
            message_id=str(uuid.uuid4()),
        )
    row = AgentSessionMessage(session_id=session.id, position=0, message=user_message("hi"))
    with pytest.raises(InvalidMessage):
        row.message_id = str(uuid.uuid4())
    assert await stored_count(db) == 0


async def test_orm__refuses_a_mutated_message_at_flush(store: SessionStore, db: Database) -> None:
    _, session = await new_session(store)

    def add_mutated(connection: Connection) -> None:
        with Session(bind=connection) as orm:
            row = AgentSessionMessage(session_id=session.id, position=0, message=user_message("x"))
            row.message["id"] = str(uuid.uuid4())  # mutate the dict behind the validator's back
            orm.add(row)
            orm.flush()

    with pytest.raises(InvalidMessage):
        async with db.write() as conn:
            await conn.run_sync(add_mutated)
    assert await stored_count(db) == 0


@pytest.mark.parametrize(
    "bad_id",
    [
        "not-a-uuid",
        "",
        "A1B2C3D4-0000-4000-8000-000000000000",
        "{6f1e2d3c-4b5a-4978-8a6b-5c4d3e2f1a0b}",
    ],
)
async def test_orm__refuses_non_uuid_ids(store: SessionStore, db: Database, bad_id: str) -> None:
    _, session = await new_session(store)
    with pytest.raises(InvalidMessage):
        AgentSessionMessage(
            session_id=session.id, position=0, message={"id": bad_id, "role": "user", "parts": []}
        )
    assert await stored_count(db) == 0


async def test_store__refuses_invalid_messages_and_stores_nothing(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    for bad in (
        {"id": "nope", "role": "user", "parts": []},
        {"role": "user"},
        "text",
        {"id": str(uuid.uuid4()), "role": "robot", "parts": []},
    ):
        with pytest.raises(InvalidMessage):
            await store.start_turn(session.id, user_message=bad, last_message_id=None)  # type: ignore[arg-type]
    assert not await store.is_turn_active(session.id)
    lease = await store.start_turn(
        session.id, user_message=user_message("ok"), last_message_id=None
    )
    with pytest.raises(InvalidMessage):
        await store.finish(lease, [{"id": "nope", "role": "assistant", "parts": []}])
    assert await stored_count(db) == 1
    assert await store.is_turn_active(session.id)  # a refused finish releases nothing either

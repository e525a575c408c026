"""The peers of ``slack-agent bench --compare``, each behind the same small interface.

Every peer stores a conversation the way its documentation shows, with nothing added: no lock,
no guard. The libraries come from the optional ``compare`` extra (``uv sync --extra compare``);
nothing here is imported by the product, and ``missing()`` names what is absent instead of
failing on import.

- ``agents-sqlite``: the OpenAI Agents SDK's ``SQLiteSession`` (stdlib ``sqlite3`` in a thread);
- ``agents-sqlalchemy``: its ``SQLAlchemySession`` on aiosqlite or asyncpg;
- ``langgraph``: LangGraph's ``AsyncSqliteSaver`` / ``AsyncPostgresSaver``. A checkpointer
  stores a graph's state as a checkpoint per step, and a messages channel is stored whole in
  each one; one appended message is one step, so the adapter writes the checkpoint a graph step
  would (the whole list, the channel's version bumped, the previous checkpoint as parent), and
  loading history is reading the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import uuid
from collections.abc import AsyncIterator
from typing import Any

from bench.peers.conversation import Item, PeerConversation

MODULES = {
    "agents": "openai-agents",
    "langgraph.checkpoint.sqlite": "langgraph-checkpoint-sqlite",
    "langgraph.checkpoint.postgres": "langgraph-checkpoint-postgres",
}


def missing() -> list[str]:
    """The distributions of the ``compare`` extra that cannot be imported here."""
    absent = []
    for module, dist in MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            absent.append(dist)
    return absent


class _AgentsSession(PeerConversation):
    def __init__(self, session: Any) -> None:
        self.session = session

    async def append(self, item: Item) -> None:
        await self.session.add_items([{"role": item.role, "content": item.text}])

    async def load(self) -> list[str]:
        return [str(row["content"]) for row in await self.session.get_items()]


@contextlib.asynccontextmanager
async def agents_sqlite(path: str, conversation: str) -> AsyncIterator[PeerConversation]:
    from agents import SQLiteSession

    session = SQLiteSession(conversation, db_path=path)
    try:
        yield _AgentsSession(session)
    finally:
        session.close()


@contextlib.asynccontextmanager
async def agents_sqlalchemy(url: str, conversation: str) -> AsyncIterator[PeerConversation]:
    from agents.extensions.memory.sqlalchemy_session import SQLAlchemySession

    session = SQLAlchemySession.from_url(conversation, url=url, create_tables=True)
    try:
        yield _AgentsSession(session)
    finally:
        await session.engine.dispose()


class _Saver(PeerConversation):
    def __init__(self, saver: Any, conversation: str) -> None:
        self.saver = saver
        self.thread = {"configurable": {"thread_id": conversation, "checkpoint_ns": ""}}

    async def _latest(self) -> tuple[Any, list[dict[str, str]]]:
        found = await self.saver.aget_tuple(self.thread)
        if found is None:
            return None, []
        return found, list(found.checkpoint["channel_values"].get("messages", []))

    async def append(self, item: Item) -> None:
        from langgraph.checkpoint.base import create_checkpoint, empty_checkpoint

        latest, messages = await self._latest()
        base = empty_checkpoint() if latest is None else latest.checkpoint
        config = self.thread if latest is None else latest.config
        messages.append({"role": item.role, "content": item.text})
        version = self.saver.get_next_version(base["channel_versions"].get("messages"), None)
        checkpoint = create_checkpoint(base, None, len(messages), id=str(_uuid6()))
        checkpoint["channel_values"] = {"messages": messages}
        checkpoint["channel_versions"] = {**base["channel_versions"], "messages": version}
        await self.saver.aput(
            config,
            checkpoint,
            {"source": "loop", "step": len(messages), "parents": {}},
            {"messages": version},
        )

    async def load(self) -> list[str]:
        _, messages = await self._latest()
        return [m["content"] for m in messages]


def _uuid6() -> uuid.UUID:
    from langgraph.checkpoint.base.id import uuid6

    return uuid.UUID(str(uuid6()))


@contextlib.asynccontextmanager
async def langgraph_sqlite(path: str, conversation: str) -> AsyncIterator[PeerConversation]:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    async with AsyncSqliteSaver.from_conn_string(path) as saver:
        await saver.setup()
        yield _Saver(saver, conversation)


@contextlib.asynccontextmanager
async def langgraph_postgres(dsn: str, conversation: str) -> AsyncIterator[PeerConversation]:
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    async with AsyncPostgresSaver.from_conn_string(dsn) as saver:
        await saver.setup()
        yield _Saver(saver, conversation)

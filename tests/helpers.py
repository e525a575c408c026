"""Test helpers: building sessions, ageing locks on the database clock, child processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event, select, text, update

from core.agent.loop import Agent
from core.agent.model_choice import ProviderCache
from core.conversation import Conversations
from core.messages import assistant_message, user_message
from core.records import SessionInfo, StoredMessage, TurnLease
from core.settings import Settings
from core.storage import queries as q
from core.storage.dialect import ago, db_now
from core.storage.engine import KEEPS_TAIL, Conn, Database
from core.storage.feedback import Feedback
from core.storage.models import AgentSession
from core.storage.sessions import SessionStore
from core.storage.surface_state import SurfaceState

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "worker.py"
# Seconds a process of the product (``serve``, ``chat``) with its MCP server may take to start
# on a loaded machine: importing the product and starting the server take seconds of CPU.
STARTING = 180.0


def shell_output(answer: StoredMessage | dict[str, Any] | None) -> str:
    """What the shell calls of a stored answer printed (stdout then stderr of each tool part's
    output, in order): where a command's output really is. The offline model's answer says
    only how a call ended, never its output."""
    message = answer.message if isinstance(answer, StoredMessage) else answer or {}
    out: list[str] = []
    for part in message.get("parts") or []:
        output = part.get("output") if isinstance(part, dict) else None
        if str(part.get("type", "")).startswith("tool-") and isinstance(output, dict):
            out.append(str(output.get("stdout") or "") + str(output.get("stderr") or ""))
    return "".join(out)


def conversations_of(
    store: SessionStore, *, project: str = "slack", surface: str | None = "slack"
) -> Conversations:
    """A surface's conversation API on ``store`` (the offline model behind its turns)."""
    agent = Agent(store, ProviderCache(Settings(model_provider="offline")))
    state = None if surface is None else SurfaceState(store.db, surface)
    return Conversations(store, agent, Feedback(store.db), project=project, state=state)


async def new_session(
    store: SessionStore, owner: str = "slack:T1:U1", key: str | None = None
) -> tuple[int, SessionInfo]:
    user_id = await store.get_or_create_user(owner)
    session, _ = await store.get_or_create_session(
        "slack", key or f"T1/C1/{os.urandom(4).hex()}", user_id=user_id
    )
    return user_id, session


async def add_exchange(store: SessionStore, session_id: int, n: int = 1) -> list[str]:
    """``n`` user/assistant pairs through real turns; returns the message ids in order."""
    ids: list[str] = []
    for i in range(n):
        tail = await store.tail(session_id)
        lease = await store.start_turn(
            session_id,
            user_message=user_message(f"question {i}"),
            last_message_id=tail.message_id if tail else None,
        )
        assert lease.tail is not None
        answer = assistant_message(f"answer {i}")
        await store.finish(lease, [answer])
        ids += [lease.tail.message_id, answer["id"]]
    return ids


async def backdate(db: Database, session_ids: list[int], **seconds_ago: float) -> None:
    """Move sessions' timestamp columns (``updated_at=60``…) into the past, on the database clock.

    Ordering by time needs it: SQLite's clock has millisecond resolution, and a fast machine
    creates a session and finishes a turn on another within the same millisecond.
    """
    async with db.write() as conn:
        await conn.execute(
            update(AgentSession.__table__)
            .where(AgentSession.__table__.c.id.in_(session_ids))
            .values({column: ago(s) for column, s in seconds_ago.items()})
        )


async def age_lock(db: Database, session_id: int, seconds: float) -> None:
    """Move a session's heartbeat ``seconds`` into the past, on the database clock."""
    await backdate(db, [session_id], heartbeat_at=seconds)


async def take_over(db: Database, session_id: int) -> TurnLease:
    """What another replica's claim does to a turn that stopped heartbeating, as one statement:
    a new token (and a fresh heartbeat). Aging the lock and claiming it in two steps races the
    running turn's own heartbeat, which may refresh the lock in between."""
    table = AgentSession.__table__
    token = uuid.uuid4().hex
    async with db.write() as conn:
        await conn.execute(
            update(table)
            .where(table.c.id == session_id)
            .values(lock_token=token, heartbeat_at=db_now())
        )
        tail = await q.tail(conn, session_id)
    return TurnLease(session_id, token, tail, next_position=tail.position + 1 if tail else 0)


def start_worker(*args: Any) -> subprocess.Popen[str]:
    """A child process running ``tests/worker.py`` (a real process, its own engine and loop)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_json_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        assert proc.stderr is not None
        raise AssertionError(f"worker ended without output: {proc.stderr.read()}")
    return dict(json.loads(line))


def stop_workers(procs: list[subprocess.Popen[str]], *, wait: float = 0) -> None:
    """Let workers exit for up to ``wait`` seconds, kill the rest, close every pipe."""
    for proc in procs:
        if wait:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@contextlib.contextmanager
def statements(db: Database) -> Iterator[list[tuple[str, Any]]]:
    """Record every statement the engine runs and the number of rows each returned."""
    seen: list[tuple[str, Any]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append((statement, None))

    event.listen(db.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", before)


async def tail_on_row(db: Database, session_id: int) -> str | None:
    """The session's tail as its own row holds it (``tail_message_id``, migration 0011): what
    the stale guard compares."""
    async with db.read() as conn:
        found = await conn.scalar(
            select(q.SESSIONS.c.tail_message_id).where(q.SESSIONS.c.id == session_id)
        )
    return None if found is None else str(found)


@contextlib.asynccontextmanager
async def as_an_older_replica(db: Database) -> AsyncIterator[Conn]:
    """A write transaction as a replica of the release before 0011 makes it, through a rolling
    upgrade: its connection does not say it keeps the session's tail (``KEEPS_TAIL``), so on
    PostgreSQL the tail triggers move the tail for it."""
    async with db.write() as conn:
        await conn.execute(text(f"SET LOCAL {KEEPS_TAIL} = 'off'"))
        yield conn


async def rewind_as_an_older_replica(db: Database, session_id: int, position: int) -> None:
    """An older replica's rewind: the session's messages from ``position`` on deleted, the
    tail left to the triggers."""
    async with as_an_older_replica(db) as conn:
        await conn.execute(
            q.MESSAGES.delete().where(
                q.MESSAGES.c.session_id == session_id, q.MESSAGES.c.position >= position
            )
        )


def claim_params(session_id: int) -> dict[str, Any]:
    """A claim's parameters (as ``SessionStore.start_turn`` gives them) of a user message, any
    tail."""
    params: dict[str, Any] = {
        "sid": session_id,
        "token": "token",
        "takeover_token": "token",
        "staleness": 60.0,
        "title": None,
        "abandoned": None,
        "any_tail": True,
        "last": None,
    }
    return params | q.user_params(q.message_row(session_id, 0, user_message("x")))

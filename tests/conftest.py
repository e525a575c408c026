"""Fixtures shared by the suite: one migrated database per test, on SQLite and on PostgreSQL.

Every database test runs twice, once per backend (``database_url`` is parametrised). Both
backends start from a template migrated once per run with ``alembic upgrade head`` (so the
migrations are what the tests exercise): SQLite copies a migrated file, PostgreSQL clones a
template database. PostgreSQL is always required: an unreachable server fails its tests with
the reason, never skips them, since a rule proved on SQLite alone proves nothing about replicas.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import queue
import shutil
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from core.storage.engine import Database, create_database
from core.storage.migrate import upgrade
from core.storage.sessions import SessionStore
from standins.openai import GatedModel
from standins.slack import SlackStandIn
from tests.terminal_harness import ChatProcess

PG_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
BACKENDS = ["sqlite", "postgresql"]


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def _with_database(url: str, name: str) -> str:
    return url.rsplit("/", 1)[0] + "/" + name


def run_isolated(coro_factory: Any) -> Any:
    """Run a coroutine on a private loop in a thread (fixtures that must not share a loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(coro_factory())).result()


async def _pg_admin(*statements: str) -> None:
    conn = await asyncpg.connect(_dsn(PG_URL), timeout=5)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def _migrate(url: str) -> None:
    db = create_database(url)
    try:
        await upgrade(db)
    finally:
        await db.dispose()


class _PgClones:
    """Databases cloned from the template ahead of the tests that take them.

    ``CREATE DATABASE … TEMPLATE`` and ``DROP DATABASE`` take a few hundred milliseconds each;
    paid inside every PostgreSQL test they were a large share of the suite. A thread of its own
    (its own loop and admin connection) keeps ``READY`` clones made and drops the used ones,
    so a test only waits when it outruns the cloning. Every test still gets a database no
    other test has touched, migrated by the real migrations (the template).
    """

    READY = 3

    def __init__(self, template: str) -> None:
        self.template = template
        self._ready: queue.Queue[str | BaseException] = queue.Queue()
        self._work: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pg-clones", daemon=True)
        self._thread.start()
        for _ in range(self.READY):
            self._work.put(("create", ""))

    def take(self) -> str:
        found = self._ready.get()
        if isinstance(found, BaseException):
            raise found
        self._work.put(("create", ""))
        return found

    def give_back(self, name: str) -> None:
        self._work.put(("drop", name))

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(60)
        while not self._ready.empty():
            leftover = self._ready.get()
            if isinstance(leftover, str):
                run_isolated(
                    lambda n=leftover: _pg_admin(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)')
                )

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        conn = await asyncpg.connect(_dsn(PG_URL), timeout=10)
        try:
            while True:
                job = await asyncio.to_thread(self._work.get)
                if job is None:
                    return
                action, name = job
                try:
                    if action == "create":
                        name = f"sa_t_{uuid.uuid4().hex[:12]}"
                        await conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
                        self._ready.put(name)
                    else:
                        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
                    if action == "create":
                        self._ready.put(exc)
        finally:
            await conn.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the test process imported (every module the tests run) is frozen out of garbage
    collection, as ``serve`` freezes what its start made (``bot.gc_tuning``): a full
    collection of that heap took 0.2-0.9 s on a loaded machine, and one landed inside a
    harness's first acknowledgement (counted against Slack's deadline) in a measured run.
    Only the import-time heap: what tests make afterwards is collected as usual."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str | None]:
    """A migrated template database, or None (with the reason kept) when PG is unreachable."""
    name = f"sa_tmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        run_isolated(lambda: _pg_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        pytest.pg_unavailable_reason = f"PostgreSQL not reachable at {PG_URL}: {exc}"  # type: ignore[attr-defined]
        yield None
        return
    try:
        run_isolated(lambda: _migrate(_with_database(PG_URL, name)))
        yield name
    finally:
        clones = _CLONES.pop(name, None)
        if clones is not None:
            clones.close()
        run_isolated(lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


_CLONES: dict[str, _PgClones] = {}


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.db"
    run_isolated(lambda: _migrate(f"sqlite+aiosqlite:///{path}"))
    return path


def _require_pg(template: str | None) -> str:
    if template is None:
        reason = getattr(pytest, "pg_unavailable_reason", "PostgreSQL not reachable")
        pytest.fail(f"PostgreSQL is required (set TEST_POSTGRES_URL to reach it): {reason}")
    return template


def fresh_database_url(
    backend: str, tmp_path: Path, pg_template: str | None, sqlite_template: Path
) -> Iterator[str]:
    if backend == "sqlite":
        path = tmp_path / f"db-{uuid.uuid4().hex[:8]}.db"
        shutil.copyfile(sqlite_template, path)
        yield f"sqlite+aiosqlite:///{path}"
        return
    template = _require_pg(pg_template)
    clones = _CLONES.get(template)
    if clones is None:
        clones = _CLONES[template] = _PgClones(template)
    name = clones.take()
    try:
        yield _with_database(PG_URL, name)
    finally:
        clones.give_back(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(
    backend: str, tmp_path: Path, pg_template: str | None, sqlite_template: Path
) -> Iterator[str]:
    """A freshly migrated, empty database of the test's backend."""
    yield from fresh_database_url(backend, tmp_path, pg_template, sqlite_template)


@pytest.fixture
def empty_database_url(backend: str, tmp_path: Path, pg_template: str | None) -> Iterator[str]:
    """A database with no schema at all (migration tests)."""
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
        return
    _require_pg(pg_template)
    name = f"sa_e_{uuid.uuid4().hex[:12]}"
    run_isolated(lambda: _pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(PG_URL, name)
    finally:
        run_isolated(lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = create_database(database_url)
    yield database
    await database.dispose()


@pytest.fixture
async def store(db: Database) -> SessionStore:
    return SessionStore(db, staleness_seconds=60)


@pytest.fixture
async def replica(database_url: str) -> AsyncIterator[SessionStore]:
    """A second store on its own engine: another replica (or process) on the same database."""
    database = create_database(database_url)
    yield SessionStore(database, staleness_seconds=60)
    await database.dispose()


@pytest.fixture
async def slack() -> AsyncIterator[SlackStandIn]:
    """A stand-in for the Slack Web API on 127.0.0.1 (records calls, answers like Slack)."""
    async with SlackStandIn() as fake:
        yield fake


@pytest.fixture
async def model() -> AsyncIterator[GatedModel]:
    """An OpenAI-wire model server whose answers wait until the test releases them."""
    async with GatedModel() as fake:
        yield fake


@pytest.fixture
async def chats() -> AsyncIterator[list[ChatProcess]]:
    """Every terminal client (``slack-agent chat``) a test starts is killed at the end,
    whatever happened: append each one as it starts."""
    started: list[ChatProcess] = []
    yield started
    for chat in started:
        chat.kill()


@pytest.fixture(autouse=True)
def _scrub_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests never see the developer's configuration (variables or a ``.env`` file)."""
    for name in list(os.environ):
        if name.startswith(
            (
                "SLACK_",
                "OPENAI_",
                "ANTHROPIC_",
                "MODEL_",
                "AGENT_SESSION_",
                "OTEL_",
                "TRACE_",
                "MCP_",
            )
        ) or name in {
            "DATABASE_URL",
            "TURN_LOCK_STALENESS_SECONDS",
            "TURN_HEARTBEAT_SECONDS",
            "BUSY_MODE",
            "ADMIN_USER_IDS",
            "BUDGETS",
            "APPROVAL_TIMEOUT_SECONDS",
        }:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)

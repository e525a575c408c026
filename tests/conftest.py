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
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from core.storage.engine import Database, create_database
from core.storage.migrate import upgrade
from core.storage.sessions import SessionStore
from tests.fake_slack import FakeSlack, GatedModel

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
        run_isolated(lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


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
    name = f"sa_t_{uuid.uuid4().hex[:12]}"
    run_isolated(lambda: _pg_admin(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    try:
        yield _with_database(PG_URL, name)
    finally:
        run_isolated(lambda: _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


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
async def slack() -> AsyncIterator[FakeSlack]:
    """A stand-in for the Slack Web API on 127.0.0.1 (records calls, answers like Slack)."""
    async with FakeSlack() as fake:
        yield fake


@pytest.fixture
async def model() -> AsyncIterator[GatedModel]:
    """An OpenAI-wire model server whose answers wait until the test releases them."""
    async with GatedModel() as fake:
        yield fake


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

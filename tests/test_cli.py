"""The ``slack-agent`` command as an operator runs it: a real process on a real database."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.messages import user_message
from core.settings import Settings
from core.storage import Storage
from core.storage.custom_providers import CustomProviderSpec
from core.storage.engine import MIN_SQLITE
from core.storage.migrate import head_revision
from core.storage.sessions import SessionStore
from tests.helpers import ROOT, add_exchange, new_session

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

EXE = Path(sys.executable).with_name("slack-agent")
MODEL_VARIABLES = ("OPENAI_", "ANTHROPIC_", "MODEL_", "TEAM_LLM_")


def cli(
    *args: str, database_url: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    if database_url is not None:
        environment["DATABASE_URL"] = database_url
    return subprocess.run(
        [str(EXE), *args], capture_output=True, text=True, env=environment, timeout=120, check=False
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_migrate__creates_then_reports_schema(empty_database_url: str) -> None:
    first = cli("migrate", database_url=empty_database_url)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"database at revision {head_revision()} (was None)"
    again = cli("migrate", database_url=empty_database_url)
    assert again.stdout.strip() == f"database at revision {head_revision()}"


async def test_an_unmigrated_database__commands_say_to_migrate_in_one_line_and_write_nothing(
    empty_database_url: str,
) -> None:
    """The operator's commands that only read or set values do not migrate: on a database
    never migrated they failed on their first statement (``no such table:
    system_settings``). Now one line says what to run, readiness says the schema is missing
    (not that the database is unavailable), and the database is left as it was (migrate
    finds no schema)."""
    head = head_revision()
    for args in (("budget", "set", "user:day:1000tokens"), ("sessions", "list"), ("usage",)):
        line = one_line_error(cli(*args, database_url=empty_database_url))
        assert line == (
            f"slack-agent: database_not_ready: database schema at nothing; this build needs "
            f"{head}: run `slack-agent migrate` (`serve` migrates as it starts)"
        ), args
    storage = Storage.open(Settings(database_url=empty_database_url))
    try:
        reason = await storage.not_ready()
    finally:
        await storage.dispose()
    assert reason == f"database schema at nothing; this build needs {head}"
    migrated = cli("migrate", database_url=empty_database_url)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout.strip() == f"database at revision {head} (was None)"
    assert cli("budget", "show", database_url=empty_database_url).stdout.strip() == (
        "no budgets: nothing limits spending"
    )


async def test_sessions__list_show_delete(store: SessionStore, database_url: str) -> None:
    _, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    listed = cli("sessions", "list", database_url=database_url)
    assert listed.returncode == 0, listed.stderr
    assert f"{session.id:>6}" in listed.stdout
    assert "question 0" in listed.stdout
    shown = cli("sessions", "show", str(session.id), database_url=database_url)
    assert shown.returncode == 0, shown.stderr
    assert [line.split()[:2] for line in shown.stdout.splitlines()[2:]] == [
        ["0", "user"],
        ["1", "assistant"],
        ["2", "user"],
        ["3", "assistant"],
    ]
    tail = await store.tail(session.id)
    lease = await store.start_turn(
        session.id,
        user_message=user_message("q"),
        last_message_id=tail.message_id if tail else None,
    )
    busy = cli("sessions", "delete", str(session.id), database_url=database_url)
    assert one_line_error(busy).startswith("slack-agent: agent_session_busy:")
    await store.release(lease)
    deleted = cli("sessions", "delete", str(session.id), database_url=database_url)
    assert deleted.returncode == 0, deleted.stderr
    assert "as the local operator" in deleted.stdout
    missing = cli("sessions", "show", str(session.id), database_url=database_url)
    assert (
        one_line_error(missing)
        == f"slack-agent: agent_session_not_found: session {session.id} does not exist"
    )


def test_retention_and_sweep(database_url: str) -> None:
    shown = cli("retention", "show", database_url=database_url, AGENT_SESSION_MAX_PER_USER="12")
    assert "max per user:  12" in shown.stdout
    set_ = cli("retention", "set", "--max-idle-days", "7", database_url=database_url)
    assert set_.returncode == 0
    assert "max idle days: 7" in set_.stdout
    assert "max idle days: 7" in cli("retention", "show", database_url=database_url).stdout
    bad = cli("retention", "set", "--max-per-user", "-1", database_url=database_url)
    assert "max per user must be 0 (off) or more" in one_line_error(bad)
    assert "max idle days: 7" in cli("retention", "show", database_url=database_url).stdout
    swept = cli("sweep", "--once", database_url=database_url)
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout.startswith("deleted 0 expired, 0 idle and 0 over-cap sessions")


def test_bad_configuration__one_line_naming_it() -> None:
    bad_scheme = cli("migrate", database_url="mysql://root@127.0.0.1/db")
    assert one_line_error(bad_scheme).startswith(
        "slack-agent: config_invalid: DATABASE_URL: unsupported scheme 'mysql'"
    )
    unreachable = cli("sessions", "list", database_url="postgresql://postgres@127.0.0.1:1/nowhere")
    assert one_line_error(unreachable).startswith("slack-agent: database_error:")
    bad_number = cli("sweep", "--once", SWEEPER_BATCH_SIZE="lots")
    assert one_line_error(bad_number).startswith("slack-agent: config_invalid: SWEEPER_BATCH_SIZE")


def test_short_lock_window__a_refusal_is_still_one_line(tmp_path: Path) -> None:
    # Derived timeouts that do not fit so short a window are said by ``serve`` alone.
    refused = cli(
        "chat",
        "999999",
        database_url=f"sqlite:///{tmp_path / 'agent.db'}",
        TURN_LOCK_STALENESS_SECONDS="2",
        TURN_HEARTBEAT_SECONDS="0.25",
    )
    assert one_line_error(refused).startswith("slack-agent: agent_session_not_found:")


def test_bad_sqlite_location__one_line_naming_it(tmp_path: Path) -> None:
    for memory in ("sqlite://", "sqlite:///:memory:"):
        result = cli("migrate", database_url=memory)
        assert one_line_error(result).startswith(
            "slack-agent: config_invalid: DATABASE_URL: SQLite needs a file path"
        )
    nowhere = tmp_path / "missing" / "agent.db"
    result = cli("migrate", database_url=f"sqlite:///{nowhere}")
    assert one_line_error(result).startswith(
        f"slack-agent: config_invalid: DATABASE_URL: cannot create the SQLite file {nowhere}"
    )


def test_start_up__an_sqlite_older_than_supported_is_refused_in_one_line(tmp_path: Path) -> None:
    # The library cannot be swapped inside a test, so the child process is told an older
    # version, the way the sqlite3 module reports it, before the command starts.
    old = (
        "import sqlite3; sqlite3.sqlite_version_info = (3, 30, 1); "
        "sqlite3.sqlite_version = '3.30.1'"
    )
    start = f"{old}; from slack_agent.cli import main; raise SystemExit(main(['migrate']))"
    environment = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'old.db'}"}
    result = subprocess.run(
        [sys.executable, "-c", start],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    needed = ".".join(map(str, MIN_SQLITE))
    assert one_line_error(result) == (
        "slack-agent: config_invalid: DATABASE_URL: SQLite 3.30.1 is too old; slack-agent "
        f"needs SQLite {needed} or newer (the library Python's sqlite3 module uses), or PostgreSQL"
    )
    assert not (tmp_path / "old.db").exists()
    ok = cli("migrate", database_url=f"sqlite:///{tmp_path / 'current.db'}")
    assert ok.returncode == 0, ok.stderr


def test_serve_without_slack_settings_names_the_variable_and_python_dash_m_works() -> None:
    serve = cli("serve")
    assert one_line_error(serve).startswith("slack-agent: config_invalid: SLACK_SIGNING_SECRET")
    module = subprocess.run(
        [sys.executable, "-m", "bot", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert module.returncode == 0
    assert "migrate" in module.stdout


MODEL_MISCONFIGURED = [
    ({"MODEL_PROVIDER": "openai"}, "OPENAI_API_KEY: required when the model provider is openai"),
    (
        {"MODEL_PROVIDER": "anthropic"},
        "ANTHROPIC_API_KEY: required when the model provider is anthropic",
    ),
    ({"MODEL_PROVIDER": "opnai"}, "MODEL_PROVIDER: 'opnai' is neither auto, openai, anthropic"),
    ({"MODEL_PROVIDER": "team-llm"}, "TEAM_LLM_KEY: not set; custom provider 'team-llm'"),
]


@pytest.mark.parametrize(("env", "line"), MODEL_MISCONFIGURED)
async def test_serve__a_model_configuration_no_turn_could_use_stops_start_up_in_one_line(
    store: SessionStore, database_url: str, env: dict[str, str], line: str
) -> None:
    # A custom provider registered in the database, whose key variable is not set.
    await store.custom_providers.add(
        CustomProviderSpec("team-llm", "openai", "http://127.0.0.1:1/v1", "TEAM_LLM_KEY")
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(MODEL_VARIABLES)}
    result = await asyncio.to_thread(
        subprocess.run,
        [str(EXE), "serve"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **clean,
            "DATABASE_URL": database_url,
            "SLACK_BOT_TOKEN": "xoxb-test",
            "SLACK_SIGNING_SECRET": "secret",
            "SLACK_API_URL": "http://127.0.0.1:1/api/",
            "PORT": "0",
            **env,
        },
    )
    assert one_line_error(result).startswith(f"slack-agent: config_invalid: {line}")

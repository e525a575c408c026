"""Database time limits chosen from the staleness window, and refused when they cannot fit it."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import exc as sa_exc

from core.errors import ConfigError, DatabaseError, DatabaseValueRefused
from core.settings import load_settings
from core.storage import Storage, timeouts_of
from core.storage.engine import database_error


def test_timeouts__derived_from_the_window_and_within_its_budget() -> None:
    settings = load_settings()  # 60 s window, 15 s heartbeat: a budget of 33 s
    assert settings.database_timeouts == (8.25, 16.5)
    assert settings.database_timeout_warning() is None
    bounds = timeouts_of(settings)
    assert bounds.server_settings()["statement_timeout"] == "16500"
    assert bounds.server_settings()["idle_in_transaction_session_timeout"] == "16500"


def test_timeouts__set_beyond_the_budget_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(database_statement_timeout_seconds=30)
    message = refused.value.message
    assert message.startswith("DATABASE_STATEMENT_TIMEOUT_SECONDS: connect (8.25s) and statement")
    assert "\n" not in message


def test_timeouts__a_window_too_short_for_the_floors_gets_one_warning_line() -> None:
    settings = load_settings(turn_lock_staleness_seconds=2, turn_heartbeat_seconds=0.25)
    warning = settings.database_timeout_warning()
    assert warning is not None
    assert "\n" not in warning
    assert settings.database_timeouts == (3.0, 5.0)
    assert "DATABASE_STATEMENT_TIMEOUT_SECONDS" in warning  # says what to set


async def test_timeouts__opening_storage_says_nothing_of_them(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    # Every command opens storage: a warning there came before each one-line refusal.
    settings = load_settings(
        turn_lock_staleness_seconds=2,
        turn_heartbeat_seconds=0.25,
        database_url=f"sqlite:///{tmp_path / 'agent.db'}",
    )
    assert settings.database_timeout_warning() is not None
    with caplog.at_level(logging.DEBUG):
        storage = Storage.open(settings)
        await storage.dispose()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


class _Driver(Exception):
    """A driver's error as SQLAlchemy's asyncpg adapter hands it on: its SQLSTATE on it."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def test_database_error__a_value_refused_is_its_own_code_and_a_failure_is_not() -> None:
    """Only a data exception (SQLSTATE class 22; SQLite's ``DataError``) is the request's
    fault; a conflict, a lost connection or a time-out stays a ``DatabaseError`` a caller may
    try again."""
    nul = _Driver('invalid byte sequence for encoding "UTF8": 0x00', "22021")
    refused = database_error(sa_exc.DataError("SELECT", {}, nul))
    assert isinstance(refused, DatabaseValueRefused)
    assert refused.code == "database_value_refused"
    assert str(refused) == (
        'the database refused a value (22021): invalid byte sequence for encoding "UTF8": 0x00'
    )
    big = database_error(
        sa_exc.DataError("INSERT", {}, sqlite3.DataError("string or blob too big"))
    )
    assert isinstance(big, DatabaseValueRefused)
    for failed in (
        sa_exc.OperationalError("UPDATE", {}, _Driver("could not serialize access", "40001")),
        sa_exc.OperationalError("SELECT", {}, sqlite3.OperationalError("database is locked")),
        TimeoutError(),
    ):
        error = database_error(failed)
        assert type(error) is DatabaseError, failed
        assert error.code == "database_error"

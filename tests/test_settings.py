"""Configuration: the documented names and defaults, and one clear line for a bad value."""

from __future__ import annotations

import logging

import pytest

from bot.service import check_config
from core.agent.model_choice import ProviderCache
from core.errors import ConfigError
from core.logs import configure_logging
from core.settings import (
    DEFAULT_DATABASE_URL,
    SHUTDOWN_GRACE_DEFAULT,
    Settings,
    load_settings,
    normalize_database_url,
)
from core.storage.engine import create_database


def test_defaults_match_the_spec() -> None:
    settings = load_settings()
    assert settings.database_url == DEFAULT_DATABASE_URL
    assert settings.turn_lock_staleness_seconds == 60
    assert settings.turn_heartbeat_seconds == 15
    assert settings.busy_poll_seconds == 3
    assert settings.busy_mode == "ask"
    assert settings.sweeper_batch_size == 100
    assert settings.agent_session_max_idle_days == 30
    assert settings.agent_session_max_per_user == 30
    assert settings.slack_api_url == "https://slack.com/api/"
    assert settings.model_provider == "auto"


def test_environment_and_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://postgres@127.0.0.1/test")
    monkeypatch.setenv("ADMIN_USER_IDS", "U1, U2,,U3")
    monkeypatch.setenv("TEMPORARY_SESSION_SURFACES", "dm,assistant")
    monkeypatch.setenv("TURN_LOCK_STALENESS_SECONDS", "5")
    monkeypatch.setenv("TURN_HEARTBEAT_SECONDS", "2.5")
    settings = load_settings()
    assert settings.database_url == "postgresql+asyncpg://postgres@127.0.0.1/test"
    assert settings.admin_user_ids == ["U1", "U2", "U3"]
    assert settings.temporary_session_surfaces == ["dm", "assistant"]
    assert settings.turn_lock_staleness_seconds == 5


def test_dotenv_file_is_read(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    with open(".env", "w") as env:  # the autouse fixture runs each test in its own tmp dir
        env.write("BUSY_MODE=queue\n")
    assert load_settings().busy_mode == "queue"


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("DATABASE_URL", "mysql://root@localhost/db", "DATABASE_URL: unsupported scheme 'mysql'"),
        ("DATABASE_URL", "just-a-path.db", "DATABASE_URL"),
        ("BUSY_MODE", "shout", "BUSY_MODE"),
        ("TURN_LOCK_STALENESS_SECONDS", "-1", "TURN_LOCK_STALENESS_SECONDS"),
        ("TEMPORARY_SESSION_SURFACES", "dm,email", "TEMPORARY_SESSION_SURFACES: unknown surface"),
        ("PORT", "eighty", "PORT"),
        ("SWEEPER_BATCH_SIZE", "-5", "SWEEPER_BATCH_SIZE"),
        ("SHUTDOWN_GRACE_SECONDS", "-1", "SHUTDOWN_GRACE_SECONDS"),
        ("SESSION_POLL_SECONDS", "0", "SESSION_POLL_SECONDS"),
        ("LOG_LEVEL", "loud", "LOG_LEVEL: 'loud' is not a level"),
        ("ADMIN_USER_IDS", "U1,alice", "ADMIN_USER_IDS: 'alice' is neither"),
        # Each value is fine alone; together they cannot work.
        ("TURN_HEARTBEAT_SECONDS", "45", "TURN_HEARTBEAT_SECONDS: 45 is not well below"),
        ("BUSY_POLL_SECONDS", "900", "BUSY_POLL_SECONDS: 900 is longer than"),
    ],
)
def test_bad_value__one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, named: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as error:
        load_settings()
    message = str(error.value)
    assert message.startswith(named), message
    assert "\n" not in message
    assert error.value.code == "config_invalid"


def test_create_database__refuses_unsupported_scheme() -> None:
    with pytest.raises(ConfigError, match="unsupported scheme 'oracle'"):
        create_database("oracle://scott@db/orcl")


def test_normalize_database_url__aliases() -> None:
    assert normalize_database_url("sqlite:///x.db") == "sqlite+aiosqlite:///x.db"
    assert normalize_database_url("postgresql://u@h/d") == "postgresql+asyncpg://u@h/d"


def test_admin_user_ids__per_workspace_entries_and_bare_ones() -> None:
    settings = load_settings(admin_user_ids="T1:U7,U9")
    assert settings.is_admin("T1", "U7")
    assert not settings.is_admin("T2", "U7")  # the same id in another workspace is someone else
    assert settings.is_admin("T2", "U9")  # bare: single-workspace mode


def test_admin_user_ids__bare_ids_are_refused_when_several_workspaces_can_install() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(
            admin_user_ids="T1:U7,U9",
            slack_client_id="1",
            slack_client_secret="s",
        )
    assert str(error.value).startswith("ADMIN_USER_IDS: 'U9' must be TEAM:USER")
    assert load_settings(admin_user_ids="T1:U7", slack_client_id="1").is_admin("T1", "U7")


def test_model_client__connections_follow_max_concurrent_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fixed cap (100 connections) would hold turn 101 waiting for a connection until the
    pool timeout failed it, whatever MAX_CONCURRENT_TURNS allows."""
    monkeypatch.setenv("MAX_CONCURRENT_TURNS", "500")
    assert ProviderCache(load_settings())._http().max_connections >= 500


def test_shutdown_grace__default_fits_docker_stop_and_kubernetes_and_is_bounded() -> None:
    # docker stop sends SIGKILL 10 s after SIGTERM, Kubernetes 30 s: the grace and the
    # wind-down after it (interrupting turns, keeping their partial answers) fit the shorter.
    assert load_settings().shutdown_grace_seconds == SHUTDOWN_GRACE_DEFAULT < 10
    assert load_settings(shutdown_grace_seconds=0).shutdown_grace_seconds == 0
    for bad in ("-1", "nan", "inf", "86400", "soon"):
        with pytest.raises(ConfigError) as error:
            load_settings(shutdown_grace_seconds=bad)
        assert str(error.value).startswith("SHUTDOWN_GRACE_SECONDS: "), bad


def test_oauth__no_state_secret_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # slack_sdk keeps OAuth states in the database and Bolt checks them against a cookie:
    # nothing is signed, so there is no secret to require (an old .env that sets it still loads).
    monkeypatch.setenv("SLACK_STATE_SECRET", "left over")
    settings = load_settings(slack_client_id="1", slack_client_secret="s", slack_signing_secret="x")
    assert not hasattr(settings, "slack_state_secret")
    check_config(settings)  # OAuth mode is complete without it


def test_metrics_port__its_own_listener_never_the_public_port() -> None:
    assert load_settings().metrics_port is None  # default: /metrics and /healthz on PORT
    assert load_settings(metrics_port=9100).metrics_port == 9100
    assert load_settings(port=3000, metrics_port=3000, metrics_host="127.0.0.1").metrics_port
    with pytest.raises(ConfigError) as error:
        load_settings(port=3000, metrics_port=3000)
    assert str(error.value).startswith("METRICS_PORT: 3000 is PORT already")
    with pytest.raises(ConfigError) as error:
        load_settings(metrics_port=70000)
    assert str(error.value).startswith("METRICS_PORT: ")


def test_secret_values__every_secret_setting_and_the_logs_never_show_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Tokens, keys, the database password and the OTLP headers' values are known as secrets;
    the log handler the entry point sets up replaces them, wherever a line quotes one."""
    settings = Settings(
        database_url="postgresql://agent:pg-pass-1234567@db:5432/agent",
        slack_bot_token="xoxb-bot-token-1",
        slack_signing_secret="signing-secret-1",
        slack_app_token="xapp-app-token-1",
        slack_client_secret="client-secret-1",
        openai_api_key="sk-openai-key-1",
        anthropic_api_key="sk-ant-key-1",
        otel_exporter_otlp_traces_headers="x-api-key=otlp%2Bkey%2B1",
        _env_file=None,  # type: ignore[call-arg]
    )
    values = {value for value, _ in settings.secret_values()}
    expected = {
        "pg-pass-1234567",
        "xoxb-bot-token-1",
        "signing-secret-1",
        "xapp-app-token-1",
        "client-secret-1",
        "sk-openai-key-1",
        "sk-ant-key-1",
        "otlp+key+1",
    }
    assert expected <= values
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("INFO", "text", settings.secret_values())
        logging.getLogger("slack-agent.test").warning(
            "connect failed: %s", settings.database_url.replace("+asyncpg", "")
        )
        try:
            raise RuntimeError(f"bad token {settings.slack_bot_token}")
        except RuntimeError:
            logging.getLogger("slack-agent.test").exception("a library said")
    finally:
        root.handlers[:], root.level = handlers, level
    err = capsys.readouterr().err
    assert "connect failed: postgresql://agent:${DATABASE_URL password}@db:5432/agent" in err
    assert "bad token ${SLACK_BOT_TOKEN}" in err
    assert not [value for value in expected if value in err]

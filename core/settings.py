"""Configuration from the environment (and ``.env``), named as the README's table lists them.

Settings are built once at the entry point (``load_settings``) and passed down as plain values;
no module keeps a settings object of its own, so tests can build any configuration they need.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from core.errors import ConfigError
from core.trace_links import check_url_template
from core.usage.budgets import Budget, parse_budgets

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///./slack-agent.db"
# What a slow collector can make a replica hold, in estimated encoded bytes (TRACE_QUEUE_BYTES).
DEFAULT_MAX_QUEUE_BYTES = 64 * 1024 * 1024
# The largest OTLP request sent (TRACE_BATCH_BYTES): 4 MiB is gRPC's default message limit, the
# smallest a common collector applies; a request over a collector's limit is refused whole.
DEFAULT_MAX_BATCH_BYTES = 4 * 1024 * 1024

# The share of TURN_LOCK_STALENESS_SECONDS a turn may go without a confirmed heartbeat before it
# stops itself (§6.12): another replica may claim the lock only after the whole window, measured
# from a heartbeat the database stamped after the turn sent it, so the turn stops a fifth of the
# window before anyone can take it over.
TURN_SAFE_SHARE = 0.8
# The least a derived database timeout is: a short staleness window (as tests and the soak use)
# would give timeouts that a loaded machine's ordinary connection set-up or commit exceeds.
DATABASE_CONNECT_FLOOR_SECONDS = 3.0
DATABASE_STATEMENT_FLOOR_SECONDS = 5.0

# The default grace leaves ``docker stop``'s 10 s (the tightest common kill timer; Kubernetes
# allows 30 s) room for the wind-down after it: interrupting turns, keeping their partial
# answers, telling their threads, closing connections (docs/reliability.md, measured).
SHUTDOWN_GRACE_DEFAULT = 8.0
# What a process manager's timer must allow past the grace for that wind-down: measured at
# 0.2-0.5 s here (docs/reliability.md, *Stopping*), more with many turns or a slow Slack. The
# deployment files add it (deploy/, tests/test_deploy.py holds them to it).
SHUTDOWN_WIND_DOWN_SECONDS = 2.0
# An hour: beyond it a typo (milliseconds for seconds) more likely than an intent.
SHUTDOWN_GRACE_MOST = 3600.0

_SCHEME_ALIASES = {
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "sqlite": "sqlite+aiosqlite",
    "postgresql+asyncpg": "postgresql+asyncpg",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
}


def normalize_database_url(url: str) -> str:
    """Map the URLs operators write (``postgres://``, ``sqlite:///``) to our async drivers.

    Anything else is refused with one line naming the scheme: a typo here would otherwise
    surface as a driver import error deep inside SQLAlchemy.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"DATABASE_URL: {url!r} is not a URL (expected scheme://...)")
    driver = _SCHEME_ALIASES.get(scheme.lower())
    if driver is None:
        raise ConfigError(
            f"DATABASE_URL: unsupported scheme {scheme!r}; use sqlite+aiosqlite:///PATH "
            "or postgresql+asyncpg://USER@HOST/DB"
        )
    return f"{driver}://{rest}"


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


CsvList = Annotated[list[str], NoDecode]
# bashkit's limit on one file (``core.sandbox.shell.BASHKIT_MAX_FILE_BYTES``, which a test keeps
# equal to this): a larger MAX_FILE_BYTES would let every upload above it fail in the sandbox.
SANDBOX_MAX_FILE_BYTES = 10_000_000
_ADMIN = re.compile(r"(?:[TE][A-Z0-9]+:)?[UW][A-Z0-9]+")


# The settings that hold a secret (``Settings.secret_values``; DATABASE_URL's password and the
# OTLP headers are read out of their values).
SECRET_SETTINGS = (
    "slack_bot_token",
    "slack_signing_secret",
    "slack_app_token",
    "slack_client_secret",
    "slack_signin_client_secret",
    "openai_api_key",
    "anthropic_api_key",
)


def _database_password(url: str) -> str | None:
    """The password in a database URL (``scheme://user:password@host/db``), percent-decoded."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_file=".env", env_file_encoding="utf-8", extra="ignore", case_sensitive=False
    )

    database_url: str = DEFAULT_DATABASE_URL
    # PostgreSQL only: off trades the last fraction of a second of commits on a server crash
    # for one WAL flush less per transaction (see README, "Durability and speed").
    postgres_synchronous_commit: bool = True

    slack_bot_token: str | None = None
    slack_signing_secret: str | None = None
    slack_app_token: str | None = None
    slack_client_id: str | None = None
    slack_client_secret: str | None = None
    slack_api_url: str = "https://slack.com/api/"
    host: str = "0.0.0.0"
    port: int = Field(default=3000, ge=0, le=65535)
    # ``/healthz`` and ``/metrics`` on a listener of their own (off the public one); unset:
    # served on HOST:PORT with Slack's requests. METRICS_HOST unset: HOST.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str | None = None

    model_provider: str = "auto"
    model_name: str | None = None
    openai_api_key: str | None = None
    openai_base_url: str = "https://api.openai.com/v1"
    anthropic_api_key: str | None = None
    anthropic_base_url: str = "https://api.anthropic.com"
    # The longest a model may stay silent mid-answer (thinking before its first token, between
    # tool calls) before the turn ends with model_provider_timeout.
    model_timeout_seconds: float = Field(default=120, gt=0)

    turn_lock_staleness_seconds: float = Field(default=60, gt=0)
    turn_heartbeat_seconds: float = Field(default=15, gt=0)
    # Bounded database calls (§6.12). Unset: chosen from the window (``database_timeouts``).
    database_connect_timeout_seconds: float | None = Field(default=None, gt=0)
    database_statement_timeout_seconds: float | None = Field(default=None, gt=0)
    busy_poll_seconds: float = Field(default=3, gt=0)
    busy_poll_timeout_seconds: float = Field(default=600, gt=0)
    busy_mode: Literal["ask", "queue"] = "ask"
    auto_compact_tokens: int = Field(default=100_000, ge=0)

    sweeper_interval_seconds: float = Field(default=3600, ge=0)
    sweeper_jitter_seconds: float = Field(default=60, ge=0)
    sweeper_batch_size: int = Field(default=100, gt=0)
    agent_session_max_idle_days: float = Field(default=30, ge=0)
    agent_session_max_per_user: int = Field(default=30, ge=0)
    temporary_agent_session_time_to_live_hours: float = Field(default=24, gt=0)
    temporary_session_surfaces: CsvList = Field(default_factory=list)
    admin_user_ids: CsvList = Field(default_factory=list)

    max_concurrent_turns: int = Field(default=64, gt=0)
    # Delivery records one replica works on at most (running, or in line for a turn's place;
    # not those parked behind another turn of their thread or session); past it a new
    # message is recorded for any replica with room (core.conversation.intake).
    max_held_messages: int = Field(default=256, gt=0)
    # A file shared in a session's thread is copied into the sandbox up to this size, which
    # the sandbox must be able to hold (``SANDBOX_MAX_FILE_BYTES``).
    max_file_bytes: int = Field(default=SANDBOX_MAX_FILE_BYTES, gt=0)
    # How long running turns may go on after SIGTERM before they are interrupted; what follows
    # (keeping partial answers, telling threads, closing) must also fit in the time the process
    # manager allows before SIGKILL: Kubernetes' default 30 s, ``docker stop``'s 10 s.
    shutdown_grace_seconds: float = Field(
        default=SHUTDOWN_GRACE_DEFAULT, ge=0, le=SHUTDOWN_GRACE_MOST
    )
    session_poll_seconds: float = Field(default=10, gt=0)
    # The MCP servers' file (core.tools.config reads it): unset means ./mcp.json if it exists,
    # empty means none even if it does.
    mcp_config: str | None = None
    approval_timeout_seconds: float = Field(default=86400, gt=0)

    # Spending limits (core.usage.budgets), parsed at load so a bad entry stops start-up.
    budgets: Annotated[tuple[Budget, ...], NoDecode] = ()

    # Tracing (core.tracing): the standard OpenTelemetry variables, read here so a .env file
    # works for them too. No endpoint: tracing is off.
    otel_exporter_otlp_endpoint: str | None = None
    otel_exporter_otlp_traces_endpoint: str | None = None
    otel_exporter_otlp_headers: str | None = None
    otel_exporter_otlp_traces_headers: str | None = None
    # Milliseconds, as the OpenTelemetry specification says (unset: core.tracing's default).
    otel_exporter_otlp_timeout: float | None = Field(default=None, gt=0)
    otel_exporter_otlp_traces_timeout: float | None = Field(default=None, gt=0)
    otel_service_name: str = "slack-agent"
    otel_resource_attributes: str | None = None
    otel_sdk_disabled: bool = False
    otel_bsp_max_queue_size: int = Field(default=2048, gt=0)
    otel_bsp_max_export_batch_size: int = Field(default=512, gt=0)
    otel_bsp_schedule_delay: float = Field(default=5000, gt=0)  # milliseconds, as OTel says
    # The longest text attribute a span carries (OpenTelemetry's variables; the span one wins;
    # unset: core.tracing.config's default, where OpenTelemetry's is no limit at all).
    otel_attribute_value_length_limit: int | None = Field(default=None, gt=0)
    otel_span_attribute_value_length_limit: int | None = Field(default=None, gt=0)
    # Spans waiting for the collector, and one request to it, in bytes (core.tracing.export).
    trace_queue_bytes: int = Field(default=DEFAULT_MAX_QUEUE_BYTES, gt=0)
    trace_batch_bytes: int = Field(default=DEFAULT_MAX_BATCH_BYTES, ge=4096)
    trace_content: bool = True
    trace_user_ids: bool = False
    trace_url_template: str | None = None

    # The HTTP API (web/): how long a browser's Sign in with Slack lasts, how many chats a
    # person may start per minute on one replica, and where browsers sign in (Slack's OpenID
    # Connect authorize page; the stand-in's in tests and the demo).
    web_session_hours: float = Field(default=12, gt=0)
    web_chats_per_minute: int = Field(default=20, gt=0)
    slack_openid_authorize_url: str = "https://slack.com/openid/connect/authorize"
    # Sign in with Slack's app credentials when they are not SLACK_CLIENT_ID/SECRET (those
    # also switch the bot to multi-workspace installs; one workspace's app sets these instead).
    slack_signin_client_id: str | None = None
    slack_signin_client_secret: str | None = None

    log_level: str = "INFO"
    log_format: Literal["text", "json"] = "text"

    _split = field_validator("temporary_session_surfaces", "admin_user_ids", mode="before")(
        _split_csv
    )

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        try:
            return normalize_database_url(value)
        except ConfigError as exc:
            raise ValueError(exc.message) from exc

    @field_validator("temporary_session_surfaces")
    @classmethod
    def _surfaces(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - {"dm", "channel", "assistant"})
        if unknown:
            raise ValueError(f"unknown surface(s) {', '.join(unknown)}; use dm, channel, assistant")
        return value

    @field_validator("admin_user_ids")
    @classmethod
    def _admins(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not _ADMIN.fullmatch(entry):
                raise ValueError(f"{entry!r} is neither TEAM:USER (T…:U…) nor a user id (U…)")
        return value

    @property
    def database_budget_seconds(self) -> float:
        """How long one database call may take at most: the lease loops renew every heartbeat
        period, so a renewal that hangs to its limit must end early enough for the next one to
        land before the safe share of the window runs out."""
        return TURN_SAFE_SHARE * self.turn_lock_staleness_seconds - self.turn_heartbeat_seconds

    @property
    def database_timeouts(self) -> tuple[float, float]:
        """(connect, statement) seconds: what is set, or a quarter and a half of the budget
        (at least the floors above)."""
        budget = self.database_budget_seconds
        connect = self.database_connect_timeout_seconds or max(
            budget / 4, DATABASE_CONNECT_FLOOR_SECONDS
        )
        statement = self.database_statement_timeout_seconds or max(
            budget / 2, DATABASE_STATEMENT_FLOOR_SECONDS
        )
        return connect, statement

    def database_timeout_warning(self) -> str | None:
        """One line, said once by ``serve``, when the derived timeouts (their floors) do not fit
        the window: a very short TURN_LOCK_STALENESS_SECONDS. Turns still stop themselves in
        time; a lease loop or the stop-button poll may wait longer on a dead connection than the
        window. The line names what to set, since the operator chose the window, not the
        timeouts."""
        if self.database_connect_timeout_seconds or self.database_statement_timeout_seconds:
            return None  # set by the operator: checked in ``_workable``
        connect, statement = self.database_timeouts
        budget = self.database_budget_seconds
        if connect + statement <= budget:
            return None
        return (
            f"database timeouts (connect {connect:g}s, statement {statement:g}s) are longer "
            f"than {budget:g}s ({TURN_SAFE_SHARE:g} x TURN_LOCK_STALENESS_SECONDS - "
            "TURN_HEARTBEAT_SECONDS): set DATABASE_CONNECT_TIMEOUT_SECONDS and "
            f"DATABASE_STATEMENT_TIMEOUT_SECONDS to at most {budget:g}s together, or lengthen "
            "TURN_LOCK_STALENESS_SECONDS"
        )

    def secret_values(self) -> list[tuple[str, str]]:
        """Every secret these settings hold, as ``(value, "${NAME}")``: the Slack tokens and
        secrets, the model keys, the database password and the OTLP headers' values. What a
        ``Redactor`` (core.redaction) replaces wherever a text may carry one (tool results,
        logs, traces), so a prompt-steered tool that reads one cannot hand it on."""
        pairs = [
            (value, f"${{{name.upper()}}}")
            for name in SECRET_SETTINGS
            if isinstance(value := getattr(self, name), str) and value
        ]
        password = _database_password(self.database_url)
        if password:
            pairs.append((password, "${DATABASE_URL password}"))
        for name in ("otel_exporter_otlp_headers", "otel_exporter_otlp_traces_headers"):
            for header in (getattr(self, name) or "").split(","):
                value = header.partition("=")[2].strip()
                if value:
                    label = f"${{{name.upper()}}}"
                    pairs += [(value, label), (unquote(value), label)]
        return pairs

    @property
    def signin_credentials(self) -> tuple[str, str] | None:
        """The app's client id and secret for Sign in with Slack (None: browsers cannot)."""
        client_id = self.slack_signin_client_id or self.slack_client_id
        secret = self.slack_signin_client_secret or self.slack_client_secret
        return (client_id, secret) if client_id and secret else None

    def is_admin(self, team: str, user: str) -> bool:
        """``T…:U…`` entries name a user of one workspace; a bare ``U…`` (one workspace only)
        any workspace's user of that id."""
        return f"{team}:{user}" in self.admin_user_ids or user in self.admin_user_ids

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            return parse_budgets(value)
        except ConfigError as exc:
            raise ValueError(exc.message) from exc

    @field_validator("trace_url_template")
    @classmethod
    def _trace_url_template(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            check_url_template(value)
        except ConfigError as exc:
            raise ValueError(exc.message) from exc
        return value

    @field_validator("max_file_bytes")
    @classmethod
    def _max_file_bytes(cls, value: int) -> int:
        if value > SANDBOX_MAX_FILE_BYTES:
            raise ValueError(
                f"{value} is more than the sandbox holds in one file "
                f"({SANDBOX_MAX_FILE_BYTES}); use at most that"
            )
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"{value!r} is not a level; use DEBUG, INFO, WARNING or ERROR")
        return value.upper()

    @model_validator(mode="after")
    def _workable(self) -> Settings:
        """Combinations that pass each field's own check but cannot work together."""
        if self.turn_heartbeat_seconds * 2 > self.turn_lock_staleness_seconds:
            # One late heartbeat (a slow commit, a busy loop) must not let another replica take
            # a live turn over: at least two beats per staleness window.
            raise ValueError(
                f"TURN_HEARTBEAT_SECONDS: {self.turn_heartbeat_seconds:g} is not well below "
                f"TURN_LOCK_STALENESS_SECONDS ({self.turn_lock_staleness_seconds:g}); "
                "use at most half of it"
            )
        if self.database_connect_timeout_seconds or self.database_statement_timeout_seconds:
            connect, statement = self.database_timeouts
            budget = self.database_budget_seconds
            if connect + statement > budget:
                name = (
                    "DATABASE_STATEMENT_TIMEOUT_SECONDS"
                    if self.database_statement_timeout_seconds
                    else "DATABASE_CONNECT_TIMEOUT_SECONDS"
                )
                raise ValueError(
                    f"{name}: connect ({connect:g}s) and statement ({statement:g}s) timeouts "
                    f"together exceed {budget:g}s ({TURN_SAFE_SHARE:g} x "
                    "TURN_LOCK_STALENESS_SECONDS - TURN_HEARTBEAT_SECONDS): a lease renewal "
                    "that hangs to its limit would leave no time for the next before another "
                    "replica may take the work over"
                )
        metrics_host = self.metrics_host or self.host
        if self.metrics_port and self.metrics_port == self.port and metrics_host == self.host:
            raise ValueError(
                f"METRICS_PORT: {self.metrics_port} is PORT already; use another port, or leave "
                "it unset to serve /healthz and /metrics on PORT"
            )
        bare = [a for a in self.admin_user_ids if ":" not in a]
        if bare and (self.slack_client_id or self.slack_client_secret):
            # With OAuth several workspaces install the app, and a user id is only unique
            # within its workspace: a bare id would make admins of strangers.
            raise ValueError(
                f"ADMIN_USER_IDS: {bare[0]!r} must be TEAM:USER (e.g. T0123:{bare[0]}) when "
                "several workspaces can install the app"
            )
        if self.otel_bsp_max_export_batch_size > self.otel_bsp_max_queue_size:
            raise ValueError(
                f"OTEL_BSP_MAX_EXPORT_BATCH_SIZE: {self.otel_bsp_max_export_batch_size} is more "
                f"than OTEL_BSP_MAX_QUEUE_SIZE ({self.otel_bsp_max_queue_size})"
            )
        if self.busy_poll_seconds > self.busy_poll_timeout_seconds:
            raise ValueError(
                f"BUSY_POLL_SECONDS: {self.busy_poll_seconds:g} is longer than "
                f"BUSY_POLL_TIMEOUT_SECONDS ({self.busy_poll_timeout_seconds:g})"
            )
        return self


def load_settings(**overrides: object) -> Settings:
    """Build settings, turning pydantic's multi-line report into one line naming the variable."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]).upper() if first["loc"] else ""
        reason = first["msg"].removeprefix("Value error, ")
        message = reason if not name or reason.startswith(f"{name}:") else f"{name}: {reason}"
        raise ConfigError(message) from None

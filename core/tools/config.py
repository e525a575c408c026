"""The MCP servers an operator names in ``MCP_CONFIG``, read once at start-up.

The file is the ``mcpServers`` format MCP clients share, so one written for another client
works here::

    {"mcpServers": {
        "notes":  {"command": "python", "args": ["-m", "standins.mcp_notes"],
                   "env": {"MCP_NOTES_FILE": "/var/lib/notes.json"}},
        "github": {"url": "https://api.example.com/mcp",
                   "headers": {"Authorization": "Bearer ${GITHUB_TOKEN}"},
                   "approval": "always", "approvers": ["T0123:U0456"], "timeout": 30}}}

Per server, besides ``command``/``args``/``env``/``cwd`` (a subprocess speaking stdio) or
``url``/``headers`` (Streamable HTTP):

- ``approval``: ``unless_read_only`` (default: a tool whose annotations say ``readOnlyHint``
  runs without asking, every other asks), ``always`` or ``never``;
- ``approvers``: ``TEAM:USER`` ids who may decide besides the session's owner and admins;
- ``tools``: the MCP tool names to offer (default: all the server lists);
- ``timeout``: seconds one call (and the start-up handshake) may take, default 60, at most 3600;
  a call past it is an error result and the server is restarted;
- ``disabled``: ``true`` keeps the server configured but never started;
- ``type``: optional, ``stdio`` or ``http`` (``streamable-http``), as other clients write it;
  it must agree with ``command``/``url``.

Every string value may name environment variables as ``${VAR}`` or ``${VAR:-default}``, read
from the environment and then ``.env`` (as settings are). The expanded values stay inside
``Launch``, whose repr hides them; everything else keeps the text as written. A stdio server gets
only the SDK's safe default environment (``PATH``, ``HOME``, ...) plus its ``env``, and runs in
a fresh directory of its own (removed when it stops) unless ``cwd`` names one: never the app's,
where ``.env`` is.

Any problem is a ``ConfigError`` of one line naming the file, the server and the problem, so a
broken file stops start-up before anything connects.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from core.errors import ConfigError
from core.tools.names import server_name_problem
from core.tools.secrets import Redactor, expand

Approval = Literal["always", "never", "unless_read_only"]
Transport = Literal["stdio", "http"]
APPROVALS: tuple[Approval, ...] = ("always", "never", "unless_read_only")
DEFAULT_TIMEOUT_SECONDS = 60.0
MAX_TIMEOUT_SECONDS = 3600.0
DEFAULT_PATH = Path("mcp.json")

_COMMON_KEYS = {"type", "approval", "approvers", "tools", "timeout", "disabled"}
_STDIO_KEYS = {"command", "args", "env", "cwd"}
_HTTP_KEYS = {"url", "headers"}
_TYPES: dict[str, Transport] = {"stdio": "stdio", "http": "http", "streamable-http": "http"}
_APPROVER = re.compile(r"[TE][A-Z0-9]+:[UW][A-Z0-9]+")


class Launch:
    """What a connection needs, with ``${VAR}`` expanded: held apart so nothing prints it."""

    __slots__ = ("args", "command", "cwd", "env", "headers", "url")

    def __init__(
        self,
        *,
        command: str = "",
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        url: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.command = command
        self.args = args
        self.env = dict(env or {})
        self.cwd = cwd
        self.url = url
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return "Launch(<expanded from the environment; not shown>)"

    __str__ = __repr__


@dataclass(frozen=True)
class ServerConfig:
    """One server as configured. ``target`` is for display: the command line or the URL as
    written (``${VAR}`` unexpanded); ``env_names``/``header_names`` list names, never values."""

    name: str
    transport: Transport
    target: str
    approval: Approval = "unless_read_only"
    approvers: tuple[str, ...] = ()
    tools: frozenset[str] | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    disabled: bool = False
    env_names: tuple[str, ...] = ()
    header_names: tuple[str, ...] = ()
    launch: Launch = field(default_factory=Launch, repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.name} ({self.transport}: {self.target})"


@dataclass(frozen=True)
class McpConfig:
    """All configured servers (in file order), and the redactor of every expanded value."""

    path: Path | None = None
    servers: tuple[ServerConfig, ...] = ()
    redactor: Redactor = field(default_factory=Redactor, repr=False, compare=False)

    def server(self, name: str) -> ServerConfig | None:
        return next((s for s in self.servers if s.name == name), None)


def config_path(setting: str | None, *, cwd: Path | None = None) -> Path | None:
    """The file ``MCP_CONFIG`` names: unset means ``./mcp.json`` if it exists, empty means none."""
    base = cwd or Path.cwd()
    if setting is None:
        default = base / DEFAULT_PATH
        return default if default.is_file() else None
    if not setting.strip():
        return None
    path = Path(setting).expanduser()
    return path if path.is_absolute() else base / path


def mcp_environment(env_file: Path = Path(".env")) -> dict[str, str]:
    """The variables ``${VAR}`` may name: the process environment over ``.env``."""
    from dotenv import dotenv_values

    values = {k: v for k, v in dotenv_values(env_file).items() if v is not None}
    return {**values, **os.environ} if env_file.is_file() else dict(os.environ)


def with_known_secrets(config: McpConfig, pairs: Iterable[tuple[str, str]]) -> McpConfig:
    """``config`` whose redactor also replaces ``pairs`` (``Settings.secret_values``): a server
    can read or be handed a secret the file never named (a token in its own config, a file it
    can reach), and what it answers reaches the model, the thread and the traces."""
    return replace(config, redactor=config.redactor.merged(pairs))


def load_mcp_config(
    setting: str | None, *, environ: Mapping[str, str] | None = None, cwd: Path | None = None
) -> McpConfig:
    """Read and check the servers' file; no file means no servers. ``environ`` is what ``${VAR}``
    may name (default: ``mcp_environment()``, the process environment over ``.env``)."""
    path = config_path(setting, cwd=cwd)
    if path is None:
        return McpConfig()
    where = f"MCP_CONFIG {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot be read ({exc})") from None
    try:
        document = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except _Duplicate as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return _parse(document, path, where, mcp_environment() if environ is None else environ)


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(f"{key!r} appears twice in one object")
        seen[key] = value
    return seen


def _parse(document: object, path: Path, where: str, environ: Mapping[str, str]) -> McpConfig:
    if not isinstance(document, dict):
        raise ConfigError(f'{where}: expected an object with "mcpServers"')
    unknown = sorted(set(document) - {"mcpServers"})
    if unknown:
        raise ConfigError(f'{where}: unknown key {unknown[0]!r} (only "mcpServers" is read)')
    servers = document.get("mcpServers")
    if not isinstance(servers, dict):
        raise ConfigError(f'{where}: "mcpServers" must be an object of servers by name')
    secrets: list[tuple[str, str]] = []
    parsed = []
    for name, entry in servers.items():
        try:
            parsed.append(_server(name, entry, environ, secrets))
        except ValueError as exc:
            raise ConfigError(f"{where}: server {name!r}: {exc}") from None
    return McpConfig(path=path, servers=tuple(parsed), redactor=Redactor(secrets))


def _server(
    name: str, raw: object, environ: Mapping[str, str], secrets: list[tuple[str, str]]
) -> ServerConfig:
    if (problem := server_name_problem(name)) is not None:
        raise ValueError(problem)
    if not isinstance(raw, dict):
        raise ValueError("must be an object")
    unknown = sorted(set(raw) - _COMMON_KEYS - _STDIO_KEYS - _HTTP_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}")
    entry = cast(dict[str, Any], _expanded(raw, "", environ, secrets))
    has_command, has_url = "command" in entry, "url" in entry
    if has_command and has_url:
        raise ValueError('has both "command" (stdio) and "url" (HTTP); give one')
    if not has_command and not has_url:
        raise ValueError('needs "command" (a stdio server) or "url" (a Streamable HTTP server)')
    transport: Transport = "stdio" if has_command else "http"
    stray = sorted(set(entry) & (_HTTP_KEYS if transport == "stdio" else _STDIO_KEYS))
    if stray:
        kind = "a stdio server" if transport == "stdio" else "an HTTP server"
        raise ValueError(f"{stray[0]!r} does not apply to {kind}")
    if "type" in entry:
        if entry["type"] == "sse":
            raise ValueError('the SSE transport is not supported; use Streamable HTTP ("http")')
        declared = _TYPES.get(entry["type"]) if isinstance(entry["type"], str) else None
        if declared is None:
            raise ValueError('"type" must be "stdio" or "http"')
        if declared != transport:
            given = "command" if transport == "stdio" else "url"
            raise ValueError(f'"type" is {entry["type"]!r} but the server has a "{given}"')
    approval = entry.get("approval", "unless_read_only")
    if approval not in APPROVALS:
        raise ValueError(f'"approval" must be one of {", ".join(APPROVALS)} (got {approval!r})')
    approvers = _strings(entry, "approvers")
    for approver in approvers:
        if not _APPROVER.fullmatch(approver):
            raise ValueError(f"approver {approver!r} is not TEAM:USER (e.g. T0123:U0456)")
    tools = _strings(entry, "tools") if "tools" in entry else None
    timeout = entry.get("timeout", DEFAULT_TIMEOUT_SECONDS)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ValueError('"timeout" must be a number of seconds')
    if not 0 < timeout <= MAX_TIMEOUT_SECONDS:
        raise ValueError(f'"timeout" must be above 0 and at most {MAX_TIMEOUT_SECONDS:g} seconds')
    disabled = entry.get("disabled", False)
    if not isinstance(disabled, bool):
        raise ValueError('"disabled" must be true or false')
    common: dict[str, Any] = {
        "name": name,
        "approval": cast(Approval, approval),
        "approvers": tuple(approvers),
        "tools": None if tools is None else frozenset(tools),
        "timeout_seconds": float(timeout),
        "disabled": disabled,
    }
    if transport == "stdio":
        command = entry["command"]
        if not isinstance(command, str) or not command.strip():
            raise ValueError('"command" must be a non-empty string')
        args = _strings(entry, "args", allow_empty=True)
        env = _string_map(entry, "env")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise ValueError('"cwd" must be a string')
        return ServerConfig(
            transport="stdio",
            target=shlex.join([raw["command"], *raw.get("args", [])]),
            env_names=tuple(env),
            launch=Launch(command=command, args=tuple(args), env=env, cwd=cwd),
            **common,
        )
    url = entry["url"]
    if not isinstance(url, str) or not re.match(r"https?://[^/\s]+", url):
        raise ValueError(f'"url" must be an http:// or https:// URL (got {raw["url"]!r})')
    headers = _string_map(entry, "headers")
    return ServerConfig(
        transport="http",
        target=raw["url"],
        header_names=tuple(headers),
        launch=Launch(url=url, headers=headers),
        **common,
    )


def _expanded(
    value: object, where: str, environ: Mapping[str, str], secrets: list[tuple[str, str]]
) -> object:
    """``value`` with ``${VAR}`` expanded in every string inside it (keys stay as written)."""
    if isinstance(value, str):
        try:
            expanded, used = expand(value, environ)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        secrets.extend(used)
        return expanded
    if isinstance(value, dict):
        return {
            k: _expanded(v, f"{where}.{k}" if where else k, environ, secrets)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_expanded(v, f"{where}[{i}]", environ, secrets) for i, v in enumerate(value)]
    return value


def _strings(entry: dict[str, Any], key: str, *, allow_empty: bool = False) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(
        isinstance(v, str) and (v or allow_empty) for v in value
    ):
        what = "strings" if allow_empty else "non-empty strings"
        raise ValueError(f"{key!r} must be a list of {what}")
    return value


def _string_map(entry: dict[str, Any], key: str) -> dict[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{key!r} must be an object of strings")
    return value

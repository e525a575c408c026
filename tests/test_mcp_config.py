"""``MCP_CONFIG``: the shared ``mcpServers`` format, ``${VAR}`` kept out of every text, one line
for each mistake; the settings it adds; the digest an approval binds to; the tools' names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from mcp_types import ImageContent, TextContent

from core.errors import ConfigError
from core.redaction import Redactor
from core.settings import load_settings
from core.tools import call_digest, load_mcp_config, mcp_environment
from core.tools.config import config_path
from core.tools.names import offered_name, server_of
from core.tools.outcome import cut, render_content

SECRET = "tok-3f9a8b7c6d5e4f"


def write(path: Path, document: Any) -> str:
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


def test_settings__defaults_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings()
    assert settings.mcp_config is None
    assert settings.approval_timeout_seconds == 86400
    monkeypatch.setenv("MCP_CONFIG", "/etc/slack-agent/mcp.json")
    monkeypatch.setenv("APPROVAL_TIMEOUT_SECONDS", "600")
    settings = load_settings()
    assert (settings.mcp_config, settings.approval_timeout_seconds) == (
        "/etc/slack-agent/mcp.json",
        600,
    )
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("APPROVAL_TIMEOUT_SECONDS", bad)
        with pytest.raises(ConfigError) as caught:
            load_settings()
        assert str(caught.value).startswith("APPROVAL_TIMEOUT_SECONDS: ")
        assert "\n" not in str(caught.value)


def test_config_path__default_file_only_if_it_exists(tmp_path: Path) -> None:
    assert config_path(None, cwd=tmp_path) is None
    assert load_mcp_config(None, cwd=tmp_path).servers == ()
    write(tmp_path / "mcp.json", {"mcpServers": {}})
    assert config_path(None, cwd=tmp_path) == tmp_path / "mcp.json"
    assert config_path("", cwd=tmp_path) is None  # explicitly none, even with ./mcp.json
    assert config_path("other.json", cwd=tmp_path) == tmp_path / "other.json"


def test_parse__stdio_and_http_with_defaults_and_options(tmp_path: Path) -> None:
    path = write(
        tmp_path / "mcp.json",
        {
            "mcpServers": {
                "notes": {"command": "python", "args": ["-m", "notes", "--dir", "${DIR:-/tmp}"]},
                "git-hub": {
                    "type": "http",
                    "url": "https://mcp.example.com/mcp",
                    "headers": {"Authorization": "Bearer ${TOKEN}"},
                    "approval": "always",
                    "approvers": ["T0123:U0456"],
                    "tools": ["search", "create_issue"],
                    "timeout": 30,
                },
                "old": {"command": "old-server", "disabled": True},
            }
        },
    )
    config = load_mcp_config(path, environ={"TOKEN": SECRET})
    notes, github, old = config.servers
    assert (notes.transport, notes.approval, notes.timeout_seconds) == (
        "stdio",
        "unless_read_only",
        60,
    )
    assert notes.launch.args == ("-m", "notes", "--dir", "/tmp")
    assert notes.target == "python -m notes --dir '${DIR:-/tmp}'"
    assert (github.transport, github.approval, github.approvers) == (
        "http",
        "always",
        ("T0123:U0456",),
    )
    assert github.tools == frozenset({"search", "create_issue"})
    assert github.timeout_seconds == 30
    assert github.launch.headers == {"Authorization": f"Bearer {SECRET}"}
    assert github.header_names == ("Authorization",)
    assert old.disabled


def test_secrets__never_in_repr_str_or_display(tmp_path: Path) -> None:
    path = write(
        tmp_path / "mcp.json",
        {
            "mcpServers": {
                "a": {"command": "run", "args": ["--key=${TOKEN}"], "env": {"KEY": "${TOKEN}"}},
                "b": {"url": "https://h/mcp?key=${TOKEN}", "headers": {"X-Key": "${TOKEN}"}},
            }
        },
    )
    config = load_mcp_config(path, environ={"TOKEN": SECRET})
    assert config.servers[0].launch.env == {"KEY": SECRET}  # it is there for the connection...
    shown = [
        repr(config),
        str(config),
        *(f"{s!s} {s!r} {s.launch} {s.target}" for s in config.servers),
    ]
    assert all(SECRET not in text for text in shown)  # ...and nowhere else
    assert "${TOKEN}" in str(config.servers[1])
    assert config.redactor.redact(f"GET /mcp?key={SECRET}") == "GET /mcp?key=${TOKEN}"


def test_secrets__short_values_are_not_redacted() -> None:
    redactor = Redactor([("1", "${DEBUG}"), ("true", "${ON}"), (SECRET, "${TOKEN}")])
    assert redactor.redact(f"1 true {SECRET}") == "1 true ${TOKEN}"


def test_environment__process_over_dotenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text("TOKEN=from-dotenv\nONLY_HERE=dotenv-only\n")
    monkeypatch.setenv("TOKEN", "from-process")
    environ = mcp_environment(tmp_path / ".env")
    assert (environ["TOKEN"], environ["ONLY_HERE"]) == ("from-process", "dotenv-only")


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        (
            "{not json",
            "not valid JSON (Expecting property name enclosed in double quotes at line 1",
        ),
        ("[]", 'expected an object with "mcpServers"'),
        ({"mcpServers": {}, "other": 1}, "unknown key 'other'"),
        ({"mcpServers": []}, '"mcpServers" must be an object'),
        ('{"mcpServers": {"a": {"command": "x"}, "a": {"command": "y"}}}', "'a' appears twice"),
        ({"mcpServers": {"s": {"command": "x", "envs": {}}}}, "server 's': unknown key 'envs'"),
        (
            {"mcpServers": {"s": {"command": "x", "url": "http://h"}}},
            'server \'s\': has both "command" (stdio) and "url" (HTTP)',
        ),
        ({"mcpServers": {"s": {"args": []}}}, "server 's': needs \"command\""),
        ({"mcpServers": {"a__b": {"command": "x"}}}, "server 'a__b': a server name must be"),
        ({"mcpServers": {"my server": {"command": "x"}}}, "server 'my server': a server name"),
        ({"mcpServers": {"s" * 33: {"command": "x"}}}, "a server name is at most 32"),
        (
            {"mcpServers": {"s": {"command": "x", "env": {"K": "${NOPE}"}}}},
            "server 's': env.K: ${NOPE} is not set in the environment",
        ),
        (
            {"mcpServers": {"s": {"command": "x", "args": ["${OPEN"]}}},
            "server 's': args[0]: '${OPEN' has no closing brace",
        ),
        (
            {"mcpServers": {"s": {"command": "x", "args": ["${1X}"]}}},
            "${1X} does not name an environment variable",
        ),
        (
            {"mcpServers": {"s": {"command": "x", "approval": "sometimes"}}},
            "server 's': \"approval\" must be one of always, never, unless_read_only",
        ),
        (
            {"mcpServers": {"s": {"command": "x", "approvers": ["U0456"]}}},
            "server 's': approver 'U0456' is not TEAM:USER",
        ),
        ({"mcpServers": {"s": {"command": "x", "tools": "all"}}}, "'tools' must be a list"),
        ({"mcpServers": {"s": {"command": "x", "timeout": "30"}}}, '"timeout" must be a number'),
        ({"mcpServers": {"s": {"command": "x", "timeout": 0}}}, '"timeout" must be above 0'),
        ({"mcpServers": {"s": {"command": "x", "timeout": True}}}, '"timeout" must be a number'),
        ({"mcpServers": {"s": {"command": "x", "disabled": "yes"}}}, '"disabled" must be true'),
        ({"mcpServers": {"s": {"command": 7}}}, '"command" must be a non-empty string'),
        ({"mcpServers": {"s": {"command": "x", "args": "-v"}}}, "'args' must be a list"),
        ({"mcpServers": {"s": {"command": "x", "env": {"K": 1}}}}, "'env' must be an object"),
        ({"mcpServers": {"s": {"command": "x", "headers": {}}}}, "'headers' does not apply"),
        ({"mcpServers": {"s": {"url": "ftp://h/x"}}}, '"url" must be an http:// or https://'),
        (
            {"mcpServers": {"s": {"url": "http://h", "type": "sse"}}},
            "SSE transport is not supported",
        ),
        ({"mcpServers": {"s": {"url": "http://h", "type": "stdio"}}}, "\"type\" is 'stdio' but"),
        ({"mcpServers": {"s": "python server.py"}}, "server 's': must be an object"),
    ],
)
def test_malformed__one_line_naming_file_server_and_problem(
    tmp_path: Path, document: Any, problem: str
) -> None:
    path = write(tmp_path / "mcp.json", document)
    with pytest.raises(ConfigError) as caught:
        load_mcp_config(path, environ={})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"MCP_CONFIG {path}: ")
    assert problem in message


def test_malformed__missing_file_and_secret_free_message(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^MCP_CONFIG .*missing\.json: no such file$"):
        load_mcp_config(str(tmp_path / "missing.json"))
    path = write(tmp_path / "mcp.json", {"mcpServers": {"s": {"url": "${URL}", "type": 3}}})
    with pytest.raises(ConfigError) as caught:
        load_mcp_config(path, environ={"URL": f"https://h/mcp?key={SECRET}"})
    assert SECRET not in str(caught.value)


def test_digest__binds_the_exact_call() -> None:
    digest = call_digest("mcp__notes__add_note", {"title": "a", "text": "b"})
    assert digest == call_digest("mcp__notes__add_note", {"text": "b", "title": "a"})
    canonical = '{"arguments":{"text":"b","title":"a"},"name":"mcp__notes__add_note"}'
    assert digest == hashlib.sha256(canonical.encode()).hexdigest()
    assert digest != call_digest("mcp__notes__add_note", {"title": "a", "text": "c"})
    assert digest != call_digest("mcp__other__add_note", {"title": "a", "text": "b"})
    assert call_digest("t", {"n": 1}) != call_digest("t", {"n": 1.0})
    stored = json.loads(json.dumps({"title": "é", "n": [1, 2.5, None]}))
    assert call_digest("t", stored) == call_digest("t", {"n": [1, 2.5, None], "title": "é"})
    # What answers the offered name is named too: "repo.search" and "repo_search" are both
    # offered as mcp__gh__repo_search, and a server can be pointed elsewhere.
    name, arguments = "mcp__gh__repo_search", {"q": "x"}
    dotted = {"server": "gh", "origin": "stdio:gh-mcp", "tool": "repo.search"}
    assert call_digest(name, arguments, tool=dotted) != call_digest(name, arguments)
    underscored = {**dotted, "tool": "repo_search"}
    assert call_digest(name, arguments, tool=dotted) != call_digest(
        name, arguments, tool=underscored
    )
    moved = {**dotted, "origin": "http:https://elsewhere/mcp"}
    assert call_digest(name, arguments, tool=dotted) != call_digest(name, arguments, tool=moved)


def test_names__offered_names_fit_the_model_apis() -> None:
    assert offered_name("notes", "add_note") == "mcp__notes__add_note"
    assert offered_name("gh", "repo.search") == "mcp__gh__repo_search"
    assert offered_name("gh", "x" * 60) is None
    assert server_of("mcp__git-hub__create_issue") == "git-hub"
    assert server_of("shell") is None


def test_render__cut_with_a_note_and_binary_labelled() -> None:
    text, truncated = cut("x" * 25, cap=10)
    assert truncated
    assert text.startswith("x" * 10 + "\n\n[cut: the result was 25 characters")
    image = ImageContent(type="image", mime_type="image/png", data="AAECAw==")
    text, structured, truncated = render_content([TextContent(type="text", text="hi"), image], None)
    assert text == "hi\n[binary image (image/png, 4 bytes): not shown to the model]"
    assert "AAECAw" not in text
    assert structured is None
    assert not truncated
    text, structured, truncated = render_content([], {"rows": ["y" * 50]}, cap=20)
    assert structured is None
    assert truncated

"""MCP tools over stdio, against the real notes server in subprocesses: what is offered, how a
call ends (every failure an outcome naming the server), restarts, secrets, metrics, shutdown."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import json
import logging
import os
import sys
from pathlib import Path

import pytest
from mcp.client.stdio import get_default_environment

from core.settings import Settings
from core.tools import (
    RESULT_CAP,
    McpTools,
    call_digest,
    load_mcp_config,
    with_known_secrets,
)
from standins.mcp_notes import PNG_1PX
from tests.mcp_support import (
    alive,
    calls_counted,
    calls_timed,
    notes,
    notes_entry,
    running,
    write_config,
)

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

SECRET = "notes-secret-7f3a9c2e51"
ADD = "mcp__notes__add_note"
FAULT = "mcp__notes__fault"


async def pid_of(tools: McpTools, server: str = "notes") -> int:
    outcome = await tools.call(f"mcp__{server}__fault", {"kind": "pid"})
    assert outcome.ok, outcome
    return int(outcome.text)


async def test_listing__names_schemas_and_rules_from_annotations(tmp_path: Path) -> None:
    servers = {
        "notes": notes_entry(tmp_path),
        "strict": notes_entry(tmp_path, approval="always", tools=["list_notes", "add_note"]),
        "lax": notes_entry(tmp_path, faults=False, approval="never"),
    }
    async with running(tmp_path, servers) as tools:
        assert [s.state for s in tools.status()] == ["connected"] * 3
        rules = {spec.name: tools.needs_approval(spec.name) for spec in tools.specs()}
        assert rules == {
            "mcp__notes__add_note": True,  # readOnlyHint false: asks
            "mcp__notes__fault": False,
            "mcp__notes__list_notes": False,  # readOnlyHint true: runs
            "mcp__notes__read_note": False,
            "mcp__strict__add_note": True,  # "always"; and only the tools named in "tools"
            "mcp__strict__list_notes": True,
            "mcp__lax__add_note": False,  # "never"
            "mcp__lax__list_notes": False,
            "mcp__lax__read_note": False,
        }
        read = next(s for s in tools.specs() if s.name == "mcp__notes__read_note")
        assert read.description == "Read the note with this title."
        assert read.parameters["type"] == "object"
        assert read.parameters["required"] == ["title"]
        assert tools.needs_approval("mcp__nobody__anything") is False
        described = tools.tool("mcp__notes__list_notes")
        assert described is not None
        assert (described.server, described.tool, described.read_only) == (
            "notes",
            "list_notes",
            True,
        )


async def test_call__result_and_the_approval_bound_to_the_exact_call(tmp_path: Path) -> None:
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as tools:
        arguments = {"title": "standup", "text": "at 10"}
        unapproved = await tools.call(ADD, arguments)
        assert unapproved.kind == "approval_required"
        tool = tools.tool(ADD)
        assert tool is not None
        other = tool.digest({"title": "standup", "text": "at 11"})
        assert (await tools.call(ADD, arguments, approval=other)).kind == "approval_required"
        assert notes(tmp_path) == {}  # neither ran

        by_name = call_digest(ADD, arguments)  # names the call, not the tool that answers it
        assert (await tools.call(ADD, arguments, approval=by_name)).kind == "approval_required"
        saved = await tools.call(ADD, arguments, approval=tool.digest(arguments))
        assert saved.ok, saved
        assert saved.text == "saved note 'standup' (1 notes)"
        assert notes(tmp_path) == {"standup": "at 10"}

        listed = await tools.call("mcp__notes__list_notes", {})
        assert (listed.kind, listed.structured) == ("ok", {"result": ["standup"]})
        read = await tools.call("mcp__notes__read_note", {"title": "standup"})
        assert read.text == "at 10"
        result = read.to_tool_result("call-1")
        assert (result.tool_call_id, result.tool_name, result.is_error) == (
            "call-1",
            "mcp__notes__read_note",
            False,
        )
        missing = await tools.call("mcp__notes__read_note", {"title": "lunch"})
        assert missing.kind == "tool_error"
        assert "there is no note titled 'lunch'" in missing.text
        assert missing.to_tool_result("call-2").is_error


async def test_call__arguments_checked_against_the_schema_before_sending(tmp_path: Path) -> None:
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as tools:
        sent = calls_timed("notes")
        wrong_type = await tools.call("mcp__notes__read_note", {"title": 3})
        assert wrong_type.kind == "invalid_arguments"
        assert wrong_type.text == (
            "the arguments do not match the input schema of mcp__notes__read_note: "
            "title: 3 is not of type 'string'"
        )
        missing = tools.precheck(ADD, {"title": "t"})
        assert missing is not None
        assert "'text' is a required property" in missing.text
        bad = {"title": "t", "text": 5}
        checked = tools.tool(ADD)
        assert checked is not None
        refused = await tools.call(ADD, bad, approval=checked.digest(bad))
        assert refused.kind == "invalid_arguments"
        assert tools.precheck(ADD, {"title": "t", "text": "x"}) is None
        unknown = await tools.call("mcp__notes__delete_everything", {})
        assert unknown.kind == "unknown_tool"
        assert calls_timed("notes") == sent  # nothing reached the server
        assert notes(tmp_path) == {}


async def test_timeout__an_error_result_then_a_fresh_server(tmp_path: Path) -> None:
    async with running(tmp_path, {"notes": notes_entry(tmp_path, timeout=1)}) as tools:
        first = await pid_of(tools)
        before = calls_counted("notes", "fault", "timeout")
        hung = await tools.call(FAULT, {"kind": "hang"})
        assert hung.kind == "timeout"
        assert hung.text == (
            "MCP server 'notes' did not answer fault within 1 s; it is being restarted"
        )
        assert calls_counted("notes", "fault", "timeout") == before + 1
        second = await pid_of(tools)
        assert second != first
        assert not alive(first)


async def test_crash_mid_call__names_the_server_and_restarts_it(tmp_path: Path) -> None:
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as tools:
        first = await pid_of(tools)
        crashed = await tools.call(FAULT, {"kind": "crash"})
        assert crashed.kind == "server_failed"
        assert crashed.text == (
            "MCP server 'notes' exited (notes: crashing on purpose) during the call; "
            "it is being restarted"
        )
        second = await pid_of(tools)
        assert second != first
        assert not alive(first)  # reaped, not a zombie


async def test_garbage_on_stdout__an_error_for_that_call_and_a_restart(tmp_path: Path) -> None:
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as tools:
        first = await pid_of(tools)
        garbled = await tools.call(FAULT, {"kind": "garbage"})
        assert garbled.kind == "server_failed"
        assert garbled.text == (
            "MCP server 'notes' sent something that is not MCP (JSON-RPC) to stdout during the "
            "call; it is being restarted"
        )
        assert await pid_of(tools) != first
        assert not alive(first)


async def test_cancelled_call__raises_counts_and_leaves_the_server_up(tmp_path: Path) -> None:
    hanging_now = tmp_path / "hanging"
    os.mkfifo(hanging_now)
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as tools:
        first = await pid_of(tools)
        before = calls_counted("notes", "fault", "cancelled")
        call = asyncio.create_task(tools.call(FAULT, {"kind": "hang", "name": str(hanging_now)}))
        assert await asyncio.to_thread(hanging_now.read_text) == "hanging"
        call.cancel()  # the turn stopped: cancellation is the one thing call() lets through
        with pytest.raises(asyncio.CancelledError):
            await call
        assert calls_counted("notes", "fault", "cancelled") == before + 1
        assert tools.status()[0].state == "connected"
        assert await pid_of(tools) == first  # not restarted: nothing was wrong with it


async def test_results__huge_cut_binary_labelled_errors_kept(tmp_path: Path) -> None:
    async with running(tmp_path, {"notes": notes_entry(tmp_path)}) as tools:
        huge = await tools.call(FAULT, {"kind": "huge", "size": 50_000})
        assert huge.ok
        assert huge.truncated
        assert huge.text.startswith("n" * RESULT_CAP + "\n\n[cut: the result was 50,000 characters")
        assert len(huge.text) < RESULT_CAP + 100
        binary = await tools.call(FAULT, {"kind": "binary"})
        assert binary.text.splitlines() == [
            "a picture and a file",
            f"[binary image (image/png, {len(PNG_1PX)} bytes): not shown to the model]",
            "[binary resource file:///notes.bin (application/octet-stream, 300 bytes): "
            "not shown to the model]",
        ]
        assert base64.b64encode(PNG_1PX).decode()[:20] not in binary.text
        refused = await tools.call(FAULT, {"kind": "error"})
        assert refused.kind == "tool_error"
        assert "the notes store refused on purpose" in refused.text


async def test_down_at_start_up__one_line_no_tools_then_it_comes_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate = tmp_path / "gate"
    entry = notes_entry(tmp_path, env={"MCP_NOTES_START_GATE": str(gate)})
    caplog.set_level(logging.DEBUG, logger="slack-agent.mcp")
    async with running(tmp_path, {"notes": entry}) as tools:
        async with asyncio.timeout(60):
            while tools.status()[0].failed_attempts < 3:  # it keeps trying in the background
                await tools.changed()
        status = tools.status()[0]
        assert status.state == "failed"
        assert status.reason == f"exited (notes: not starting until {gate} exists)"
        assert tools.specs() == []
        down = await tools.call("mcp__notes__list_notes", {})
        assert down.kind == "unavailable"
        assert down.text.startswith("MCP server 'notes' is unavailable: exited (notes: not")
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert [r.getMessage() for r in warnings] == [
            f"MCP server 'notes' is unavailable: exited (notes: not starting until {gate} "
            "exists); its tools are absent until it answers (next try in 0.05 s)"
        ]

        gate.touch()
        async with asyncio.timeout(60):
            await tools.wait_for("notes", "connected")
        assert len(tools.specs()) == 4
        assert (await tools.call("mcp__notes__list_notes", {})).ok


async def test_unstartable_command__failed_with_the_reason(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-server")
    async with running(tmp_path, {"gone": {"command": missing}}) as tools:
        status = tools.status()[0]
        assert (status.state, status.reason) == (
            "failed",
            "cannot be started (No such file or directory)",
        )


async def test_secrets__never_in_logs_outcomes_or_reprs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    entry = notes_entry(tmp_path, env={"NOTES_TOKEN": "${NOTES_TOKEN}"})
    environ = {**os.environ, "NOTES_TOKEN": SECRET}
    async with running(tmp_path, {"notes": entry}, environ=environ) as tools:
        echoed = await tools.call(FAULT, {"kind": "echo", "name": "NOTES_TOKEN"})
        assert echoed.text == "NOTES_TOKEN=${NOTES_TOKEN}"  # the server had it; we show its name
        crashed = await tools.call(FAULT, {"kind": "crash"})
        shown = [repr(tools), repr(tools.config), *map(repr, tools.status()), crashed.text]
    assert all(SECRET not in text for text in shown)
    assert caplog.records
    assert SECRET not in caplog.text
    assert "NOTES_TOKEN=${NOTES_TOKEN}" in caplog.text  # its stderr line, redacted


async def test_metrics__calls_by_server_tool_and_outcome(tmp_path: Path) -> None:
    servers = {"notes": notes_entry(tmp_path), "off": notes_entry(tmp_path, disabled=True)}
    async with running(tmp_path, servers) as tools:
        cases = [
            ("list_notes", "ok", "mcp__notes__list_notes", {}),
            ("read_note", "tool_error", "mcp__notes__read_note", {"title": "none"}),
            ("read_note", "invalid_arguments", "mcp__notes__read_note", {}),
            ("add_note", "approval_required", ADD, {"title": "a", "text": "b"}),
            ("fault", "server_failed", FAULT, {"kind": "crash"}),
        ]
        sent = calls_timed("notes")
        for tool, outcome, name, arguments in cases:
            before = calls_counted("notes", tool, outcome)
            assert (await tools.call(name, arguments)).kind == outcome
            assert calls_counted("notes", tool, outcome) == before + 1
        assert calls_timed("notes") == sent + 3  # ok, tool_error and the crash reached it
        before = calls_counted("(unknown)", "(unknown)", "unknown_tool")
        assert (await tools.call("mcp__ghost__x", {})).kind == "unknown_tool"
        assert calls_counted("(unknown)", "(unknown)", "unknown_tool") == before + 1
        before = calls_counted("off", "(unknown)", "unavailable")
        disabled = await tools.call("mcp__off__list_notes", {})
        assert (disabled.kind, disabled.text) == (
            "unavailable",
            "MCP server 'off' is disabled in the configuration",
        )
        assert calls_counted("off", "(unknown)", "unavailable") == before + 1


async def test_shutdown__every_session_closed_every_process_reaped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    started, hanging_now = tmp_path / "stuck.pid", tmp_path / "hanging"
    os.mkfifo(started)
    os.mkfifo(hanging_now)
    write_pid = (
        f"import os,time; open({str(started)!r},'w').write(str(os.getpid())); time.sleep(600)"
    )
    # A server that starts and never speaks MCP: shutdown must not wait out its handshake.
    servers = {
        "notes": notes_entry(tmp_path),
        "stuck": {"command": sys.executable, "args": ["-c", write_pid]},
    }
    caplog.set_level(logging.WARNING)
    tools = McpTools(load_mcp_config(write_config(tmp_path, servers)))
    await tools.start()
    stuck_pid = int(await asyncio.to_thread(started.read_text))
    async with asyncio.timeout(60):
        await tools.wait_for("notes", "connected")
    notes_pid = await pid_of(tools)
    hanging = asyncio.create_task(tools.call(FAULT, {"kind": "hang", "name": str(hanging_now)}))
    assert await asyncio.to_thread(hanging_now.read_text) == "hanging"
    assert tools.status()[1].state == "starting"

    await tools.aclose()
    outcome = await hanging
    assert (outcome.kind, outcome.text) == (
        "unavailable",
        "MCP server 'notes' was shut down during the call",
    )
    assert not alive(notes_pid)
    assert not alive(stuck_pid)
    assert [s.state for s in tools.status()] == ["closed", "closed"]
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("mcp-server:")]
    assert not [r for r in caplog.records if r.name == "asyncio"]  # no "Task was destroyed"
    assert (await tools.call("mcp__notes__list_notes", {})).kind == "unavailable"


def dumpable() -> int:
    """This process's ``prctl(PR_GET_DUMPABLE)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(3, 0, 0, 0, 0))


def place(path: str | Path) -> Path | None:
    """Where a directory really is (None once it is gone)."""
    real = Path(path).resolve()
    return real if real.is_dir() else None


async def test_stdio_server__own_directory_and_only_its_declared_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stdio server a prompt steers to look around finds neither the app's ``.env`` (it runs
    in a directory of its own) nor the app's environment (only the SDK's defaults and its own
    ``env``); a ``cwd`` in the file is kept."""
    app = tmp_path / "app"
    app.mkdir()
    (app / ".env").write_text(f"SLACK_BOT_TOKEN={SECRET}\n")
    monkeypatch.chdir(app)
    monkeypatch.setenv("SLACK_BOT_TOKEN", SECRET)
    monkeypatch.setenv("DATABASE_URL", f"postgresql://agent:{SECRET}@db/agent")
    placed = tmp_path / "placed"
    placed.mkdir()
    servers = {
        "notes": notes_entry(tmp_path, env={"DECLARED": "yes"}),
        "placed": notes_entry(tmp_path, cwd=str(placed)),
    }
    async with running(tmp_path, servers) as tools:
        snooped = await tools.call(FAULT, {"kind": "snoop"})
        again = await tools.call(FAULT, {"kind": "snoop"})
        elsewhere = await tools.call("mcp__placed__fault", {"kind": "snoop"})
    assert snooped.ok, snooped
    seen = json.loads(snooped.text)
    assert SECRET not in snooped.text
    assert seen["dotenv"] is None
    assert Path(seen["cwd"]) != place(app)  # getcwd() gives the real path
    assert seen["environ"]["DECLARED"] == "yes"
    extra = set(seen["environ"]) - set(get_default_environment()) - {"DECLARED"}
    assert extra <= {"MCP_NOTES_FILE", "MCP_NOTES_FAULTS", "PWD", "LC_CTYPE", "_"}, extra
    assert json.loads(again.text)["cwd"] == seen["cwd"]  # one directory per server, kept
    assert place(seen["cwd"]) is None  # and removed with the server
    assert place(json.loads(elsewhere.text)["cwd"]) == place(placed)
    # Nor through /proc/<app>/environ or cwd (for a server without CAP_SYS_PTRACE, i.e. not
    # run as root): the app made itself non-dumpable before it started one.
    assert dumpable() == 0


async def test_secrets__every_secret_the_product_knows_is_redacted_from_results(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The file need not name a secret for a server to know it: one written into its own
    configuration, read from a file it reaches. Every secret of the settings is replaced."""
    caplog.set_level(logging.DEBUG)
    password = "db-password-5e81c0aa"
    settings = Settings(
        slack_bot_token=SECRET,
        database_url=f"postgresql://agent:{password}@db/agent",
        otel_exporter_otlp_headers="authorization=Bearer%20otlp-key-77aa01",
        _env_file=None,  # type: ignore[call-arg]
    )
    leaky = notes_entry(tmp_path, env={"LEAKED": f"{SECRET} {password} Bearer otlp-key-77aa01"})
    config = load_mcp_config(write_config(tmp_path, {"notes": leaky}), environ=os.environ)
    async with McpTools(with_known_secrets(config, settings.secret_values())) as tools:
        async with asyncio.timeout(60):
            await tools.wait_ready()
        echoed = await tools.call(FAULT, {"kind": "echo", "name": "LEAKED"})
    assert echoed.text == (
        "LEAKED=${SLACK_BOT_TOKEN} ${DATABASE_URL password} ${OTEL_EXPORTER_OTLP_HEADERS}"
    )
    for secret in (SECRET, password, "otlp-key-77aa01"):
        assert secret not in caplog.text  # its stderr line, redacted too

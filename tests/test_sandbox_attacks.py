"""Escape and exhaustion attempts, each run as the agent runs it: a real turn.

Every attempt goes through ``Agent.run_turn`` with the offline model (a user message ``$ cmd``
makes it call the shell tool with ``cmd``), on the real store, on SQLite and on PostgreSQL. For
each one the test checks what the issue "Proof under load, faults and bad input" asks of the
sandbox:

- the turn returns (no exception) and its answer is persisted, with the tool part carrying the
  command's exit code and output: what the model was shown;
- the session's lock is released;
- the snapshot stored for the answer, and everything in the snapshot tables, stays under a bound
  derived from ``SandboxLimits`` (``snapshot_bound``);
- nothing of the host (a secret written by the test, a variable of the test's environment, the
  host's own ``/etc/passwd`` and ``/proc/version``) reaches the output;
- the next turn of the same session still works (``$ echo alive``).

Network attempts aim at a listener of the test's own on 127.0.0.1, which must see no connection
but the test's own control connection afterwards. The memory bound of a replica running such
turns is checked in a child process (``tests/sandbox_memory_child.py``). docs/reliability.md
(section *Sandbox*) tabulates the outcomes; set ``SANDBOX_ATTACKS_REPORT`` to a file path to get
them as JSON lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from core.agent.loop import Agent, AgentConfig, TurnResult
from core.agent.model_choice import ProviderCache
from core.messages import user_message
from core.providers.streaming import HttpOptions, RetryPolicy
from core.sandbox.shell import BASHKIT_MAX_DIRS, BASHKIT_MAX_FILES, SandboxLimits
from core.settings import Settings
from core.storage import snapshots
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from standins import openai
from standins.openai import OpenAIStandIn
from tests.helpers import ROOT, new_session
from tests.providers_fixtures import RecordingSleep

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

LIMITS = SandboxLimits()
# Attempts that are meant to run into the wall-clock limit use a short one, so the suite does
# not wait 30 s for each; the limit is what is under test, not its value.
SHORT = SandboxLimits(timeout_seconds=2.0)

# Per file or directory, what a snapshot holds besides its contents: a tree entry, a file object
# naming its chunks, the set membership and row overhead. Measured: about 70 bytes raw and
# 130 bytes stored per file for 10,000 one-line files; 512 leaves room.
ENTRY_OVERHEAD = 512


def snapshot_bound(limits: SandboxLimits) -> int:
    """The most one message's sandbox state may take, raw or stored.

    The contents (files plus shell variables) are held to ``max_state_bytes`` by the sandbox;
    the metadata grows with the number of entries, which bashkit caps at ``BASHKIT_MAX_FILES``
    files and ``BASHKIT_MAX_DIRS`` directories.
    """
    return limits.max_state_bytes + (BASHKIT_MAX_FILES + BASHKIT_MAX_DIRS) * ENTRY_OVERHEAD


@dataclass(frozen=True)
class Attempt:
    """One attempt: the command (``{secret}``, ``{tmp}`` and ``{port}`` are filled in), what
    the model must be shown, and how it must have ended."""

    name: str
    command: str
    shown: tuple[str, ...] = ()
    fails: bool = True
    truncated: bool = False
    setup: tuple[str, ...] = ()
    limits: SandboxLimits = LIMITS
    network: bool = False
    check: Callable[[dict[str, Any]], None] | None = field(default=None, compare=False)


NOT_FOUND = "No such file or directory"
NO_NETWORK = "network access not configured"
FILL_ZEROS = (
    "mkdir -p /w; for f in FILES; do for i in 1 2 3 4 5 6 7 8 9; do "
    "head -c 1048576 /dev/zero >> /w/f$f || exit 1; done; done; du -sb /w"
)
RANDOM_APPENDS = (
    "mkdir -p /r; for i in $(seq 1 1200); do head -c 8192 /dev/urandom >> /r/NAME; done"
)


def _only_virtual_homes(out: dict[str, Any]) -> None:
    assert set(out["stdout"].split()) <= {"/root:", "/home:", ".", "..", "sandbox", "user"}


def _at_virtual_root(out: dict[str, Any]) -> None:
    lines = out["stdout"].split("\n")
    assert lines[0] == "/"
    assert set(lines[1:]) <= {"", "bin", "dev", "etc", "home", "proc", "root", "tmp", "usr"}


def _virtual_passwd(out: dict[str, Any]) -> None:
    assert out["stdout"].startswith("sandbox:x:1000:1000:")


ATTEMPTS = [
    # -- the host's files ---------------------------------------------------------------------
    Attempt("host-etc-shadow", "cat /etc/shadow", (NOT_FOUND,)),
    Attempt("host-proc-environ", "cat /proc/self/environ", (NOT_FOUND,)),
    Attempt("host-root-listing", "ls -a /root /home", fails=False, check=_only_virtual_homes),
    Attempt("host-passwd", "cat /etc/passwd", fails=False, check=_virtual_passwd),
    Attempt("host-test-secret", "cat {secret}", (NOT_FOUND,)),
    Attempt("host-test-directory", "ls {tmp}", (NOT_FOUND,)),
    Attempt("host-environment", "env; set; cat /proc/1/environ", (NOT_FOUND,)),
    Attempt("path-traversal", "cd ../../../..; pwd; ls", fails=False, check=_at_virtual_root),
    Attempt("path-traversal-file", "cat ../../../../../etc/shadow", (NOT_FOUND,)),
    Attempt("symlink-escape", "ln -s /etc/shadow s && cat s", (NOT_FOUND,)),
    Attempt("proc-root-escape", "cat /proc/1/root/etc/shadow", (NOT_FOUND,)),
    # -- the network --------------------------------------------------------------------------
    Attempt("net-curl", "curl -sS http://127.0.0.1:{port}/", (NO_NETWORK,), network=True),
    Attempt("net-wget", "wget -O - http://127.0.0.1:{port}/", (NO_NETWORK,), network=True),
    # bashkit's ``http`` prints the refusal on stdout and exits 0 (see docs/reliability.md).
    Attempt(
        "net-http-builtin",
        "http GET http://127.0.0.1:{port}/",
        (NO_NETWORK,),
        fails=False,
        network=True,
    ),
    Attempt("net-dev-tcp", "echo hi > /dev/tcp/127.0.0.1/{port}", (NOT_FOUND,), network=True),
    Attempt(
        "net-dev-tcp-exec",
        "exec 3<>/dev/tcp/127.0.0.1/{port}; echo hi >&3",
        (NOT_FOUND,),
        network=True,
    ),
    Attempt("net-nc", "nc 127.0.0.1 {port}", ("command not found",), network=True),
    Attempt("net-ssh", "ssh -p {port} 127.0.0.1", ("command not found",), network=True),
    Attempt(
        "net-python-socket",
        "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}))'",
        ("command not found",),
        network=True,
    ),
    # -- processes ----------------------------------------------------------------------------
    # bashkit ends the bomb at its function-depth limit and exits 0, saying so on stderr.
    Attempt("fork-bomb", ":(){ :|:& };:", ("maximum function depth exceeded",), fails=False),
    Attempt("yes", "yes", ("output limit",)),
    Attempt("background-sleep", "sleep 1000 &", ("execution timeout",), limits=SHORT),
    Attempt(
        "background-then-foreground",
        "sleep 1000 & echo started; wait",
        ("execution timeout",),
        limits=SHORT,
    ),
    Attempt("kill-host", "kill -9 1; kill -9 -1; kill -9 $PPID; echo survived"),
    Attempt("exec-host-shell", "exec /bin/sh -c 'cat /etc/shadow'", (NOT_FOUND,)),
    Attempt("exec-host-python", "exec /usr/bin/python3", (NOT_FOUND,)),
    # -- output floods ------------------------------------------------------------------------
    Attempt("flood-yes-2gb", "yes | head -c 2000000000", ("output limit",), fails=False),
    Attempt("flood-urandom", "cat /dev/urandom | head -c 100000000", fails=False),
    Attempt("flood-zero", "cat /dev/zero", fails=False, truncated=True),
    Attempt("flood-binary-nul", "printf 'a\\0b\\0c'", fails=False),
    Attempt(
        "flood-loop-megabytes",
        "for i in $(seq 1 5000); do printf '%01000d\\n' 0; done",
        fails=False,
        truncated=True,
    ),
    Attempt("flood-seq", "seq 1 100000000", ("line limit",), truncated=True),
    Attempt("flood-printf-width", "printf '%02000000000d' 0", ("exceeds limit",)),
    Attempt("flood-brace-range", "echo {1..100000000}", ("brace range too large",)),
    Attempt(
        "flood-gzip-bomb",
        "head -c 1048576 /dev/zero > /z; for i in 1 2 3 4 5 6 7 8 9; do cat /z; done > /z9; "
        "gzip /z9; for i in $(seq 1 200); do cat /z9.gz; done > /b.gz; gunzip -c /b.gz | wc -c",
        fails=False,
    ),
    # -- endless loops ------------------------------------------------------------------------
    Attempt("loop-while", "while :; do :; done", ("maximum command count exceeded",)),
    Attempt("loop-for-ever", "for((;;)); do :; done", ("maximum command count exceeded",)),
    Attempt("loop-sleeping", "while :; do sleep 1; done", ("execution timeout",), limits=SHORT),
    Attempt("sleep-forever", "sleep infinity", ("execution timeout",), limits=SHORT),
    Attempt("loop-awk", "awk 'BEGIN { while (1) {} }'", ("loop iteration limit",)),
    Attempt("loop-recursion", "f(){ f; }; f", ("maximum function depth exceeded",)),
    # -- the workspace ------------------------------------------------------------------------
    Attempt(
        "fill-dd-200mb",
        "mkdir -p /w; dd if=/dev/zero of=/w/big bs=1M count=200",
        ("live intermediate bytes",),
    ),
    Attempt(
        "fill-one-file",
        "head -c 1048576 /dev/zero > /one; for i in $(seq 1 20); do cat /one >> /big || exit 1; "
        "done",
        ("file too large",),
    ),
    Attempt(
        "fill-past-state-limit",
        FILL_ZEROS.replace("FILES", "1 2 3 4 5 6 7 8"),
        ("over its limit",),
    ),
    Attempt(
        "fill-until-refused",
        FILL_ZEROS.replace("FILES", "$(seq 1 12)"),
        ("filesystem full", "over its limit"),
    ),
    Attempt(
        "fill-random",
        RANDOM_APPENDS.replace("NAME", "c"),
        fails=False,
        setup=(RANDOM_APPENDS.replace("NAME", "a"), RANDOM_APPENDS.replace("NAME", "b")),
    ),
    Attempt(
        "files-1000",
        "mkdir -p /w; for i in $(seq 1 1000); do echo $i > /w/f$i; done; ls /w | wc -l",
        ("1000",),
        fails=False,
    ),
    Attempt(
        "files-10000",
        "for i in $(seq 9001 10001); do echo $i > /w/f$i || exit 1; done",
        ("too many files",),
        setup=("mkdir -p /w; for i in $(seq 1 9000); do echo $i > /w/f$i; done",),
    ),
    Attempt(
        "dirs-10000",
        "for i in $(seq 5001 10001); do mkdir /d$i || exit 1; done",
        ("too many directories",),
        setup=("for i in $(seq 1 5000); do mkdir /d$i; done",),
    ),
    Attempt(
        "dirs-deep",
        "d=/deep; for i in $(seq 1 200); do d=$d/d; done; mkdir -p $d",
        ("cannot create directory",),
    ),
    Attempt("name-too-long", "touch $(printf 'a%.0s' $(seq 1 300))", ("cannot touch",)),
    Attempt(
        "env-huge-refused",
        "x=$(printf '%010000d' 0); for i in $(seq 1 13); do x=\"$x$x\"; done",
        ("variable byte limit",),
    ),
    Attempt(
        "env-huge-kept",
        "x=$(printf '%010000d' 0); for i in $(seq 1 12); do x=\"$x$x\"; done; echo ${#x}",
        ("40960000",),
        fails=False,
    ),
    Attempt(
        "env-plus-files-past-state-limit",
        FILL_ZEROS.replace("FILES", "1 2 3 4"),
        ("over its limit",),
        setup=("x=$(printf '%010000d' 0); for i in $(seq 1 12); do x=\"$x$x\"; done",),
    ),
]


@dataclass
class Listener:
    """A TCP listener on 127.0.0.1 that records every connection it accepts."""

    port: int = 0
    peers: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None
    controlled: asyncio.Event = field(default_factory=asyncio.Event)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.append(await reader.read(64))
        writer.close()
        if self.peers[-1] == b"control":
            self.controlled.set()

    async def control(self) -> None:
        """Connect as the host would: proves the listener works and records connections."""
        _, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"control")
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        await self.controlled.wait()


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    found = Listener()
    found.server = await asyncio.start_server(found._accept, "127.0.0.1", 0)
    found.port = found.server.sockets[0].getsockname()[1]
    async with found.server:
        yield found


@pytest.fixture
def host_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Strings only the host has, none of which may reach the sandbox's output."""
    secret = f"host-secret-{uuid.uuid4()}"
    (tmp_path / "host-secret.txt").write_text(secret)
    canary = f"host-canary-{uuid.uuid4()}"
    monkeypatch.setenv("SANDBOX_ATTACKS_CANARY", canary)
    markers = {"secret": secret, "canary": canary}
    for name, path in (("passwd", "/etc/passwd"), ("kernel", "/proc/version")):
        try:
            first = Path(path).read_text().splitlines()[0]
        except (OSError, IndexError):
            continue
        if len(first) >= 16:
            markers[name] = first[:60]
    return markers


def offline_agent(store: SessionStore, limits: SandboxLimits) -> tuple[Agent, ProviderCache]:
    cache = ProviderCache(Settings(model_provider="offline"))
    return Agent(store, cache, AgentConfig(sandbox_limits=limits)), cache


async def say(agent: Agent, session_id: int, text: str) -> TurnResult:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
    )


async def shell_output(store: SessionStore, session_id: int, result: TurnResult) -> dict[str, Any]:
    """The tool part of the persisted answer: what the model was shown."""
    assert result.answer is not None
    stored = (await store.messages(session_id))[-1]
    assert stored.message_id == result.answer.message_id
    assert stored.role == "assistant"
    parts = [p for p in stored.message["parts"] if p["type"] == "tool-shell"]
    assert len(parts) == 1, stored.message["parts"]
    assert parts[0]["state"] == "output-available"
    return dict(parts[0]["output"])


async def tool_outputs(store: SessionStore, session_id: int) -> list[dict[str, Any]]:
    """Every shell result of the session's answers, in order."""
    return [
        dict(part["output"])
        for stored in await store.messages(session_id)
        for part in stored.message["parts"]
        if part["type"] == "tool-shell"
    ]


def fake_model(server: OpenAIStandIn) -> Settings:
    """Settings for a scripted model: several tool calls in one turn, as a real model makes."""
    return Settings(
        model_provider="openai",
        openai_api_key="sk-test",
        openai_base_url=server.base_url,
        model_name="fake-model",
    )


def no_retry_sleep() -> HttpOptions:
    return HttpOptions(retry=RetryPolicy(sleep=RecordingSleep()))


async def snapshot_sizes(db: Database, message_id: str) -> tuple[int, int] | None:
    """(raw_size, stored_size) of a message's own snapshot row; None when it has none."""
    async with db.read() as conn:
        row = (
            await conn.execute(
                select(snapshots.SNAPSHOTS.c.raw_size, snapshots.SNAPSHOTS.c.stored_size).where(
                    snapshots.SNAPSHOTS.c.message_id == message_id
                )
            )
        ).first()
    return None if row is None else (int(row.raw_size), int(row.stored_size))


async def content_bytes(db: Database) -> tuple[int, int]:
    """(decoded, stored) bytes of every object in ``snapshot_contents``."""
    contents = snapshots.CONTENTS
    async with db.read() as conn:
        row = (
            await conn.execute(
                select(
                    func.coalesce(func.sum(contents.c.raw_size), 0),
                    func.coalesce(func.sum(func.length(contents.c.data)), 0),
                )
            )
        ).one()
    return int(row[0]), int(row[1])


def report(entry: dict[str, Any]) -> None:
    path = os.environ.get("SANDBOX_ATTACKS_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(entry) + "\n")


@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
async def test_attempt_ends_inside_the_sandbox(
    attempt: Attempt,
    store: SessionStore,
    db: Database,
    backend: str,
    listener: Listener,
    host_markers: dict[str, str],
    tmp_path: Path,
) -> None:
    _, session = await new_session(store)
    agent, cache = offline_agent(store, attempt.limits)
    # The setup is not the attempt: it builds the state the attempt starts from (thousands of
    # files, say), so it runs with time to spare however loaded the machine is; the attempt
    # itself runs within the limits it is about.
    preparer, preparer_cache = offline_agent(store, replace(attempt.limits, timeout_seconds=600))
    try:
        for command in attempt.setup:
            ready = await shell_output(
                store, session.id, await say(preparer, session.id, f"$ {command}")
            )
            assert ready["exit_code"] == 0, ready
        command = (
            attempt.command.replace("{secret}", str(tmp_path / "host-secret.txt"))
            .replace("{tmp}", str(tmp_path))
            .replace("{port}", str(listener.port))
        )

        result = await say(agent, session.id, f"$ {command}")

        assert result.error is None
        assert result.text.startswith("[offline stand-in]")  # the model answered after the tool
        out = await shell_output(store, session.id, result)
        shown = out["stdout"] + out["stderr"]
        assert (out["exit_code"] != 0) is attempt.fails, out["exit_code"]
        for words in attempt.shown:
            assert words in shown, (words, shown[-2000:])
        cap = attempt.limits.max_output_bytes + 200  # the cap plus the truncation marker
        assert len(out["stdout"].encode()) <= cap
        assert len(out["stderr"].encode()) <= cap
        assert "\x00" not in shown  # PostgreSQL's JSONB cannot hold it
        if attempt.truncated:
            assert out["truncated"] is True
            assert "[output truncated" in shown
        for marker in host_markers.values():
            assert marker not in shown
            assert marker not in result.text
        if attempt.check is not None:
            attempt.check(out)
        assert not await store.is_turn_active(session.id)

        bound = snapshot_bound(attempt.limits)
        assert result.answer is not None
        sizes = await snapshot_sizes(db, result.answer.message_id)
        if sizes is not None:
            assert max(sizes) <= bound, (sizes, bound)
        raw, stored = await content_bytes(db)
        assert max(raw, stored) <= bound, (raw, stored, bound)

        if attempt.network:
            await listener.control()
            assert listener.peers == [b"control"]

        alive = await say(agent, session.id, "$ echo alive")
        assert alive.error is None
        after = await shell_output(store, session.id, alive)
        assert (after["stdout"], after["exit_code"]) == ("alive\n", 0)
        assert not await store.is_turn_active(session.id)
        report(
            {
                "backend": backend,
                "name": attempt.name,
                "command": command,
                "exit_code": out["exit_code"],
                "truncated": out["truncated"],
                "stdout_bytes": len(out["stdout"].encode()),
                "stderr": out["stderr"][:300],
                "stdout_head": out["stdout"][:120],
                "snapshot": sizes,
                "contents": [raw, stored],
                "bound": bound,
            }
        )
    finally:
        await cache.aclose()
        await preparer_cache.aclose()


async def test_a_shell_stuck_on_a_background_job_recovers_within_the_turn(
    store: SessionStore,
) -> None:
    """bashkit waits for background jobs at the end of every run, even jobs of earlier runs; a
    job outliving the time limit then made every later command of that shell time out too. The
    sandbox now rebuilds its shell from its own state after a time-out: the model's next command
    in the same turn runs, with the files and variables it had."""
    _, session = await new_session(store)
    async with OpenAIStandIn() as server:
        server.push(
            openai.tool_call_reply(
                [("c1", "shell", {"command": "echo kept > /tmp/k; export V=v; sleep 1000 &"})]
            ),
            openai.tool_call_reply([("c2", "shell", {"command": "echo alive; cat /tmp/k"})]),
            openai.tool_call_reply([("c3", "shell", {"command": 'echo "$V"'})]),
            openai.text_reply("done"),
        )
        cache = ProviderCache(fake_model(server), http=no_retry_sleep())
        try:
            agent = Agent(store, cache, AgentConfig(sandbox_limits=SHORT))
            result = await say(agent, session.id, "go")
        finally:
            await cache.aclose()
    assert result.error is None
    assert result.text == "done"
    outputs = await tool_outputs(store, session.id)
    assert "execution timeout" in outputs[0]["stderr"]
    assert (outputs[1]["stdout"], outputs[1]["exit_code"]) == ("alive\nkept\n", 0)
    assert (outputs[2]["stdout"], outputs[2]["exit_code"]) == ("v\n", 0)
    assert not await store.is_turn_active(session.id)


async def test_a_state_over_its_limit_is_not_kept_unless_cleaned_up_in_the_turn(
    store: SessionStore, db: Database
) -> None:
    """Over the limit the model is told after the command and may clean up: a state back under
    the limit by the end of the turn is kept as usual; one still over it is not, and the next
    turn starts from the state before."""
    _, session = await new_session(store)
    limits = SandboxLimits(max_state_bytes=4 * 1024 * 1024)
    fill = "for i in 1 2 3 4 5; do head -c 1048576 /dev/zero > /big$i; done; echo kept > /k"
    async with OpenAIStandIn() as server:
        server.push(
            openai.tool_call_reply([("c1", "shell", {"command": fill})]),
            openai.text_reply("left it full"),
            openai.tool_call_reply([("c2", "shell", {"command": "cat /k"})]),
            openai.tool_call_reply([("c3", "shell", {"command": fill})]),
            openai.tool_call_reply([("c4", "shell", {"command": "rm /big1 /big2"})]),
            openai.text_reply("cleaned up"),
            openai.tool_call_reply([("c5", "shell", {"command": "cat /k; ls /"})]),
            openai.text_reply("checked"),
        )
        cache = ProviderCache(fake_model(server), http=no_retry_sleep())
        try:
            agent = Agent(store, cache, AgentConfig(sandbox_limits=limits))
            full = await say(agent, session.id, "fill it")
            cleaned = await say(agent, session.id, "fill it and clean up")
            checked = await say(agent, session.id, "check")
        finally:
            await cache.aclose()

    outputs = await tool_outputs(store, session.id)
    assert outputs[0]["exit_code"] != 0
    assert "over its limit" in outputs[0]["stderr"]
    assert full.answer is not None
    assert await snapshot_sizes(db, full.answer.message_id) is None  # not kept
    assert "No such file" in outputs[1]["stderr"]  # the next turn has the state before

    assert "over its limit" in outputs[2]["stderr"]
    assert (outputs[3]["exit_code"], outputs[3]["stderr"]) == (0, "")
    assert cleaned.answer is not None
    sizes = await snapshot_sizes(db, cleaned.answer.message_id)
    assert sizes is not None
    assert sizes[0] <= snapshot_bound(limits)
    assert outputs[4]["stdout"].startswith("kept\n")
    assert "big3" in outputs[4]["stdout"]
    assert "big1" not in outputs[4]["stdout"]
    assert checked.error is None
    assert not await store.is_turn_active(session.id)


def test_memory_of_a_replica_running_the_attempts_stays_bounded(database_url: str) -> None:
    """A real child process runs the floods, fills, bombs and the huge variable as turns and
    reports its peak RSS; the parent checks it against ``memory_bound`` (see the child)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sandbox_memory_child.py"), database_url],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    figures = json.loads(lines[-1])
    report({"memory": figures, "database": database_url.split(":", 1)[0]})
    assert figures["turns"] == figures["expected_turns"]
    assert figures["peak_kib"] - figures["baseline_kib"] <= figures["bound_kib"], figures

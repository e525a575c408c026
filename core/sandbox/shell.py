"""The agent's shell: one bashkit sandbox per session, restored, run and captured.

Isolation is bashkit's: a virtual filesystem (no host directory is mounted), no network (no
allowlist is configured, so ``curl``/``wget`` refuse), no embedded Python or SQLite, and limits
per run on commands, loop iterations, wall time and the memory of shell variables. bashkit's
filesystem has fixed limits of its own (``BASHKIT_MAX_FS_BYTES`` and the like) that its Python
binding does not let us lower, so what a snapshot may capture is limited here
(``SandboxLimits.max_state_bytes``). Output is capped here as well, so one command cannot flood a
model's context, and NUL characters are replaced (PostgreSQL's JSONB cannot store them).
docs/reliability.md (section *Sandbox*) lists the escape and exhaustion attempts this was tried
against and what each one did.

What a captured state is made of and how it is encoded for storage is ``core.sandbox.state``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import bashkit

from core.sandbox.state import (
    STORED,
    Baseline,
    Captured,
    SandboxState,
    decode_envelope,
    decode_stored,
    encode_capture,
    json_object,
    shell_key,
)

log = logging.getLogger(__name__)

# bashkit's filesystem limits: its ``FsLimits`` defaults, which its Python binding (0.20) neither
# exposes nor lets us change. ``max_memory`` does not touch them (it bounds shell variables).
BASHKIT_MAX_FS_BYTES: Final = 100_000_000
BASHKIT_MAX_FILE_BYTES: Final = 10_000_000
BASHKIT_MAX_FILES: Final = 10_000
BASHKIT_MAX_DIRS: Final = 10_000
# What bashkit's result says when a run hit ``timeout_seconds``.
_TIMEOUT_ERROR: Final = "execution timeout"


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one session's sandbox; the defaults suit an agent's tool calls, not long jobs.

    ``max_commands``, ``max_loop_iterations`` and ``timeout_seconds`` are bashkit's, per run (one
    tool call). ``max_memory_bytes`` is bashkit's ``max_memory``: the bytes the shell's variables
    may hold, not its files. ``max_output_bytes`` caps each of stdout and stderr as the model
    sees them (bashkit keeps at most 1 MiB of each in any case).

    ``max_state_bytes`` bounds what a snapshot stores and what capturing it costs in memory:
    file contents plus shell variables (exported ones count twice, as the snapshot holds them
    twice). bashkit's own filesystem limit is 100 MB whatever ``max_memory`` says, a snapshot
    stores all of a state's new bytes for each message, and capturing a state holds several
    copies of it at once. After every command that leaves the state over this limit the model
    is told so (the command's exit code becomes non-zero); a state still over it when the turn
    ends is not kept, and the next turn starts from the last state that was.
    """

    max_commands: int = 10_000
    max_loop_iterations: int = 100_000
    timeout_seconds: float = 30.0
    max_memory_bytes: int = 64 * 1024 * 1024
    max_output_bytes: int = 64 * 1024
    max_state_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class ShellResult:
    stdout: str
    stderr: str
    exit_code: int
    truncated: bool


def _cap(text: str, limit: int) -> tuple[str, bool]:
    """At most ``limit`` bytes of ``text``, with a marker saying how much was cut.

    NUL characters (binary output: ``/dev/zero``, ``/dev/urandom``, ``printf '\\0'``) become
    U+FFFD, as undecodable bytes already are: PostgreSQL's JSONB cannot store U+0000, and a
    tool result holding one could not be persisted with the turn's answer.
    """
    text = text.replace("\x00", "\ufffd")
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= limit:
        return text, False
    kept = raw[:limit].decode("utf-8", errors="ignore")
    return f"{kept}\n[output truncated: {len(raw) - limit} more bytes]\n", True


class Sandbox:
    """A bashkit shell for one session's turn: restore, run commands, capture.

    Not shared between turns running at once; ``run`` calls are serialised. A sandbox whose
    capture was not stored (the turn failed) should be reopened from the database, because the
    next capture assumes the previous one was stored.
    """

    def __init__(self, limits: SandboxLimits | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self._shell: bashkit.Bash | None = None  # made when first needed (``_bash``)
        self._lock = asyncio.Lock()
        self._inflight: asyncio.Future[Any] | None = None
        self._dirty = False
        self._base = Baseline()
        self.message_id: str | None = None

    # -- opening ------------------------------------------------------------------------------

    @property
    def _bash(self) -> bashkit.Bash:
        """The shell, made on first use: most turns of a conversation never run a command,
        and making one holds the GIL for a noticeable share of a turn's CPU time."""
        if self._shell is None:
            self._shell = self._new_bash()
        return self._shell

    def _new_bash(self) -> bashkit.Bash:
        return bashkit.Bash(
            max_commands=self.limits.max_commands,
            max_loop_iterations=self.limits.max_loop_iterations,
            max_memory=self.limits.max_memory_bytes,
            timeout_seconds=self.limits.timeout_seconds,
            python=False,
            sqlite=False,
            network=None,
        )

    def _checkout(self, bash: bashkit.Bash, commit: str, objects: Mapping[str, bytes]) -> None:
        try:
            bash.checkout(commit, dict(objects))
        except bashkit.BashError as exc:
            # A sandbox configured differently (an older release's builtins): keep the files.
            log.warning("snapshot %s needs a forced checkout: %s", commit, exc)
            bash.checkout(commit, dict(objects), policy="force")

    @classmethod
    def new(cls, limits: SandboxLimits | None = None) -> Sandbox:
        """An empty sandbox (a session's first turn). Its baseline is the empty shell's
        commit, the same for every empty shell of these limits (content-addressed), so it is
        made once per process and the shell itself only when a command runs."""
        sandbox = cls(limits)
        sandbox._base.note_head(*_empty_head(sandbox.limits))
        return sandbox

    @classmethod
    def from_state(cls, state: SandboxState | None, limits: SandboxLimits | None = None) -> Sandbox:
        """The sandbox of a stored state (``core.storage.snapshots.load_state``); new when None."""
        if state is None:
            return cls.new(limits)
        sandbox = cls(limits)
        objects: dict[str, bytes] = {}
        anchors: dict[str, str] = {}
        bases: dict[str, bytes | None] = {}
        for obj in state.objects:
            envelope, _ = decode_stored(obj, bases)
            objects[obj.digest] = envelope
            anchors[obj.digest] = obj.digest if obj.base is None else obj.base.digest
        anchor_data = {d: data for d, data in bases.items() if data is not None}
        sandbox._checkout(sandbox._bash, state.commit, objects)
        sandbox._base = Baseline(objects=objects, anchors=anchors, anchor_data=anchor_data)
        sandbox._base.base_set = state.base_set
        sandbox._base.note_head(*_head(state.commit, objects))
        sandbox.message_id = state.message_id
        return sandbox

    @classmethod
    async def open(cls, state: SandboxState | None, limits: SandboxLimits | None = None) -> Sandbox:
        """``from_state`` off the event loop (decoding and checkout take a few milliseconds);
        an empty one in place, where there is nothing to decode."""
        if state is None:
            return cls.new(limits)
        return await asyncio.to_thread(cls.from_state, state, limits)

    # -- running ------------------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        """Whether a command ran since the sandbox was opened or last captured.

        Free to ask; a clean sandbox certainly has nothing to snapshot (``capture`` then
        returns None without asking bashkit anything).
        """
        return self._dirty

    async def run(self, command: str) -> ShellResult:
        """Run a command line in a worker thread (bashkit blocks while it runs)."""
        async with self._lock:
            await self._settle()
            self._dirty = True
            future = asyncio.ensure_future(asyncio.to_thread(self._execute, command))
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                self._bash.cancel()
                self._inflight = future
                raise

    async def _settle(self) -> None:
        """Wait for a cancelled run to wind down, then let the next one proceed."""
        if self._inflight is not None:
            await asyncio.wait([self._inflight])
            self._inflight = None
            self._bash.clear_cancel()

    def _execute(self, command: str) -> ShellResult:
        started = time.monotonic()
        notes: list[str] = []
        try:
            result = self._bash.execute_sync(command)
        except bashkit.BashError as exc:
            out, err, code, cut = "", f"{exc}\n", 2, False
            timed_out = _TIMEOUT_ERROR in str(exc)
        else:
            out, err, code = result.stdout, result.stderr, int(result.exit_code)
            cut = bool(result.stdout_truncated or result.stderr_truncated)
            timed_out = _TIMEOUT_ERROR in (result.error or "")
        if timed_out or time.monotonic() - started >= self.limits.timeout_seconds:
            self._restart()
            notes.append(
                "sandbox: the command ran into the time limit; the shell was restarted with "
                "its files, variables and directory, and any background job was stopped"
            )
        size = self.state_bytes()
        if size > self.limits.max_state_bytes:
            code = code or 1
            notes.append(
                f"sandbox: files and shell variables now take {size:,} bytes, over its limit "
                f"of {self.limits.max_state_bytes:,}: remove files or unset variables before "
                "this turn ends, or the sandbox goes back to how it was before the turn"
            )
        limit = self.limits.max_output_bytes
        stdout, cut_out = _cap(out, limit)
        stderr, cut_err = _cap(err, limit)
        if notes:
            newline = "\n" if stderr and not stderr.endswith("\n") else ""
            stderr += newline + "".join(f"{note}\n" for note in notes)
        return ShellResult(stdout, stderr, code, cut or cut_out or cut_err)

    def _restart(self) -> None:
        """A new bashkit shell with this one's state (files, variables, directory, functions).

        bashkit (0.20) waits for background jobs at the end of every run, including jobs left
        by earlier runs, and ``cancel()`` does not stop them: after ``sleep 1000 &`` outlives
        the time limit, every later command of that shell times out as well. A shell restored
        from a commit of its state has no jobs. The baseline is unchanged (same content ids).
        """
        try:
            packed = self._bash.commit()
            objects = {k: bytes(v) for k, v in packed.objects.items()}
            fresh = self._new_bash()
            self._checkout(fresh, packed.id, objects)
        except (bashkit.BashError, RuntimeError, ValueError):
            # Keep the shell as it is: its commands may time out, but the turn goes on.
            log.exception("sandbox: restarting the shell after a time-out failed")
            return
        self._shell = fresh

    def state_bytes(self) -> int:
        """File contents plus shell variables, the bytes ``max_state_bytes`` limits.

        A walk of bashkit's filesystem (milliseconds per thousand entries) and of its shell state,
        in bytes as a snapshot stores them: every file's size, and every variable, exported
        variable, array element, alias and trap with its name.
        """
        fs = self._bash.fs()
        total = 0
        pending = ["/"]
        while pending:
            path = pending.pop()
            try:
                entries = fs.read_dir(path)
            except RuntimeError:  # gone or unreadable: nothing of it can be captured either
                continue
            for entry in entries:
                meta = entry["metadata"]
                if meta["file_type"] == "directory":
                    pending.append(f"{path.rstrip('/')}/{entry['name']}")
                else:
                    total += int(meta["size"])
        shell = self._bash.shell_state()
        flat: list[Mapping[Any, str]] = [shell.variables, shell.env, shell.aliases, shell.traps]
        flat += [*shell.arrays.values(), *shell.assoc_arrays.values()]
        for mapping in flat:
            total += sum(len(str(k).encode()) + len(v.encode()) for k, v in mapping.items())
        return total

    def write_files(self, files: Mapping[str, str]) -> None:
        """Put files into the sandbox directly (uploads, fixtures), creating directories."""
        self._dirty = True
        for path, content in files.items():
            parent = path.rsplit("/", 1)[0]
            if parent:
                self._bash.mkdir(parent, recursive=True)
            self._bash.write_file(path, content)

    def add_files(self, files: Mapping[str, bytes]) -> list[str]:
        """Put files as bytes into the sandbox (a person's uploads), creating directories; they
        are part of the next capture, so they rewind and fork with the session.

        A file that does not fit is not written, and its path is returned: one over bashkit's
        per-file limit, one that would take the state over ``max_state_bytes`` (the capture
        would then be dropped, and with it every file of the message, after the model was
        told where they are), or one bashkit's filesystem refuses (its own total limit). The
        others are written; nothing raises, so an upload never fails the turn."""
        self._dirty = True
        fs = self._bash.fs()
        room = self.limits.max_state_bytes - self.state_bytes()
        refused: list[str] = []
        for path, content in files.items():
            if len(content) > min(room, BASHKIT_MAX_FILE_BYTES):
                refused.append(path)
                continue
            try:
                parent = path.rsplit("/", 1)[0]
                if parent:
                    self._bash.mkdir(parent, recursive=True)
                fs.write_file(path, content)
            except (bashkit.BashError, RuntimeError, ValueError) as exc:
                log.warning("sandbox: %s not written: %s", path, exc)
                refused.append(path)
                continue
            room -= len(content)
        return refused

    def read_file(self, path: str) -> str:
        return self._bash.read_file(path)

    # -- capturing ----------------------------------------------------------------------------

    async def capture(self) -> Captured | None:
        """The state to store, or None when nothing that matters changed since opening (or
        the state is over ``max_state_bytes``: it is then not kept).

        Runs in a worker thread: a commit, hashing and encoding take milliseconds. The sandbox
        then takes the captured state as its new baseline.
        """
        if not self._dirty:
            return None
        async with self._lock:
            await self._settle()
            return await asyncio.to_thread(self._capture)

    def _capture(self) -> Captured | None:
        base = self._base
        size = self.state_bytes()
        if size > self.limits.max_state_bytes:
            # Not kept: the message gets no snapshot, so the next turn restores the last state
            # that was stored. The model was told after the command that went over.
            log.warning(
                "sandbox state of %s bytes is over its limit of %s; not kept",
                size,
                self.limits.max_state_bytes,
            )
            self._dirty = False
            return None
        packed = self._bash.commit(have=list(base.objects))
        emitted = {k: bytes(v) for k, v in packed.objects.items()}
        decoded_new: dict[str, bytes | None] = {
            k: decode_envelope(k, v) for k, v in emitted.items() if k not in base.objects
        }
        envelopes = dict(base.objects)
        for digest, decoded in decoded_new.items():
            original = emitted[digest]
            # bashkit's bytes serve as they are when opaque or already stored (no copy of a
            # big incompressible file); deflated ones are kept inflated for faster deltas.
            if decoded is None or original[0] == STORED:
                envelopes[digest] = original
            else:
                envelopes[digest] = bytes([STORED]) + decoded
        head = json_object(decoded_new.get(packed.id) or base.decoded(packed.id))
        tree = str(head.get("tree")) if head else None
        shell_id = str(head.get("shell")) if head else packed.id
        shell = json_object(
            decoded_new.get(shell_id) if shell_id in decoded_new else base.decoded(shell_id)
        )
        self._dirty = False
        if (
            base.commit is not None
            and tree is not None
            and tree == base.tree
            and shell_key(shell, shell_id) == base.shell_key
        ):
            return None

        closure = set(bashkit.SnapshotGraph.reachable(packed.id, envelopes))
        captured, self._base = encode_capture(
            base, packed.id, envelopes, emitted, decoded_new, closure
        )
        self._base.tree = tree
        self._base.shell_key = shell_key(shell, shell_id)
        return captured


def _head(commit: str, objects: Mapping[str, bytes]) -> tuple[str, str | None, str]:
    """A state's commit, its tree and its shell's key: what a capture is compared with."""
    head = json_object(decode_envelope(commit, objects[commit]))
    tree = str(head.get("tree")) if head else None
    shell_id = str(head.get("shell")) if head else commit
    shell_data = objects.get(shell_id)
    shell = json_object(decode_envelope(shell_id, shell_data)) if shell_data is not None else None
    return commit, tree, shell_key(shell, shell_id)


@functools.lru_cache(maxsize=8)
def _empty_head(limits: SandboxLimits) -> tuple[str, str | None, str]:
    """``_head`` of an empty shell of these limits (``Sandbox.new``): every session's first
    turn opens one, and decoding and verifying its objects again each time cost about 50 µs
    of it (docs/benchmarks.md, fourteenth pass)."""
    packed = Sandbox(limits)._bash.commit()
    return _head(packed.id, {k: bytes(v) for k, v in packed.objects.items()})

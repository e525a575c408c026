"""The agent's shell: one bashkit sandbox per session, and its state as content-addressed objects.

Isolation is bashkit's: a virtual filesystem (no host directory is mounted), no network (no
allowlist is configured, so ``curl``/``wget`` refuse), no embedded Python or SQLite, and limits
per run on commands, loop iterations, wall time and the memory of shell variables. bashkit's
filesystem has fixed limits of its own (``BASHKIT_MAX_FS_BYTES`` and the like) that its Python
binding does not let us lower, so what a snapshot may capture is limited here
(``SandboxLimits.max_state_bytes``). Output is capped here as well, so one command cannot flood a
model's context, and NUL characters are replaced (PostgreSQL's JSONB cannot store them).
docs/reliability.md (section *Sandbox*) lists the escape and exhaustion attempts this was tried
against and what each one did.

State is bashkit's snapshot object graph (``Bash.commit``): a commit names a filesystem tree and a
shell state, a tree names file objects, files name content-defined chunks; every object's id is
the SHA-256 of its decoded bytes. That graph is already what a small change needs (an edit
re-emits one chunk, one file object, the tree, the shell and the commit), so storage works per
object (``core.storage.snapshots``), and this module decides how each new object is encoded:

- ``bashkit``: bashkit's own bytes (a one-byte envelope, 0 = stored, 1 = raw deflate);
- ``zstd``: zstd of the decoded object;
- ``zstd-delta``: zstd of the decoded object with a self-contained stored object as its
  dictionary, the object it replaced (or that object's own base). An edited chunk or a new tree
  then costs about the size of the edit instead of the size of the chunk or the tree.

The smallest wins, per object (zstd also when within 3 % of deflate: it decodes twice as fast).
Measured on the benchmark's workspace (1.09 MB of source in 60 files, 166 objects, 443,851
bytes as bashkit encodes them): zstd on top of bashkit's bytes saves nothing at any level (they
are deflated already); zstd of the decoded objects saves 0.2 % at level 3, 1.8 % at level 9 and
3.2 % at level 19, and restores faster; deltas bring a one-line edit from a median 9.1 KB of new
objects to 0.7 KB. A delta's base is always self-contained, so decoding needs at most one other
object: no chain is ever replayed.

The envelope is how bashkit 0.20 stores an object, and its id is the hash of the decoded bytes;
both are checked for every object before it is transcoded (an object that does not match is
stored verbatim as ``bashkit``), and bashkit re-checks every hash on checkout.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import bashkit
import zstandard

log = logging.getLogger(__name__)

CODEC_BASHKIT: Final = "bashkit"
CODEC_ZSTD: Final = "zstd"
CODEC_ZSTD_DELTA: Final = "zstd-delta"

_STORED: Final = 0
_DEFLATED: Final = 1
# A delta is kept only if it is at most this fraction of the object's self-contained size:
# deltas against one base grow with every edit, and a fresh base resets them.
DELTA_RATIO: Final = 0.25
# zstd is kept over bashkit's deflate when no more than this much bigger: it decodes more than
# twice as fast, and restoring is on a turn's critical path.
ZSTD_TOLERANCE: Final = 1.03
# How many replaced objects of the same kind are tried as dictionaries for one new object.
DELTA_CANDIDATES: Final = 4
# zstd levels: high where the bytes are few (a turn's changes), fast for bulk (a new workspace).
_SMALL_CAPTURE_BYTES: Final = 64 * 1024
_LEVEL_SMALL, _LEVEL_BULK, _LEVEL_DELTA = 9, 3, 19
# Shell-state fields bashkit resets or rewrites on every command: a change to only these is not
# a change of the sandbox worth a snapshot.
_TRANSIENT_SHELL_KEYS: Final = ("last_exit_code", "last_bg_pid", "traps")
_TRANSIENT_ARRAYS: Final = ("PIPESTATUS",)
_TRANSIENT_VARIABLES: Final = ("_",)


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


@dataclass(frozen=True)
class StoredObject:
    """One ``snapshot_contents`` row as read back, with its base row when it is a delta."""

    digest: str
    codec: str
    data: bytes
    base: StoredObject | None = None


@dataclass(frozen=True)
class SetRef:
    """A content-addressed set of object digests; ``id`` once it is known to be stored."""

    digest: str
    members: frozenset[str]
    id: int | None = None


@dataclass(frozen=True)
class SandboxState:
    """Everything needed to restore one message's sandbox (what ``load_state`` returns)."""

    message_id: str
    commit: str
    objects: tuple[StoredObject, ...]
    base_set: SetRef


@dataclass(frozen=True)
class NewObject:
    """A ``snapshot_contents`` row to write."""

    digest: str
    codec: str
    data: bytes
    raw_size: int
    base_digest: str | None = None


@dataclass(frozen=True)
class Captured:
    """A sandbox state ready to store: its new objects and the two sets that name all of it."""

    commit: str
    objects: tuple[NewObject, ...]
    base_set: SetRef
    delta_set: SetRef | None
    raw_size: int


def set_digest(members: Iterable[str]) -> str:
    """The id of a set: a hash of its sorted members, so equal sets are stored once."""
    h = hashlib.sha256(b"slack-agent snapshot set\n")
    for digest in sorted(members):
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def _decode_envelope(digest: str, data: bytes, *, verify: bool = True) -> bytes | None:
    """The decoded object, or None when the bytes are not an envelope we understand."""
    if not data:
        return None
    if data[0] == _STORED:
        decoded = data[1:]
    elif data[0] == _DEFLATED:
        try:
            decoded = zlib.decompress(data[1:], -15)
        except zlib.error:
            return None
    else:
        return None
    if verify and hashlib.sha256(decoded).hexdigest() != digest:
        return None
    return decoded


_DECOMPRESSOR: Final = zstandard.ZstdDecompressor()


def _raw_dict(data: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(data, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def _decode_stored(
    obj: StoredObject, bases: dict[str, bytes | None] | None = None
) -> tuple[bytes, bytes | None]:
    """(bytes to hand to bashkit, decoded object or None when opaque).

    Hashes are not checked here: bashkit checks every object's hash on checkout. bashkit's own
    (deflated) bytes are inflated here all the same: Python's zlib is faster than bashkit's
    inflate on checkout. ``bases`` caches decoded bases, which several deltas may share.
    """
    if obj.codec == CODEC_BASHKIT:
        decoded = _decode_envelope(obj.digest, obj.data, verify=False)
        if decoded is None or obj.data[0] == _STORED:  # no second copy of stored bytes
            return obj.data, decoded
        return bytes([_STORED]) + decoded, decoded
    if obj.codec == CODEC_ZSTD:
        decoded = _DECOMPRESSOR.decompress(obj.data)
    elif obj.codec == CODEC_ZSTD_DELTA:
        if obj.base is None:
            raise ValueError(f"snapshot object {obj.digest} is a delta without its base")
        base = _decoded_base(obj.base, {} if bases is None else bases)
        if base is None:
            raise ValueError(f"snapshot object {obj.digest} has an undecodable base")
        decoded = zstandard.ZstdDecompressor(dict_data=_raw_dict(base)).decompress(obj.data)
    else:
        raise ValueError(f"snapshot object {obj.digest} has unknown codec {obj.codec!r}")
    return bytes([_STORED]) + decoded, decoded


def _decoded_base(base: StoredObject, bases: dict[str, bytes | None]) -> bytes | None:
    if base.digest not in bases:
        if base.codec == CODEC_ZSTD_DELTA:
            raise ValueError(f"snapshot object {base.digest} is a delta used as a base")
        if base.codec == CODEC_BASHKIT:
            bases[base.digest] = _decode_envelope(base.digest, base.data, verify=False)
        else:
            bases[base.digest] = _decode_stored(base)[1]
    return bases[base.digest]


def _json_object(decoded: bytes | None) -> dict[str, Any] | None:
    if decoded is None or len(decoded) < 2:
        return None
    try:
        value = json.loads(decoded[1:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _shell_key(shell: dict[str, Any] | None, shell_id: str) -> str:
    """What identifies a shell state for "did the sandbox change", minus per-command noise."""
    if shell is None:
        return shell_id
    kept = {k: v for k, v in shell.items() if k not in _TRANSIENT_SHELL_KEYS}
    for name, drop in (("arrays", _TRANSIENT_ARRAYS), ("variables", _TRANSIENT_VARIABLES)):
        if isinstance(kept.get(name), dict):
            kept[name] = {k: v for k, v in kept[name].items() if k not in drop}
    return json.dumps(kept, sort_keys=True)


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


@dataclass
class _Baseline:
    """What the last restored or captured state was; captures are diffed against it.

    ``objects`` are the state's objects as bashkit accepts them (decoded where possible);
    ``anchors`` maps a stored object to the self-contained object a delta of it may use as its
    dictionary (itself, or its own base), and ``anchor_data`` holds those bases' decoded bytes.
    """

    objects: dict[str, bytes] = field(default_factory=dict)
    anchors: dict[str, str] = field(default_factory=dict)
    anchor_data: dict[str, bytes] = field(default_factory=dict)
    base_set: SetRef | None = None
    commit: str | None = None
    tree: str | None = None
    shell_key: str | None = None

    def decoded(self, digest: str) -> bytes | None:
        data = self.objects.get(digest)
        if data is not None:
            return _decode_envelope(digest, data, verify=False)
        return self.anchor_data.get(digest)


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
        self._base = _Baseline()
        self.message_id: str | None = None

    # -- opening ------------------------------------------------------------------------------

    @property
    def _bash(self) -> bashkit.Bash:
        """The shell, made on first use: most turns of a conversation never run a command,
        and making one (about 2 ms, holding the GIL) was a tenth of a turn's CPU time."""
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
        commit, objects = _empty_commit(sandbox.limits)
        sandbox._note_head(commit, objects)
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
            envelope, _ = _decode_stored(obj, bases)
            objects[obj.digest] = envelope
            anchors[obj.digest] = obj.digest if obj.base is None else obj.base.digest
        anchor_data = {d: data for d, data in bases.items() if data is not None}
        sandbox._checkout(sandbox._bash, state.commit, objects)
        sandbox._base = _Baseline(objects=objects, anchors=anchors, anchor_data=anchor_data)
        sandbox._base.base_set = state.base_set
        sandbox._note_head(state.commit, objects)
        sandbox.message_id = state.message_id
        return sandbox

    @classmethod
    async def open(cls, state: SandboxState | None, limits: SandboxLimits | None = None) -> Sandbox:
        """``from_state`` off the event loop (decoding and checkout take a few milliseconds);
        an empty one in place, where there is nothing to decode."""
        if state is None:
            return cls.new(limits)
        return await asyncio.to_thread(cls.from_state, state, limits)

    def _note_head(self, commit: str, objects: Mapping[str, bytes]) -> None:
        head = _json_object(_decode_envelope(commit, objects[commit]))
        tree = str(head.get("tree")) if head else None
        shell_id = str(head.get("shell")) if head else commit
        shell_data = objects.get(shell_id)
        shell = (
            _json_object(_decode_envelope(shell_id, shell_data)) if shell_data is not None else None
        )
        self._base.commit = commit
        self._base.tree = tree
        self._base.shell_key = _shell_key(shell, shell_id)

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

        A walk of bashkit's filesystem (about 3 ms per thousand entries) and of its shell state,
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

    def add_files(self, files: Mapping[str, bytes]) -> None:
        """Put files as bytes into the sandbox (a person's uploads), creating directories; they
        are part of the next capture, so they rewind and fork with the session."""
        self._dirty = True
        fs = self._bash.fs()
        for path, content in files.items():
            parent = path.rsplit("/", 1)[0]
            if parent:
                self._bash.mkdir(parent, recursive=True)
            fs.write_file(path, content)

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
            k: _decode_envelope(k, v) for k, v in emitted.items() if k not in base.objects
        }
        envelopes = dict(base.objects)
        for digest, decoded in decoded_new.items():
            original = emitted[digest]
            # bashkit's bytes serve as they are when opaque or already stored (no copy of a
            # big incompressible file); deflated ones are kept inflated for faster deltas.
            if decoded is None or original[0] == _STORED:
                envelopes[digest] = original
            else:
                envelopes[digest] = bytes([_STORED]) + decoded
        head = _json_object(decoded_new.get(packed.id) or base.decoded(packed.id))
        tree = str(head.get("tree")) if head else None
        shell_id = str(head.get("shell")) if head else packed.id
        shell = _json_object(
            decoded_new.get(shell_id) if shell_id in decoded_new else base.decoded(shell_id)
        )
        self._dirty = False
        if (
            base.commit is not None
            and tree is not None
            and tree == base.tree
            and _shell_key(shell, shell_id) == base.shell_key
        ):
            return None

        closure = set(bashkit.SnapshotGraph.reachable(packed.id, envelopes))
        dead = [d for d in base.objects if d not in closure]
        fresh = [d for d in closure if d not in base.objects]
        bulk = sum(len(envelopes[d]) for d in fresh) > _SMALL_CAPTURE_BYTES
        level = _LEVEL_BULK if bulk else _LEVEL_SMALL

        # Replaced objects by kind, as delta dictionaries (only self-contained ones qualify).
        by_kind: dict[int, list[tuple[str, bytes]]] = {}
        for digest in dead:
            anchor = base.anchors.get(digest)
            data = base.decoded(anchor) if anchor is not None else None
            if anchor is not None and data:
                kind_of = base.decoded(digest) or data
                by_kind.setdefault(kind_of[0], []).append((anchor, data))

        rows: list[NewObject] = []
        anchors = {d: a for d, a in base.anchors.items() if d in closure}
        anchor_data: dict[str, bytes] = {}
        for digest in sorted(fresh):
            decoded = decoded_new.get(digest)
            original = emitted[digest]
            if decoded is None:
                rows.append(NewObject(digest, CODEC_BASHKIT, original, len(original)))
                continue
            candidates = sorted(
                by_kind.get(decoded[0], []), key=lambda c: abs(len(c[1]) - len(decoded))
            )
            row, dictionary = _encode(digest, decoded, original, candidates, level)
            rows.append(row)
            if dictionary is None:
                anchors[digest] = digest
            else:
                anchors[digest] = dictionary[0]
                anchor_data[dictionary[0]] = dictionary[1]

        base_set = base.base_set
        if base_set is None or len(closure - base_set.members) > _delta_limit(base_set):
            members = frozenset(closure)
            base_set = SetRef(set_digest(members), members)
        extra = frozenset(closure - base_set.members)
        delta_set = SetRef(set_digest(extra), extra) if extra else None

        objects = {d: envelopes[d] for d in closure}
        for digest, anchor in anchors.items():
            if anchor != digest and anchor not in anchor_data:
                kept = base.anchor_data.get(anchor) or base.decoded(anchor)
                if kept is not None:
                    anchor_data[anchor] = kept
        self._base = _Baseline(
            objects=objects,
            anchors=anchors,
            anchor_data=anchor_data,
            base_set=base_set,
        )
        self._base.commit = packed.id
        self._base.tree = tree
        self._base.shell_key = _shell_key(shell, shell_id)
        raw_size = sum(
            len(v) - 1 if v[:1] == bytes([_STORED]) else len(v) for v in objects.values()
        )
        return Captured(packed.id, tuple(rows), base_set, delta_set, raw_size)


@functools.lru_cache(maxsize=8)
def _empty_commit(limits: SandboxLimits) -> tuple[str, dict[str, bytes]]:
    """The commit of an empty shell of these limits and its objects (``Sandbox.new``)."""
    packed = Sandbox(limits)._bash.commit()
    return packed.id, {k: bytes(v) for k, v in packed.objects.items()}


def _encode(
    digest: str,
    decoded: bytes,
    original: bytes,
    candidates: Sequence[tuple[str, bytes]],
    level: int,
) -> tuple[NewObject, tuple[str, bytes] | None]:
    """The smallest row for a new object, and the (digest, bytes) of its dictionary if a delta.

    Deltas are tried first: against a good dictionary one costs a fraction of a millisecond and
    makes the self-contained encoding moot (bashkit's own size stands in for it).
    """
    delta: NewObject | None = None
    dictionary: tuple[str, bytes] | None = None
    tried: set[str] = set()
    for base_digest, base_data in candidates:
        if base_digest in tried or len(tried) >= DELTA_CANDIDATES:
            continue
        tried.add(base_digest)
        packed = zstandard.ZstdCompressor(
            level=_LEVEL_DELTA, dict_data=_raw_dict(base_data)
        ).compress(decoded)
        if delta is None or len(packed) < len(delta.data):
            delta = NewObject(digest, CODEC_ZSTD_DELTA, packed, len(decoded), base_digest)
            dictionary = (base_digest, base_data)
    if delta is not None and len(delta.data) <= DELTA_RATIO * len(original):
        return delta, dictionary
    best = NewObject(digest, CODEC_BASHKIT, original, len(decoded))
    packed = zstandard.ZstdCompressor(level=level).compress(decoded)
    if len(packed) <= len(original) * ZSTD_TOLERANCE:
        best = NewObject(digest, CODEC_ZSTD, packed, len(decoded))
    if delta is not None and len(delta.data) <= DELTA_RATIO * len(best.data):
        return delta, dictionary
    return best, None


def _delta_limit(base_set: SetRef) -> int:
    """How many objects outside the base a snapshot may name before it starts a new base.

    A message adds about ``len(delta set)`` references and a new base costs ``len(base)``
    once; rebasing at about twice the square root keeps their sum per message near its minimum.
    """
    return max(16, 2 * math.isqrt(len(base_set.members)))

"""A sandbox's state as content-addressed objects, and how each new object is encoded.

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
On source-like workspaces zstd on top of bashkit's bytes saves nothing (they are deflated
already), zstd of the decoded objects saves a little and restores faster, and deltas bring a
one-line edit's new objects down by an order of magnitude (docs/benchmarks.md, *Figures behind
choices in the code*). A delta's base is always self-contained, so decoding needs at most one
other object: no chain is ever replayed.

The envelope is how bashkit 0.20 stores an object, and its id is the hash of the decoded bytes;
both are checked for every object before it is transcoded (an object that does not match is
stored verbatim as ``bashkit``), and bashkit re-checks every hash on checkout.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import zstandard

CODEC_BASHKIT: Final = "bashkit"
CODEC_ZSTD: Final = "zstd"
CODEC_ZSTD_DELTA: Final = "zstd-delta"

STORED: Final = 0
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
SMALL_CAPTURE_BYTES: Final = 64 * 1024
LEVEL_SMALL, LEVEL_BULK, _LEVEL_DELTA = 9, 3, 19
# Shell-state fields bashkit resets or rewrites on every command: a change to only these is not
# a change of the sandbox worth a snapshot.
_TRANSIENT_SHELL_KEYS: Final = ("last_exit_code", "last_bg_pid", "traps")
_TRANSIENT_ARRAYS: Final = ("PIPESTATUS",)
_TRANSIENT_VARIABLES: Final = ("_",)


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


def decode_envelope(digest: str, data: bytes, *, verify: bool = True) -> bytes | None:
    """The decoded object, or None when the bytes are not an envelope we understand."""
    if not data:
        return None
    if data[0] == STORED:
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


# One decompressor per thread: python-zstandard's are not thread-safe, and snapshots are
# restored in worker threads (``Sandbox.from_state``), several at once. A shared one corrupted
# frames and crashed a soak replica (SIGSEGV) when two turns restored at the same moment.
_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    found: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def _raw_dict(data: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(data, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def decode_stored(
    obj: StoredObject, bases: dict[str, bytes | None] | None = None
) -> tuple[bytes, bytes | None]:
    """(bytes to hand to bashkit, decoded object or None when opaque).

    Hashes are not checked here: bashkit checks every object's hash on checkout. bashkit's own
    (deflated) bytes are inflated here all the same: Python's zlib is faster than bashkit's
    inflate on checkout. ``bases`` caches decoded bases, which several deltas may share.
    """
    if obj.codec == CODEC_BASHKIT:
        decoded = decode_envelope(obj.digest, obj.data, verify=False)
        if decoded is None or obj.data[0] == STORED:  # no second copy of stored bytes
            return obj.data, decoded
        return bytes([STORED]) + decoded, decoded
    if obj.codec == CODEC_ZSTD:
        decoded = _decompressor().decompress(obj.data)
    elif obj.codec == CODEC_ZSTD_DELTA:
        if obj.base is None:
            raise ValueError(f"snapshot object {obj.digest} is a delta without its base")
        base = _decoded_base(obj.base, {} if bases is None else bases)
        if base is None:
            raise ValueError(f"snapshot object {obj.digest} has an undecodable base")
        decoded = zstandard.ZstdDecompressor(dict_data=_raw_dict(base)).decompress(obj.data)
    else:
        raise ValueError(f"snapshot object {obj.digest} has unknown codec {obj.codec!r}")
    return bytes([STORED]) + decoded, decoded


def _decoded_base(base: StoredObject, bases: dict[str, bytes | None]) -> bytes | None:
    if base.digest not in bases:
        if base.codec == CODEC_ZSTD_DELTA:
            raise ValueError(f"snapshot object {base.digest} is a delta used as a base")
        if base.codec == CODEC_BASHKIT:
            bases[base.digest] = decode_envelope(base.digest, base.data, verify=False)
        else:
            bases[base.digest] = decode_stored(base)[1]
    return bases[base.digest]


def json_object(decoded: bytes | None) -> dict[str, Any] | None:
    if decoded is None or len(decoded) < 2:
        return None
    try:
        value = json.loads(decoded[1:])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def shell_key(shell: dict[str, Any] | None, shell_id: str) -> str:
    """What identifies a shell state for "did the sandbox change", minus per-command noise."""
    if shell is None:
        return shell_id
    kept = {k: v for k, v in shell.items() if k not in _TRANSIENT_SHELL_KEYS}
    for name, drop in (("arrays", _TRANSIENT_ARRAYS), ("variables", _TRANSIENT_VARIABLES)):
        if isinstance(kept.get(name), dict):
            kept[name] = {k: v for k, v in kept[name].items() if k not in drop}
    return json.dumps(kept, sort_keys=True)


@dataclass
class Baseline:
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

    def note_head(self, commit: str, tree: str | None, shell_key: str) -> None:
        """The state's head as ``core.sandbox.shell._head`` works it out."""
        self.commit, self.tree, self.shell_key = commit, tree, shell_key

    def decoded(self, digest: str) -> bytes | None:
        data = self.objects.get(digest)
        if data is not None:
            return decode_envelope(digest, data, verify=False)
        return self.anchor_data.get(digest)


def encode_capture(
    base: Baseline,
    commit: str,
    envelopes: dict[str, bytes],
    emitted: dict[str, bytes],
    decoded_new: dict[str, bytes | None],
    closure: set[str],
) -> tuple[Captured, Baseline]:
    """A captured state's new rows and sets, diffed against ``base``, and the new baseline.

    ``closure`` is every object the commit reaches, ``emitted`` what bashkit handed over (new
    objects among them, ``decoded_new`` those decoded where possible) and ``envelopes`` every
    reachable object as bashkit accepts it. The caller fills in the baseline's tree and shell
    key, which it read from the commit.
    """
    dead = [d for d in base.objects if d not in closure]
    fresh = [d for d in closure if d not in base.objects]
    bulk = sum(len(envelopes[d]) for d in fresh) > SMALL_CAPTURE_BYTES
    level = LEVEL_BULK if bulk else LEVEL_SMALL

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
        row, dictionary = encode(digest, decoded, original, candidates, level)
        rows.append(row)
        if dictionary is None:
            anchors[digest] = digest
        else:
            anchors[digest] = dictionary[0]
            anchor_data[dictionary[0]] = dictionary[1]

    base_set = base.base_set
    if base_set is None or len(closure - base_set.members) > delta_limit(base_set):
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
    baseline = Baseline(
        objects=objects, anchors=anchors, anchor_data=anchor_data, base_set=base_set, commit=commit
    )
    raw_size = sum(len(v) - 1 if v[:1] == bytes([STORED]) else len(v) for v in objects.values())
    return Captured(commit, tuple(rows), base_set, delta_set, raw_size), baseline


def encode(
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


def delta_limit(base_set: SetRef) -> int:
    """How many objects outside the base a snapshot may name before it starts a new base.

    A message adds about ``len(delta set)`` references and a new base costs ``len(base)``
    once; rebasing at about twice the square root keeps their sum per message near its minimum.
    """
    return max(16, 2 * math.isqrt(len(base_set.members)))

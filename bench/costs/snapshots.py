"""Snapshot measurements for ``slack-agent bench``: bytes per message, store, restore.

The workload is the one the issue sets: a sandbox workspace of about 1 MB (60 source-like files
in 4 directories, generated from a fixed seed so every run stores the same bytes) and one
message per one-file change (a line edited with ``sed``, a different file each time), each
going through the real path: a turn (``SessionStore.start_turn`` / ``finish``), the command
in the sandbox, ``Sandbox.capture``, ``store_content`` and ``attach_snapshot``.

- ``snapshot_bytes_per_message``: growth of the snapshot tables' logical bytes (every content,
  set, membership and snapshot row, fixed-width columns counted as 8 bytes; see
  ``core.storage.snapshots.stored_bytes``) over the edits, divided by their number. The first
  message, which brings the whole workspace, is excluded (``snapshot_initial_bytes``), and the
  run is long enough to include new base sets, whose cost is spread over the messages.
- ``snapshot_disk_bytes_per_message``: the same growth measured in database pages (indexes,
  row headers and free space included), where the database can tell.
- ``snapshot_store``: capture + ``store_content`` + attaching the row (as its own transaction,
  so slightly more than the row costs inside ``finish``): what snapshotting adds to a turn.
- ``snapshot_restore``: ``load_state`` (one query) + ``Sandbox.from_state`` (decode and
  checkout) for a message picked at random among those stored.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from bench.common import summarize
from core.messages import assistant_message, user_message
from core.records import Actor
from core.sandbox.shell import Sandbox
from core.storage import snapshots
from core.storage.engine import Database
from core.storage.sessions import SessionStore

WORKSPACE_FILES = 60
WORKSPACE_DIRS = 4


def workspace(seed: int = 11) -> dict[str, str]:
    """About 1 MB of Python-like source in ``/home/user/project``: text that compresses the
    way real code does (about 2.5x), not a repeated pattern that flatters compression."""
    rng = random.Random(seed)
    idents = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12)))
        for _ in range(600)
    ]

    def source(size: int) -> str:
        out: list[str] = []
        total = 0
        while total < size:
            name, args = rng.choice(idents), ", ".join(rng.sample(idents, rng.randint(0, 3)))
            lines = [
                f"def {name}_{rng.randint(0, 999)}({args}):",
                f'    """{" ".join(rng.sample(idents, rng.randint(3, 9)))}."""',
            ]
            for _ in range(rng.randint(2, 8)):
                a, b, c = rng.sample(idents, 3)
                lines.append(
                    rng.choice(
                        [
                            f"    {a} = {b}.{c}({rng.randint(0, 100)})",
                            f"    if {a} > {rng.randint(0, 50)}:\n        return {b}",
                            f"    for {a} in {b}:\n        {c}.append({a})",
                            f"    {a} += {b}",
                        ]
                    )
                )
            lines.append(f"    return {rng.choice(idents)}\n\n")
            block = "\n".join(lines)
            out.append(block)
            total += len(block)
        return "".join(out)[:size]

    per_dir = WORKSPACE_FILES // WORKSPACE_DIRS
    return {
        f"/home/user/project/pkg{d}/module{f}.py": source(rng.randint(8_000, 26_000))
        for d in range(WORKSPACE_DIRS)
        for f in range(per_dir)
    }


async def _turn(
    store: SessionStore, db: Database, session_id: int, sandbox: Sandbox, command: str
) -> tuple[str, float]:
    """One turn that runs ``command``; returns the assistant message id and the seconds the
    snapshot (capture, store, attach) took."""
    tail = await store.tail(session_id)
    lease = await store.start_turn(
        session_id,
        user_message=user_message(f"please run {command}"),
        last_message_id=tail.message_id if tail else None,
    )
    result = await sandbox.run(command)
    if result.exit_code != 0:
        raise RuntimeError(f"bench command failed: {command}: {result.stderr}")
    answer = assistant_message("done")
    started = time.perf_counter()
    captured = await sandbox.capture()
    ref = None if captured is None else await snapshots.store_content(db, captured)
    await store.finish(lease, [answer], snapshot=ref)  # the answer and its snapshot, together
    return answer["id"], time.perf_counter() - started


async def _totals(db: Database) -> tuple[int, int | None]:
    async with db.read() as conn:
        return await snapshots.stored_bytes(conn), await snapshots.disk_bytes(conn)


async def bench_snapshots(db: Database, *, quick: bool) -> dict[str, Any]:
    """The snapshot keys of the benchmark (module docstring); the sessions it makes are
    deleted afterwards (their content goes with the sweeper's next pass after the grace)."""
    edits = 24 if quick else 60
    restores = 20 if quick else 100
    store = SessionStore(db)
    session, _ = await store.get_or_create_session(
        "bench", f"snapshots/{uuid.uuid4()}", user_id=None
    )
    try:
        files = workspace()
        sandbox = Sandbox.new()
        sandbox.write_files(files)
        before_bytes, before_disk = await _totals(db)
        first, _ = await _turn(
            store, db, session.id, sandbox, "ls -R /home/user/project > /dev/null"
        )
        initial_bytes, initial_disk = await _totals(db)
        paths = sorted(files)
        stored_ids = [first]
        store_seconds: list[float] = []
        for i in range(edits):
            path = paths[(i * 7) % len(paths)]
            command = f"sed -i '{20 + i}s/$/  # edited in message {i}/' {path}"
            message_id, seconds = await _turn(store, db, session.id, sandbox, command)
            stored_ids.append(message_id)
            store_seconds.append(seconds)
        after_bytes, after_disk = await _totals(db)

        rng = random.Random(5)
        restore_seconds: list[float] = []
        for _ in range(restores):
            target = rng.choice(stored_ids)
            started = time.perf_counter()
            state = await snapshots.load_state(db, session.id, at_message_id=target)
            restored = Sandbox.from_state(state)
            restore_seconds.append(time.perf_counter() - started)
            if restored.message_id != target:
                raise RuntimeError(f"restored {restored.message_id}, wanted {target}")

        result: dict[str, Any] = {
            "snapshot_bytes_per_message": round((after_bytes - initial_bytes) / edits),
            "snapshot_initial_bytes": initial_bytes - before_bytes,
            "snapshot_workspace_bytes": sum(len(text.encode()) for text in files.values()),
            "snapshot_store": summarize(store_seconds),
            "snapshot_restore": summarize(restore_seconds),
        }
        if after_disk is not None and initial_disk is not None and before_disk is not None:
            result["snapshot_disk_bytes_per_message"] = round((after_disk - initial_disk) / edits)
        return result
    finally:
        await store.delete_session(session.id, Actor(user_id=None, admin=True))

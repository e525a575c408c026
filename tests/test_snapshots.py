"""Per-message sandbox snapshots on both databases: identity, dedupe, forks,
one-read restore, garbage collection and truncation."""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event, func, select, text, update

from core.errors import DatabaseError
from core.messages import assistant_message, user_message
from core.records import Actor
from core.sandbox.shell import Sandbox
from core.storage import snapshots
from core.storage.dialect import ago
from core.storage.engine import Database
from core.storage.retention import RetentionPolicy
from core.storage.sessions import SessionStore
from core.storage.sweeper import sweep
from standins.processes import child_environment
from tests.helpers import ROOT, add_exchange, new_session

OFF = RetentionPolicy(max_idle_days=0, max_per_user=0)
CONTENTS = snapshots.CONTENTS
SETS = snapshots.SETS
MEMBERS = snapshots.MEMBERS
SNAPSHOTS = snapshots.SNAPSHOTS


def noise(size: int, seed: int) -> str:
    """Text that does not compress: a file whose bytes are obvious in storage totals."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(size))


async def turn(
    store: SessionStore,
    db: Database,
    session_id: int,
    sandbox: Sandbox,
    command: str | None = None,
    files: dict[str, str] | None = None,
    between: Callable[[], Awaitable[Any]] | None = None,
) -> str:
    """A whole turn whose snapshot is stored and attached; returns the assistant message id.

    ``between`` runs after the content is stored and before the snapshot row is attached.
    """
    tail = await store.tail(session_id)
    lease = await store.start_turn(
        session_id,
        user_message=user_message(command or "files"),
        last_message_id=tail.message_id if tail else None,
    )
    if files:
        sandbox.write_files(files)
    if command:
        result = await sandbox.run(command)
        assert result.exit_code == 0, result.stderr
    captured = await sandbox.capture()
    ref = None if captured is None else await snapshots.store_content(db, captured)
    if between is not None:
        await between()
    answer = assistant_message("done")
    await store.finish(lease, [answer])
    if ref is not None:
        async with db.write() as conn:
            await snapshots.attach_snapshot(
                conn, session_id=session_id, message_id=answer["id"], ref=ref
            )
    return str(answer["id"])


async def restore(db: Database, session_id: int, at: str | None = None) -> Sandbox:
    state = await snapshots.load_state(db, session_id, at_message_id=at)
    return Sandbox.from_state(state)


async def listing(sandbox: Sandbox, root: str = "/home/user") -> dict[str, str]:
    """Every file under ``root`` with its exact contents."""
    found = await sandbox.run(f"find {root} -type f")
    return {path: sandbox.read_file(path) for path in sorted(found.stdout.split())}


async def stored(db: Database) -> int:
    async with db.read() as conn:
        return await snapshots.stored_bytes(conn)


async def count(db: Database, table: Any) -> int:
    async with db.read() as conn:
        return int(await conn.scalar(select(func.count()).select_from(table)))


async def snapshot_messages(db: Database, session_id: int) -> set[str]:
    async with db.read() as conn:
        rows = await conn.execute(
            select(SNAPSHOTS.c.message_id).where(SNAPSHOTS.c.session_id == session_id)
        )
        return set(rows.scalars())


async def age_everything(db: Database, seconds: float = 7200) -> None:
    async with db.write() as conn:
        await conn.execute(update(CONTENTS).values(created_at=ago(seconds)))
        await conn.execute(update(SETS).values(created_at=ago(seconds)))


@contextlib.contextmanager
def statements(db: Database) -> Iterator[list[str]]:
    """Every statement sent to the database (transaction control left out)."""
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.strip().upper() not in {"BEGIN", "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"}:
            seen.append(statement)

    event.listen(db.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", before)


# -- identity ---------------------------------------------------------------------------------


async def test_restore__an_earlier_message_brings_back_its_exact_files_and_shell(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    sandbox = Sandbox.new()
    first_files = {
        "/home/user/w/notes.md": "# Notes\n\nünïcödé ✓ and tabs\t\n",
        "/home/user/w/data.txt": noise(40_000, 1),
        "/home/user/w/sub/empty.txt": "",
    }
    first = await turn(
        store, db, session.id, sandbox, "cd /home/user/w && export STAGE=one", first_files
    )
    second = await turn(
        store,
        db,
        session.id,
        sandbox,
        "echo changed >> notes.md && rm data.txt && echo new > added.txt && export STAGE=two",
    )
    assert await listing(sandbox) != first_files

    earlier = await restore(db, session.id, at=first)
    assert earlier.message_id == first
    assert await listing(earlier) == first_files
    shell = await earlier.run('pwd; echo "$STAGE"')
    assert shell.stdout == "/home/user/w\none\n"

    latest = await restore(db, session.id)
    assert latest.message_id == second
    files = await listing(latest)
    assert files["/home/user/w/notes.md"] == first_files["/home/user/w/notes.md"] + "changed\n"
    assert "/home/user/w/data.txt" not in files
    assert files["/home/user/w/added.txt"] == "new\n"
    assert (await latest.run('echo "$STAGE"')).stdout == "two\n"


async def test_restore__a_message_without_snapshot_gets_the_newest_before_it(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    sandbox = Sandbox.new()
    first = await turn(store, db, session.id, sandbox, "echo v1 > /home/user/f")
    unchanged = await turn(store, db, session.id, sandbox, "cat /home/user/f")
    assert await snapshot_messages(db, session.id) == {first}
    restored = await restore(db, session.id, at=unchanged)
    assert restored.message_id == first
    assert restored.read_file("/home/user/f") == "v1\n"


async def test_restore__nothing_stored_is_none(store: SessionStore, db: Database) -> None:
    _, session = await new_session(store)
    assert await snapshots.load_state(db, session.id) is None
    first = await turn(store, db, session.id, Sandbox.new(), "true")
    assert await snapshots.load_state(db, session.id, at_message_id=first) is None
    assert await snapshots.load_state(db, session.id, at_message_id="not-a-message") is None
    assert (await restore(db, session.id)).message_id is None


async def test_restore__a_restored_sandbox_keeps_snapshotting_from_there(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    await turn(store, db, session.id, Sandbox.new(), files={"/home/user/a": noise(30_000, 2)})
    sandbox = await restore(db, session.id)
    assert await sandbox.capture() is None  # restoring is not a change
    before = await stored(db)
    third = await turn(store, db, session.id, sandbox, "echo more >> /home/user/a")
    assert await stored(db) - before < 2_000  # a delta, not the 30 KB file again
    again = await restore(db, session.id, at=third)
    assert again.read_file("/home/user/a") == noise(30_000, 2) + "more\n"


# -- one read ---------------------------------------------------------------------------------


async def test_restore__is_one_query_whatever_the_history(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    sandbox = Sandbox.new()
    ids = [await turn(store, db, session.id, sandbox, files={"/home/user/a": noise(20_000, 3)})]
    for i in range(12):
        ids.append(await turn(store, db, session.id, sandbox, f"echo {i} >> /home/user/a"))
    seen: list[list[str]] = []
    for at in (ids[0], ids[6], None):
        with statements(db) as sql:
            state = await snapshots.load_state(db, session.id, at_message_id=at)
        assert state is not None
        seen.append(sql)
    assert [len(sql) for sql in seen] == [1, 1, 1]
    assert seen[0][0].lstrip().upper().startswith("SELECT")


async def test_restore__finds_the_state_by_one_seek_not_by_walking_messages(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    sandbox = Sandbox.new()
    with_state = await turn(store, db, session.id, sandbox, files={"/home/user/a": "kept"})
    ids = await add_exchange(store, session.id, 150)  # 300 messages without state after it
    # Auto-compaction moves the turn's user message up: the snapshot keeps its own position.
    lease = await store.start_turn(
        session.id, user_message=user_message("more"), last_message_id=ids[-1]
    )
    await store.insert_checkpoint_before_tail(lease, user_message("<checkpoint/>"))
    await store.finish(lease, [assistant_message("answer")])
    for at in (None, ids[-1], with_state):
        state = await snapshots.load_state(db, session.id, at_message_id=at)
        assert state is not None
        assert state.message_id == with_state
    query = str(
        snapshots.state_statement(at_message=True)
        .params(session_id=session.id, at_message_id=ids[-1])
        .compile(dialect=db.sync_engine.dialect, compile_kwargs={"literal_binds": True})
    )
    async with db.read() as conn:
        if db.dialect == "sqlite":
            rows = await conn.execute(text(f"EXPLAIN QUERY PLAN {query}"))
            plan = " | ".join(str(r[-1]) for r in rows)
            assert "agent_session_snapshots USING COVERING INDEX" in plan, plan
            assert "(session_id=? AND position<?)" in plan, plan
            assert "SCAN agent_session_messages" not in plan, plan
        else:  # one snapshot row: say that the index serves this shape, not what 1 row costs
            await conn.execute(text("SET enable_seqscan = off"))
            rows = await conn.execute(text(f"EXPLAIN (FORMAT JSON) {query}"))
            plan = json.dumps(rows.scalar())
            assert "uq_agent_session_snapshots_session_id_position" in plan, plan


# -- dedupe -----------------------------------------------------------------------------------


async def test_dedupe__unchanged_content_is_not_stored_again_by_later_messages(
    store: SessionStore, db: Database
) -> None:
    _, session = await new_session(store)
    sandbox = Sandbox.new()
    big = noise(200_000, 4)
    start = await stored(db)
    await turn(store, db, session.id, sandbox, files={"/home/user/big": big})
    first_cost = await stored(db) - start
    assert first_cost > 100_000  # 36 symbols: about 5.2 bits a character
    for i in range(5):
        before = await stored(db)
        await turn(store, db, session.id, sandbox, f"echo {i} > /home/user/small")
        assert await stored(db) - before < 5_000


async def test_dedupe__same_content_in_two_sessions_is_stored_once(
    store: SessionStore, db: Database
) -> None:
    big = noise(200_000, 5)
    _, one = await new_session(store)
    _, two = await new_session(store)
    await turn(store, db, one.id, Sandbox.new(), files={"/home/user/a/big": big})
    before_rows = await count(db, CONTENTS)
    before = await stored(db)
    await turn(store, db, two.id, Sandbox.new(), files={"/home/user/elsewhere/copy": big})
    assert await stored(db) - before < 10_000
    assert await count(db, CONTENTS) - before_rows <= 6  # tree, commit, shell, file, dirs
    restored = await restore(db, two.id)
    assert restored.read_file("/home/user/elsewhere/copy") == big


async def test_fork__shares_content_and_then_has_its_own_sandbox(
    store: SessionStore, db: Database
) -> None:
    owner, session = await new_session(store)
    sandbox = Sandbox.new()
    await turn(store, db, session.id, sandbox, files={"/home/user/f": noise(50_000, 6)})
    fork_point = await turn(store, db, session.id, sandbox, "echo at-fork > /home/user/g")
    await turn(store, db, session.id, sandbox, "echo after-fork > /home/user/g")

    totals = (await count(db, CONTENTS), await count(db, SETS), await count(db, MEMBERS))
    fork = await store.branch(session.id, fork_point, user_id=owner)
    assert (await count(db, CONTENTS), await count(db, SETS), await count(db, MEMBERS)) == totals
    copied = await snapshot_messages(db, fork.session.id)
    assert len(copied) == 2
    at_fork = (await store.messages(fork.session.id))[-1].message_id  # the fork point's copy
    assert at_fork in copied

    forked = await restore(db, fork.session.id)
    assert forked.message_id == at_fork
    assert forked.read_file("/home/user/g") == "at-fork\n"
    await turn(store, db, fork.session.id, forked, "echo fork-only > /home/user/g")

    source = await restore(db, session.id)
    assert source.read_file("/home/user/g") == "after-fork\n"
    assert (await restore(db, fork.session.id)).read_file("/home/user/g") == "fork-only\n"
    assert (await restore(db, session.id, at=fork_point)).read_file("/home/user/g") == "at-fork\n"


async def test_dedupe__a_stored_delta_becomes_self_contained_when_stored_so_again(
    store: SessionStore, db: Database
) -> None:
    """Session one stores an edited chunk as a delta; session two brings the same chunk with no
    history. The row must end self-contained, so neither session's later deltas chain."""
    text = noise(12_000, 7)
    _, one = await new_session(store)
    _, two = await new_session(store)
    sandbox = Sandbox.new()
    await turn(store, db, one.id, sandbox, files={"/home/user/t": text})
    await turn(store, db, one.id, sandbox, "echo tail >> /home/user/t")
    async with db.read() as conn:
        deltas = await conn.scalar(
            select(func.count()).select_from(CONTENTS).where(CONTENTS.c.codec == "zstd-delta")
        )
    assert deltas > 0
    await turn(store, db, two.id, Sandbox.new(), files={"/home/user/t": text + "tail\n"})
    second = await restore(db, two.id)
    await turn(store, db, two.id, second, "echo more >> /home/user/t")
    base = CONTENTS.alias("base")
    async with db.read() as conn:
        chained = await conn.scalar(
            select(func.count())
            .select_from(CONTENTS.join(base, base.c.id == CONTENTS.c.base_id))
            .where(base.c.codec == "zstd-delta")
        )
    assert chained == 0
    for session_id, expected in ((one.id, text + "tail\n"), (two.id, text + "tail\nmore\n")):
        assert (await restore(db, session_id)).read_file("/home/user/t") == expected


# -- truncate and garbage collection ----------------------------------------------------------


async def test_truncate__removes_the_snapshots_of_deleted_messages(
    store: SessionStore, db: Database
) -> None:
    owner, session = await new_session(store)
    sandbox = Sandbox.new()
    ids = [
        await turn(store, db, session.id, sandbox, f"echo {i} > /home/user/n{i}") for i in range(4)
    ]
    assert await snapshot_messages(db, session.id) == set(ids)
    result = await store.truncate(session.id, ids[1], Actor(owner))
    assert set(result.deleted_message_ids) >= set(ids[2:])
    assert await snapshot_messages(db, session.id) == set(ids[:2])
    rewound = await restore(db, session.id)
    assert rewound.message_id == ids[1]
    assert sorted(await listing(rewound)) == ["/home/user/n0", "/home/user/n1"]


async def test_gc__collects_only_unreferenced_content_and_live_snapshots_still_restore(
    store: SessionStore, db: Database
) -> None:
    owner, session = await new_session(store)
    _, other = await new_session(store)
    sandbox = Sandbox.new()
    ids = [await turn(store, db, session.id, sandbox, files={"/home/user/big": noise(60_000, 8)})]
    for i in range(6):
        ids.append(await turn(store, db, session.id, sandbox, f"echo {i} >> /home/user/big"))
        ids.append(
            await turn(
                store, db, session.id, sandbox, files={f"/home/user/own{i}": noise(9_000, i)}
            )
        )
    await turn(store, db, other.id, Sandbox.new(), files={"/home/user/kept": noise(9_000, 99)})
    expected = {m: await listing(await restore(db, session.id, at=m)) for m in ids[:5]}

    await store.truncate(session.id, ids[4], Actor(owner))
    await age_everything(db)
    reports = []

    async def sweep_twice() -> None:
        reports.append(await sweep(db, OFF, staleness_seconds=60))
        reports.append(await sweep(db, OFF, staleness_seconds=60))

    # A turn in flight: its content is stored, its snapshot not attached yet, when the sweeper
    # runs. The content is young, so it stays, and the turn attaches it afterwards.
    in_flight = await turn(
        store,
        db,
        session.id,
        sandbox,
        files={"/home/user/in-flight": noise(9_000, 100)},
        between=sweep_twice,
    )
    assert reports[0].snapshot_contents > 0
    assert reports[1].snapshot_contents == 0

    for message_id, files in expected.items():
        assert await listing(await restore(db, session.id, at=message_id)) == files
    assert (await restore(db, other.id)).read_file("/home/user/kept") == noise(9_000, 99)
    latest = await restore(db, session.id)
    assert latest.message_id == in_flight
    assert latest.read_file("/home/user/in-flight") == noise(9_000, 100)
    # Everything left is reachable from a snapshot.
    async with db.read() as conn:
        unreferenced = await conn.scalar(
            select(func.count()).select_from(CONTENTS).where(snapshots._unreferenced_content(0))
        )
    assert unreferenced == 0


async def test_gc__deleting_a_session_frees_what_only_it_used(
    store: SessionStore, db: Database
) -> None:
    owner, session = await new_session(store)
    _, other = await new_session(store)
    shared = noise(30_000, 10)
    await turn(
        store,
        db,
        session.id,
        Sandbox.new(),
        files={"/home/user/s": shared, "/home/user/x": noise(30_000, 11)},
    )
    await turn(store, db, other.id, Sandbox.new(), files={"/home/user/s": shared})
    await store.delete_session(session.id, Actor(owner))
    await age_everything(db)
    before = await stored(db)
    await sweep(db, OFF, staleness_seconds=60)
    assert before - await stored(db) > 15_000  # the file only the deleted session had
    assert (await restore(db, other.id)).read_file("/home/user/s") == shared


async def test_gc__reused_old_content_is_refreshed_and_survives_a_sweep_before_attach(
    store: SessionStore, db: Database
) -> None:
    """A rewind leaves content unreferenced; redoing the same work reuses it. The writer
    refreshes it while storing, so a sweep between storing and attaching cannot take it."""
    owner, session = await new_session(store)
    sandbox = Sandbox.new()
    keep = await turn(store, db, session.id, sandbox, "echo base > /home/user/base")
    await turn(
        store,
        db,
        session.id,
        sandbox,
        files={"/home/user/redo": noise(20_000, 12), "/home/user/gone": noise(20_000, 13)},
    )
    await store.truncate(session.id, keep, Actor(owner))
    await age_everything(db)

    redo = await restore(db, session.id)
    reports = []

    async def sweep_now() -> None:
        # What the new snapshot's new sets name was refreshed while being stored ...
        async with db.read() as conn:
            stale_members = await conn.scalar(
                select(func.count())
                .select_from(
                    CONTENTS.join(MEMBERS, MEMBERS.c.content_id == CONTENTS.c.id).join(
                        SETS, SETS.c.id == MEMBERS.c.set_id
                    )
                )
                .where(SETS.c.created_at > ago(600), CONTENTS.c.created_at < ago(1800))
            )
        assert stale_members == 0
        # ... so a sweep now, before the snapshot row exists, spares it.
        reports.append(await sweep(db, OFF, staleness_seconds=60))

    await turn(
        store,
        db,
        session.id,
        redo,
        files={"/home/user/redo": noise(20_000, 12)},
        between=sweep_now,
    )
    assert reports[0].snapshot_contents > 0  # what only the rewound turn had: "gone"
    restored = await restore(db, session.id)
    assert restored.read_file("/home/user/redo") == noise(20_000, 12)


async def test_schema__a_delta_without_its_base_is_refused(db: Database) -> None:
    with pytest.raises(DatabaseError):
        async with db.write() as conn:
            await conn.execute(
                CONTENTS.insert().values(
                    digest="e" * 64, codec="zstd-delta", raw_size=1, stored_size=1, data=b"x"
                )
            )


# A child process decodes zstd objects from eight threads at once, as replicas restore several
# sandboxes at once in worker threads. A decompressor shared across threads corrupted frames or
# crashed the process (SIGSEGV), which is why it runs apart from the test's own.
_DECODE_IN_THREADS = """
import os, sys, threading
import zstandard
from core.sandbox.state import CODEC_ZSTD, StoredObject, decode_stored
data = os.urandom(4096) * 40
obj = StoredObject("digest", CODEC_ZSTD, zstandard.ZstdCompressor(level=3).compress(data))
failed = []
def work():
    try:
        for _ in range(2000):
            if decode_stored(obj)[1] != data:
                failed.append("wrong bytes")
    except Exception as exc:
        failed.append(repr(exc))
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("failed:", failed[:3] if failed else "none")
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow  # a process of its own
def test_decoding__stored_objects_decode_from_many_threads_at_once() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _DECODE_IN_THREADS],
        env=child_environment(PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "failed: none" in done.stdout

"""The benchmark behind ``slack-agent bench``: the core's costs, with no model.

``run_bench`` measures, on one database:

- ``turn``: a whole turn's bookkeeping through ``run_turn`` (stale guard, claim, stamp, user
  message, then ``finish`` with one assistant message and the release) on a session of
  ``turn_history`` messages;
- ``turn_async_commit`` (PostgreSQL given by URL): ``turn`` again on connections with
  ``synchronous_commit=off`` (``POSTGRES_SYNCHRONOUS_COMMIT``), to show what the WAL flushes of
  its two commits cost;
- ``append_message``: one fenced ``store.append`` of a single message while a lease is held;
- ``history_load``: ``store.history`` (the projection) for sessions of several total sizes with a
  checkpoint 20 messages before the end, keyed by the total size as a string; and
  ``history_load_no_checkpoint``: the same sizes without a checkpoint (the whole history);
- ``claim_round_50``: 50 ``start_turn`` calls gathered on one engine against one session, one
  round, exactly one winner (anything else aborts the run); the winner's release between rounds
  is not timed;
- ``truncate``: rewinding a ``long_session``-message session to the assistant message
  ``truncate_deleted + 1`` from the end (each sample deletes ``truncate_deleted`` messages; the
  session is rebuilt untimed between samples);
- ``branch``: forking the same session at its last message (copies all ``long_session``
  messages; the fork is deleted untimed between samples);
- ``sweep_sessions_per_second``: ``core.storage.sweeper.sweep`` over ``sweep_sessions`` expired
  temporary sessions of ``sweep_messages_per_session`` messages each;
- the snapshot keys of ``bench.costs.snapshots`` (``snapshot_bytes_per_message``,
  ``snapshot_store``, ``snapshot_restore``, …) for a ~1 MB workspace with a one-file edit per
  message.

Timings are ``{"p50": ms, "p95": ms, "n": samples}`` (p95 by nearest rank), taken with
``time.perf_counter`` after untimed warm-up iterations, so connection set-up and statement
compilation are not measured. Measurements this module does not take are absent from the result,
never estimated.

Side effects. With no URL the run uses a temporary SQLite file, deleted afterwards. With a URL the
database is migrated (``core.storage.migrate.upgrade``) and used as it is: every session the
benchmark creates belongs to one project ``bench-<random>`` and is deleted at the end through the
store. One exception: the sweeper has no notion of a project, so the sweep measurement (run with the
idle and per-user rules off) also deletes expired temporary sessions and unreferenced snapshot
content that were already due in that database -- exactly what every replica's own sweeper would
delete on its next pass, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, cast

from sqlalchemy import Table, insert, select, update

from bench.common import (
    ASSISTANT_TEXT,
    USER_TEXT,
    BenchError,
    database,
    exchange_message,
    summarize,
    transcript,
)
from bench.costs.snapshots import bench_snapshots
from core.agent.turn import run_turn
from core.errors import AgentSessionBusy, AgentSessionError
from core.messages import Message, assistant_message, user_message
from core.records import ANY_TAIL, Actor, ModelChoice, StoredMessage, TurnLease
from core.storage.dialect import ago
from core.storage.engine import Database, create_database
from core.storage.migrate import upgrade
from core.storage.models import AgentSession, AgentSessionMessage, validate_message
from core.storage.retention import RetentionPolicy
from core.storage.sessions import SessionStore
from core.storage.sweeper import sweep

SESSIONS: Final = cast(Table, AgentSession.__table__)
MESSAGES: Final = cast(Table, AgentSessionMessage.__table__)
ADMIN: Final = Actor(user_id=None, admin=True)
# Messages after the checkpoint in the ``history_load`` sessions.
AFTER_CHECKPOINT: Final = 20
SWEEP_BATCH_SIZE: Final = 100  # SWEEPER_BATCH_SIZE's default


@dataclass(frozen=True)
class BenchSizes:
    """Sizes and sample counts of one run (``quick`` shrinks them)."""

    turn_history: int
    turn_samples: int
    append_samples: int
    history_sizes: tuple[int, ...]
    history_samples: int
    history_full_samples: int
    claimers: int
    claim_rounds: int
    long_session: int
    truncate_deleted: int
    truncate_samples: int
    branch_samples: int
    sweep_sessions: int
    sweep_messages_per_session: int
    sweep_rounds: int
    warmup: int


FULL: Final = BenchSizes(
    turn_history=1000,
    turn_samples=200,
    append_samples=200,
    history_sizes=(100, 1000, 10_000),
    history_samples=100,
    history_full_samples=20,
    claimers=50,
    claim_rounds=30,
    long_session=10_000,
    truncate_deleted=10,
    truncate_samples=30,
    branch_samples=15,
    sweep_sessions=2000,
    sweep_messages_per_session=4,
    sweep_rounds=3,
    warmup=5,
)

QUICK: Final = BenchSizes(
    turn_history=1000,
    turn_samples=50,
    append_samples=50,
    history_sizes=(100, 1000),
    history_samples=30,
    history_full_samples=10,
    claimers=50,
    claim_rounds=10,
    long_session=2000,
    truncate_deleted=10,
    truncate_samples=10,
    branch_samples=5,
    sweep_sessions=500,
    sweep_messages_per_session=4,
    sweep_rounds=1,
    warmup=3,
)


# -- statistics -----------------------------------------------------------------------------------


async def _sample(
    n: int,
    operation: Callable[[], Awaitable[object]],
    *,
    warmup: int = 0,
    before: Callable[[], Awaitable[object]] | None = None,
    after: Callable[[], Awaitable[object]] | None = None,
) -> list[float]:
    """Time ``operation`` ``n`` times; ``before``/``after`` run around each call, untimed."""
    samples: list[float] = []
    for i in range(warmup + n):
        if before is not None:
            await before()
        start = time.perf_counter()
        await operation()
        elapsed = time.perf_counter() - start
        if after is not None:
            await after()
        if i >= warmup:
            samples.append(elapsed)
    return samples


# -- building data --------------------------------------------------------------------------------


def _message_row(session_id: int, position: int, message: Message) -> dict[str, Any]:
    """A message row for bulk set-up (the store's own invariant check gives ``message_id``)."""
    return {
        "session_id": session_id,
        "position": position,
        "message": message,
        "message_id": validate_message(message),
        "is_compaction_message": False,
    }


class _Bench:
    def __init__(self, db: Database, sizes: BenchSizes) -> None:
        self.db = db
        self.store = SessionStore(db, staleness_seconds=60)
        self.sizes = sizes
        self.project = f"bench-{uuid.uuid4().hex[:12]}"
        self.leases: dict[str, TurnLease] = {}  # by token: what cleanup must release

    async def new_session(self, name: str, messages: int = 0, **kwargs: Any) -> int:
        session, _ = await self.store.get_or_create_session(
            self.project, f"{name}/{uuid.uuid4()}", user_id=None
        )
        if messages:
            await self.import_messages(session.id, transcript(0, messages, **kwargs))
        return session.id

    async def import_messages(self, session_id: int, rows: list[tuple[Message, bool]]) -> None:
        # Bulk loads go in slices so one statement never carries tens of thousands of rows.
        for i in range(0, len(rows), 2000):
            await self.store.import_messages(session_id, rows[i : i + 2000])

    async def tail_id(self, session_id: int) -> str | None:
        tail = await self.store.tail(session_id)
        return tail.message_id if tail else None

    # -- measurements ----------------------------------------------------------------------------

    async def turn(self) -> dict[str, Any]:
        session_id = await self.new_session("turn", self.sizes.turn_history)
        last = await self.tail_id(session_id)
        model = ModelChoice(provider="offline", name="bench", builtin_provider="offline")

        async def one_turn() -> None:
            nonlocal last
            question = user_message(USER_TEXT)
            answer = assistant_message(ASSISTANT_TEXT)
            async with run_turn(
                self.store,
                session_id,
                user_message=question,
                last_message_id=last,
                model=model,
            ) as turn:
                await turn.finish([answer])
            last = answer["id"]

        samples = await _sample(self.sizes.turn_samples, one_turn, warmup=self.sizes.warmup)
        return summarize(samples)

    async def append_message(self) -> dict[str, Any]:
        session_id = await self.new_session("append", self.sizes.turn_history)
        lease = await self.store.start_turn(session_id, user_message=None, last_message_id=ANY_TAIL)
        self.leases[lease.token] = lease
        try:

            async def append() -> list[StoredMessage]:
                return await self.store.append(lease, [assistant_message(ASSISTANT_TEXT)])

            samples = await _sample(self.sizes.append_samples, append, warmup=self.sizes.warmup)
        finally:
            await self.store.release(lease)
            self.leases.pop(lease.token, None)
        return summarize(samples)

    async def history_load(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Projection loads per size, with and without a checkpoint.

        Every session is built first and the sizes are then sampled in turn (round-robin), so
        a burst of load on the machine, or the database settling after a bulk insert, weighs
        on every size alike instead of on whichever was being measured at the time.
        """
        sizes = self.sizes.history_sizes
        checkpointed: dict[int, int] = {}
        plain: dict[int, int] = {}
        for size in sizes:
            checkpointed[size] = await self.new_session(
                f"history-{size}", size, checkpoint_at=max(0, size - AFTER_CHECKPOINT - 1)
            )
            plain[size] = await self.new_session(f"history-full-{size}", size)

        async def load(session_id: int, expected: int) -> float:
            start = time.perf_counter()
            got = len(await self.store.history(session_id))
            elapsed = time.perf_counter() - start
            if got != expected:
                raise BenchError(f"history of session {session_id}: {got} messages, not {expected}")
            return elapsed

        async def interleaved(
            sessions: dict[int, int], n: int, warmup: int, projected: Callable[[int], int]
        ) -> dict[str, Any]:
            samples: dict[int, list[float]] = {size: [] for size in sizes}
            for i in range(warmup + n):
                for size in sizes:
                    elapsed = await load(sessions[size], projected(size))
                    if i >= warmup:
                        samples[size].append(elapsed)
            return {str(size): summarize(samples[size]) for size in sizes}

        with_checkpoint = await interleaved(
            checkpointed,
            self.sizes.history_samples,
            self.sizes.warmup,
            lambda size: min(size, AFTER_CHECKPOINT + 1),
        )
        without = await interleaved(plain, self.sizes.history_full_samples, 2, lambda size: size)
        return with_checkpoint, without

    async def claim_round(self) -> dict[str, Any]:
        session_id = await self.new_session("claim", 2)
        last = await self.tail_id(session_id)
        samples: list[float] = []
        for i in range(self.sizes.warmup + self.sizes.claim_rounds):
            elapsed, lease = await claim_round(
                self.store, session_id, last, self.sizes.claimers, self.leases
            )
            assert lease.tail is not None
            last = lease.tail.message_id
            await self.store.release(lease)  # untimed: the round ends when every claim answered
            self.leases.pop(lease.token, None)
            if i >= self.sizes.warmup:
                samples.append(elapsed)
        return summarize(samples)

    async def truncate_and_branch(self) -> tuple[dict[str, Any], dict[str, Any]]:
        length = self.sizes.long_session
        deleted = self.sizes.truncate_deleted
        if length % 2 or deleted % 2 or deleted >= length:
            raise ValueError("long_session and truncate_deleted must be even, deleted < length")
        session_id = await self.new_session("long", length)
        # An assistant message (odd position) with ``deleted`` messages after it.
        target = await self.store.messages(session_id, after_position=length - deleted - 2)
        target_id = target[0].message_id
        if target[0].role != "assistant" or len(target) != deleted + 1:
            raise BenchError("truncate target is not where the benchmark put it")

        async def truncate() -> None:
            result = await self.store.truncate(session_id, target_id, ADMIN)
            if result.deleted != deleted:
                raise BenchError(f"truncate deleted {result.deleted}, expected {deleted}")

        async def rebuild() -> None:
            await self.import_messages(session_id, transcript(length - deleted, deleted))

        truncate_samples = await _sample(
            self.sizes.truncate_samples, truncate, warmup=2, after=rebuild
        )

        tail = await self.tail_id(session_id)
        assert tail is not None
        forks: list[int] = []

        async def branch() -> None:
            result = await self.store.branch(
                session_id, tail, user_id=None, project_name=self.project
            )
            forks.append(result.session.id)
            if result.copied != length:
                raise BenchError(f"branch copied {result.copied}, expected {length}")

        async def drop_fork() -> None:
            await self.store.delete_session(forks.pop(), ADMIN)

        branch_samples = await _sample(self.sizes.branch_samples, branch, warmup=1, after=drop_fork)
        await self.store.delete_session(session_id, ADMIN)
        return summarize(truncate_samples), summarize(branch_samples)

    async def sweep_rate(self) -> float:
        rates: list[float] = []
        policy = RetentionPolicy(max_idle_days=0, max_per_user=0)  # expired sessions only
        # One untimed pass so anything already due does not count against the bench's rate.
        await sweep(self.db, policy, staleness_seconds=60, batch_size=SWEEP_BATCH_SIZE)
        for round_ in range(self.sizes.sweep_rounds):
            await self._expired_sessions(f"sweep-{round_}")
            gc.collect()
            start = time.perf_counter()
            report = await sweep(self.db, policy, staleness_seconds=60, batch_size=SWEEP_BATCH_SIZE)
            elapsed = time.perf_counter() - start
            if report.expired < self.sizes.sweep_sessions:
                raise BenchError(
                    f"sweep deleted {report.expired} sessions, expected {self.sizes.sweep_sessions}"
                )
            rates.append(report.expired / elapsed)
        return round(statistics.median(rates), 1)

    async def _expired_sessions(self, name: str) -> None:
        """``sweep_sessions`` temporary sessions that expired a minute ago (database clock)."""
        count = self.sizes.sweep_sessions
        prefix = f"{name}/{uuid.uuid4().hex[:8]}/"
        async with self.db.write() as conn:
            await conn.execute(
                insert(SESSIONS).values(expires_at=ago(60)),
                [
                    {"project_name": self.project, "project_session_id": f"{prefix}{i}"}
                    for i in range(count)
                ],
            )
            ids = (
                await conn.scalars(
                    select(SESSIONS.c.id).where(
                        SESSIONS.c.project_name == self.project,
                        SESSIONS.c.project_session_id.startswith(prefix),
                    )
                )
            ).all()
        per_session = self.sizes.sweep_messages_per_session
        for chunk in range(0, len(ids), 500):
            rows = [
                _message_row(session_id, position, exchange_message(position))
                for session_id in ids[chunk : chunk + 500]
                for position in range(per_session)
            ]
            async with self.db.write() as conn:
                await conn.execute(insert(MESSAGES), rows)

    # -- cleanup ---------------------------------------------------------------------------------

    async def cleanup(self) -> None:
        """Release what the bench still holds and delete every session of its project."""
        for lease in list(self.leases.values()):
            with contextlib.suppress(AgentSessionError):
                await self.store.release(lease)
        self.leases.clear()
        while True:
            sessions = await self.store.list_sessions(project_name=self.project, limit=500)
            if not sessions:
                return
            for session in sessions:
                try:
                    await self.store.delete_session(session.id, ADMIN)
                except AgentSessionBusy:  # a lock held by a claim that escaped us: free it
                    async with self.db.write() as conn:
                        await conn.execute(
                            update(SESSIONS)
                            .where(SESSIONS.c.id == session.id)
                            .values(heartbeat_at=None, lock_token=None)
                        )
                    await self.store.delete_session(session.id, ADMIN)


class _Claimer(Protocol):
    async def start_turn(
        self,
        session_id: int,
        *,
        user_message: Message | None,
        last_message_id: Any,
        model: ModelChoice | None = None,
    ) -> TurnLease: ...


async def claim_round(
    store: _Claimer,
    session_id: int,
    last_message_id: str | None,
    claimers: int,
    held: dict[str, TurnLease] | None = None,
) -> tuple[float, TurnLease]:
    """``claimers`` concurrent ``start_turn`` calls; (wall time, the one winner's lease).

    Raises ``BenchError`` unless exactly one claim wins and every other one is refused with
    ``agent_session_busy`` (any other error, e.g. a driver error, fails the round). Winning
    leases are added to ``held`` before anything is raised, so the caller can release them.
    """
    messages = [user_message(f"claimer {i}") for i in range(claimers)]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            store.start_turn(session_id, user_message=m, last_message_id=last_message_id)
            for m in messages
        ),
        return_exceptions=True,
    )
    elapsed = time.perf_counter() - start
    winners = [r for r in results if isinstance(r, TurnLease)]
    if held is not None:
        held.update((w.token, w) for w in winners)
    busy = sum(isinstance(r, AgentSessionBusy) for r in results)
    others = [r for r in results if not isinstance(r, TurnLease | AgentSessionBusy)]
    if others:
        raise BenchError(f"claim round: unexpected error {others[0]!r}") from (
            others[0] if isinstance(others[0], BaseException) else None
        )
    if len(winners) != 1 or busy != claimers - 1:
        raise BenchError(
            f"claim round: {len(winners)} winners and {busy} busy refusals "
            f"among {claimers} claimers (expected exactly one winner)"
        )
    return elapsed, winners[0]


# -- entry points ---------------------------------------------------------------------------------


async def _async_commit_turn(database_url: str, sizes: BenchSizes) -> dict[str, Any]:
    """``turn`` again with POSTGRES_SYNCHRONOUS_COMMIT=off: what the two WAL flushes cost."""
    db = create_database(database_url, synchronous_commit=False)
    bench = _Bench(db, sizes)
    try:
        return await bench.turn()
    finally:
        await bench.cleanup()
        await db.dispose()


async def run_bench(
    database_url: str | None, *, quick: bool = False, sizes: BenchSizes | None = None
) -> dict[str, Any]:
    """Run every core measurement on one database; its keys are the README's.

    ``database_url=None`` means a fresh temporary SQLite file, deleted afterwards. ``sizes``
    overrides the full or quick sizes (tests use it to go faster still).
    """
    chosen = sizes or (QUICK if quick else FULL)
    load_start = os.getloadavg()
    started = time.perf_counter()
    async with database(database_url) as (db, temporary):
        await upgrade(db)
        bench = _Bench(db, chosen)
        result: dict[str, Any] = {
            "database": "postgresql" if db.dialect == "postgresql" else "sqlite",
            "quick": quick,
        }
        try:
            result["turn_history"] = chosen.turn_history
            result["turn"] = await bench.turn()
            if db.dialect == "postgresql" and database_url is not None:
                result["turn_async_commit"] = await _async_commit_turn(database_url, chosen)
            result["append_message"] = await bench.append_message()
            history, history_full = await bench.history_load()
            result["history_load"] = history
            result["history_load_no_checkpoint"] = history_full
            result["history_after_checkpoint"] = AFTER_CHECKPOINT
            result["claimers"] = chosen.claimers
            result[f"claim_round_{chosen.claimers}"] = await bench.claim_round()
            result["long_session"] = chosen.long_session
            result["truncate_deleted"] = chosen.truncate_deleted
            result["truncate"], result["branch"] = await bench.truncate_and_branch()
            result["sweep_sessions"] = chosen.sweep_sessions
            result["sweep_messages_per_session"] = chosen.sweep_messages_per_session
            result["sweep_sessions_per_second"] = await bench.sweep_rate()
            result.update(await bench_snapshots(db, quick=quick))
        finally:
            if not temporary:
                await bench.cleanup()
    result["load_average"] = {
        "start": [round(x, 2) for x in load_start],
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def format_table(result: dict[str, Any]) -> str:
    """The result as a table for people: one row per timing, sizes and context underneath."""
    rows: list[tuple[str, str, str, str]] = []

    def timing(label: str, value: Any) -> None:
        if isinstance(value, dict) and {"p50", "p95", "n"} <= value.keys():
            rows.append((label, f"{value['p50']:.3f}", f"{value['p95']:.3f}", str(value["n"])))

    for key, value in result.items():
        if isinstance(value, dict) and key.startswith("history_load"):
            for size, timed in sorted(value.items(), key=lambda item: int(item[0])):
                timing(f"{key} [{int(size):,} msgs]", timed)
        else:
            timing(_label(key, result), value)

    width = max([len("measurement"), *(len(r[0]) for r in rows)])
    lines = [
        f"slack-agent bench: {result.get('database', '?')}"
        + (" (quick)" if result.get("quick") else ""),
        "",
        f"{'measurement':<{width}}  {'p50 ms':>10}  {'p95 ms':>10}  {'n':>5}",
        f"{'-' * width}  {'-' * 10}  {'-' * 10}  {'-' * 5}",
    ]
    lines += [f"{name:<{width}}  {p50:>10}  {p95:>10}  {n:>5}" for name, p50, p95, n in rows]
    if "sweep_sessions_per_second" in result:
        lines += [
            "",
            f"sweep: {result['sweep_sessions_per_second']:,.1f} sessions/s "
            f"({result.get('sweep_sessions', '?')} expired sessions, "
            f"{result.get('sweep_messages_per_session', '?')} messages each)",
        ]
    if "snapshot_bytes_per_message" in result:
        lines.append(
            f"snapshots: {result['snapshot_bytes_per_message']:,.0f} bytes stored per message "
            f"(one-file edit in a {result.get('snapshot_workspace_bytes', 0):,} byte workspace)"
        )
    if "idle_rss_bytes" in result:
        lines.append(f"idle serve: {result['idle_rss_bytes'] / 2**20:,.1f} MiB resident")
    load = result.get("load_average")
    if isinstance(load, dict):
        lines.append(
            "load average (1/5/15 min): start "
            + " ".join(f"{x:.2f}" for x in load.get("start", []))
            + ", end "
            + " ".join(f"{x:.2f}" for x in load.get("end", []))
        )
    if "seconds" in result:
        lines.append(f"run took {result['seconds']} s")
    return "\n".join(lines)


def _label(key: str, result: dict[str, Any]) -> str:
    if key == "turn" and "turn_history" in result:
        return f"turn [{result['turn_history']:,} msgs]"
    if key == "turn_async_commit" and "turn_history" in result:
        return f"turn, synchronous_commit=off [{result['turn_history']:,} msgs]"
    if key in ("truncate", "branch") and "long_session" in result:
        return f"{key} [{result['long_session']:,} msgs]"
    return key

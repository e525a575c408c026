"""What a replica's event loop was doing while acknowledgements waited:
``python -m bench.soak.probe``.

Started by the soak in place of ``python -m bot serve`` when it profiles (``--profile DIR``), it
runs the same ``serve`` with these recorders around it, and writes what they saw to a JSON file
every second (a replica killed with SIGKILL keeps what it had written):

- **acknowledgements, server side**: how long each ``POST /slack/events`` took from the moment
  its handler ran to its answer, and its parts (Bolt's dispatch, ``known_thread``'s reads and
  their wait for a pool connection, the record and its INSERT); compared with what the load
  generator measured, the rest is time the request waited before the loop got to it (or time
  the load generator itself waited);
- **loop lag**: a tick every ``TICK_SECONDS``; how late each one ran is how long the loop was
  busy elsewhere, which every request arriving then waited out;
- **slow callbacks**: every step of the loop longer than ``SLOW_SECONDS``, named by the task it
  ran (its top coroutine, and where it stopped), and how much of it was spent collecting
  garbage;
- **garbage collections** and their pauses, by generation.

Also the database's round trips (a statement, BEGIN, COMMIT/ROLLBACK) and pool checkouts, by
pool size (the urgent pool the records are written on is the small one): on a busy machine each
round trip waits for several processes to be scheduled (this one, PostgreSQL's backend, and
the soak's proxy when it is in the path).

Recording costs a clock read or two per step of the loop and no system call (CPU-time clocks
are system calls here, and a thread descheduled on their return skewed py-spy's samples); the
stacks themselves come from py-spy (``bench.soak.profile``), sampling from outside.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import functools
import gc
import json
import os
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

TICK_SECONDS = 0.005
SLOW_SECONDS = 0.020
GC_REPORTED_SECONDS = 0.005
# Upper bounds of the histograms' buckets, in milliseconds (the last bucket is everything more).
BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 3000, 5000, 10000)


class Histogram:
    """Counts by bucket and the largest value: enough for percentiles to a bucket's precision."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_MS) + 1)
        self.n = 0
        self.total = 0.0
        self.largest = 0.0

    def add(self, ms: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self.n += 1
        self.total += ms
        self.largest = max(self.largest, ms)

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets_ms": list(BUCKETS_MS),
            "counts": self.counts,
            "n": self.n,
            "sum_ms": round(self.total, 1),
            "max_ms": round(self.largest, 1),
        }


def _innermost(coro: Any) -> str:
    """Where a coroutine chain is suspended: the innermost coroutine's name and line."""
    where = ""
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            where = f"{frame.f_code.co_qualname}:{frame.f_lineno}"
        inner = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        if inner is None:
            break
        coro = inner
    return where


def _task_of(callback: Any) -> asyncio.Task[Any] | None:
    owner = getattr(callback, "__self__", None)
    return owner if isinstance(owner, asyncio.Task) else None


def _name(callback: Any) -> str:
    """A short name for a callback that is not a task's step."""
    for attribute in ("__qualname__", "__name__"):
        found = getattr(callback, attribute, None)
        if isinstance(found, str):
            return found
    return type(callback).__qualname__


def _awaiting(coro: Any) -> list[str]:
    """Where a coroutine waits, frame by frame, into the async generators it awaits (an
    ``async with`` on a generator-based context manager, an ``async for``): their ``asend``
    objects name their generator only to the garbage collector."""
    chain: list[str] = []
    inner: Any = coro
    for _ in range(64):
        if type(inner).__name__ in ("async_generator_asend", "async_generator_athrow"):
            generators = [g for g in gc.get_referents(inner) if hasattr(g, "ag_frame")]
            if not generators:
                break
            inner = generators[0]
        frame = getattr(inner, "cr_frame", None) or getattr(inner, "ag_frame", None)
        if frame is not None:
            chain.append(f"{frame.f_code.co_qualname}:{frame.f_lineno}")
        inner = getattr(inner, "cr_await", None) or getattr(inner, "ag_await", None)
        if inner is None:
            break
        if not hasattr(inner, "cr_frame") and type(inner).__name__ not in (
            "async_generator_asend",
            "async_generator_athrow",
        ):
            chain.append(repr(inner)[:200])
            break
    return chain


class SoakProbe:
    """The recorders of one process; ``install`` before its loop runs, ``write`` at any time."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started = time.monotonic()
        self.dumps = 0  # task dumps written (SIGUSR1)
        self.acks = Histogram()
        self.acks_by_second: dict[int, Histogram] = defaultdict(Histogram)
        self.ack_samples: list[tuple[float, float]] = []  # (seconds from the start, ms)
        self.parts: dict[str, Histogram] = defaultdict(Histogram)  # of the acknowledgement
        self.lag = Histogram()
        self.lag_max_by_second: dict[int, float] = defaultdict(float)
        self.busy_by_second: dict[int, float] = defaultdict(float)  # ms of slow steps
        self.slow: list[dict[str, Any]] = []
        # ms of slow steps by their task's top coroutine
        self.slow_by_task: defaultdict[str, float] = defaultdict(float)
        self.slow_count_by_task: Counter[str] = Counter()
        self.gc_pauses: defaultdict[int, float] = defaultdict(float)  # ms by generation
        self.gc_long: list[dict[str, Any]] = []
        self._gc_began = 0.0
        self.gc_total_ms = 0.0
        self.slow_gc_ms = 0.0  # of the slow steps: collecting garbage
        self._lock = threading.Lock()

    def _second(self) -> int:
        return int(time.monotonic() - self.started)

    # -- installation ---------------------------------------------------------------------------

    def install(self) -> None:
        self._time_steps()
        gc.callbacks.append(self._on_gc)

    def _time_steps(self) -> None:
        """Every callback of the loop timed (``asyncio.events.Handle._run`` runs each one)."""
        run = asyncio.events.Handle._run
        probe = self

        def timed(handle: asyncio.Handle) -> None:
            callback = handle._callback  # type: ignore[attr-defined]
            collected = probe.gc_total_ms
            begun = time.perf_counter()
            run(handle)
            took = time.perf_counter() - begun
            if took >= SLOW_SECONDS:
                probe._slow(callback, took, probe.gc_total_ms - collected)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign,assignment]

    def _slow(self, callback: Any, took: float, gc_ms: float) -> None:
        """A long step: ``took`` seconds of wall time, ``gc_ms`` of it collecting garbage."""
        ms = took * 1000
        task = _task_of(callback)
        if task is not None:
            coro = task.get_coro()
            top = getattr(coro, "__qualname__", type(coro).__qualname__)
            stopped = "" if task.done() else _innermost(coro)
        else:
            top, stopped = _name(callback), ""
        second = self._second()
        with self._lock:
            self.busy_by_second[second] += ms
            self.slow_gc_ms += gc_ms
            self.slow_by_task[top] += ms
            self.slow_count_by_task[top] += 1
            if len(self.slow) < 5000:
                self.slow.append(
                    {
                        "at": round(time.monotonic() - self.started, 3),
                        "ms": round(ms, 1),
                        "gc_ms": round(gc_ms, 1),
                        "task": top,
                        "stopped_at": stopped,
                    }
                )

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if phase == "start":
            self._gc_began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_began) * 1000
        generation = int(info.get("generation", 0))
        self.gc_total_ms += ms
        self.gc_pauses[generation] += ms
        if ms >= GC_REPORTED_SECONDS * 1000:
            self.gc_long.append(
                {
                    "at": round(time.monotonic() - self.started, 3),
                    "ms": round(ms, 1),
                    "generation": generation,
                }
            )

    # -- what is recorded -----------------------------------------------------------------------

    def ack(self, seconds: float) -> None:
        ms = seconds * 1000
        self.acks.add(ms)
        self.ack_samples.append((round(time.monotonic() - self.started, 3), round(ms, 2)))
        self.acks_by_second[self._second()].add(ms)

    def part(self, name: str, seconds: float) -> None:
        """One part of an acknowledgement's path took ``seconds`` (``time_the_intake``)."""
        self.parts[name].add(seconds * 1000)

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_SECONDS
            await asyncio.sleep(TICK_SECONDS)
            late = max(0.0, loop.time() - due) * 1000
            self.lag.add(late)
            second = self._second()
            self.lag_max_by_second[second] = max(self.lag_max_by_second[second], late)

    async def keep_writing(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.write)

    def dump_tasks(self) -> None:
        """Every task of the loop and where it waits (on SIGUSR1: the soak asks when its
        records did not settle), to ``OUT.tasks.txt``."""
        lines = []
        for task in asyncio.all_tasks():
            coro = task.get_coro()
            name = getattr(coro, "__qualname__", type(coro).__qualname__)
            lines.append(f"{name}: {' > '.join(_awaiting(coro))}")
        # Numbered, so dumps asked for one after another can be compared (what did not move).
        self.dumps += 1
        out = self.out.with_suffix(f".tasks.{self.dumps}.txt" if self.dumps > 1 else ".tasks.txt")
        out.write_text("\n".join(sorted(lines)) + "\n")

    def write(self) -> None:
        usage = os.times()
        with self._lock:
            data = {
                "pid": os.getpid(),
                "seconds": round(time.monotonic() - self.started, 1),
                "cpu_seconds": round(usage.user + usage.system, 2),
                "ack_handler_ms": self.acks.as_dict(),
                "ack_handler_samples": list(self.ack_samples),
                "ack_handler_ms_by_second": {
                    str(s): h.as_dict() for s, h in sorted(self.acks_by_second.items())
                },
                "ack_parts_ms": {k: h.as_dict() for k, h in self.parts.items()},
                "loop_lag_ms": self.lag.as_dict(),
                "loop_lag_max_ms_by_second": {
                    str(s): round(v, 1) for s, v in sorted(self.lag_max_by_second.items())
                },
                "slow_steps_ms_by_second": {
                    str(s): round(v, 1) for s, v in sorted(self.busy_by_second.items())
                },
                "slow_steps_ms_by_task": {
                    k: round(v, 1)
                    for k, v in sorted(self.slow_by_task.items(), key=lambda kv: -kv[1])
                },
                "slow_steps_by_task": dict(self.slow_count_by_task.most_common()),
                "slow_steps": list(self.slow),
                "slow_steps_gc_ms": round(self.slow_gc_ms, 1),
                "gc_pause_ms_by_generation": {
                    str(g): round(v, 1) for g, v in sorted(self.gc_pauses.items())
                },
                "gc_long": list(self.gc_long),
                "gc_counts": [s["collections"] for s in gc.get_stats()],
            }
        partial = self.out.with_suffix(".tmp")
        partial.write_text(json.dumps(data))
        partial.replace(self.out)


# The task of the acknowledgement being handled, in its context (tasks it starts inherit the
# value but are other tasks: the comparison with the current task tells them apart).
_INTAKE: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar(
    "intake", default=None
)


def timed_sync(owner: Any, name: str, record: Callable[[Any, float], None]) -> None:
    """Replace the method ``owner.name`` by one that also records its duration (and self)."""
    method: Callable[..., Any] = getattr(owner, name)

    def timed_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            record(self, time.perf_counter() - begun)

    setattr(owner, name, timed_method)


def timed(owner: Any, name: str, record: Callable[[float], None]) -> None:
    """Replace the coroutine method ``owner.name`` by one that also records its duration."""
    method: Callable[..., Awaitable[Any]] = getattr(owner, name)

    async def timed_method(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter()
        try:
            return await method(*args, **kwargs)
        finally:
            record(time.perf_counter() - begun)

    setattr(owner, name, timed_method)


def time_the_intake(probe: SoakProbe) -> None:
    """The acknowledgement's path, each part timed: the handler, Bolt's dispatch (middleware,
    authorization, the listener), the listener's database reads and the record's commit."""
    from slack_bolt.async_app import AsyncApp

    from bot.http import Listener
    from core.conversation.intake import Intake
    from core.storage.deliveries import Deliveries, _GroupCommit

    events = Listener._events

    async def intake(listener: Listener, request: Any) -> Any:
        _INTAKE.set(asyncio.current_task())
        begun = time.perf_counter()
        try:
            return await events(listener, request)
        finally:
            probe.ack(time.perf_counter() - begun)

    Listener._events = intake  # type: ignore[method-assign,assignment]
    for owner, name, part in (
        (AsyncApp, "async_dispatch", "dispatch"),
        (Intake, "known_thread", "known_thread"),
        (Deliveries, "record", "record"),
        (_GroupCommit, "_insert_rows", "record_insert"),
    ):
        timed(owner, name, functools.partial(probe.part, part))


def time_the_database(probe: SoakProbe) -> None:
    """PostgreSQL's round trips through asyncpg, pool checkouts by pool size, and the write
    transactions, urgent (the records acknowledgements wait for) or not: from asking for one to
    its first statement (checkout, BEGIN), and its commit."""
    from sqlalchemy.dialects.postgresql import asyncpg
    from sqlalchemy.pool import impl

    from core.storage.engine import Database

    write, read = Database.write, Database.read

    @contextlib.asynccontextmanager
    async def timed_read(self: Database, **options: bool) -> AsyncIterator[Any]:
        """Read transactions opened by an acknowledgement (``intake``) apart from the rest."""
        kind = "intake" if _INTAKE.get() is asyncio.current_task() else "other"
        begun = time.perf_counter()
        async with read(self, **options) as conn:
            probe.part(f"read_{kind}_open", time.perf_counter() - begun)
            yield conn

    Database.read = timed_read  # type: ignore[method-assign]

    @contextlib.asynccontextmanager
    async def timed_write(self: Database, **options: bool) -> AsyncIterator[Any]:
        kind = "urgent" if options.get("urgent") else "ordinary"
        begun = time.perf_counter()
        async with write(self, **options) as conn:
            probe.part(f"write_{kind}_open", time.perf_counter() - begun)
            yield conn
            ending = time.perf_counter()
        probe.part(f"write_{kind}_commit", time.perf_counter() - ending)

    Database.write = timed_write  # type: ignore[method-assign]

    for owner, name, part in (
        (asyncpg.AsyncAdapt_asyncpg_cursor, "_prepare_and_execute", "db_statement"),
        (asyncpg.AsyncAdapt_asyncpg_connection, "_start_transaction", "db_begin"),
        (asyncpg.AsyncAdapt_asyncpg_connection, "_call_and_discard", "db_commit_or_rollback"),
    ):
        timed(owner, name, functools.partial(probe.part, part))

    def checkout(pool: Any, seconds: float) -> None:
        probe.part(f"db_checkout_pool_{pool.size()}", seconds)

    timed_sync(impl.QueuePool, "_do_get", checkout)


def main(argv: list[str]) -> int:
    """``python -m bench.soak.probe OUT.json [serve arguments]``: ``serve``, recorders on."""
    if not argv:
        print("usage: python -m bench.soak.probe OUT.json", file=sys.stderr)
        return 2
    from bot import gc_tuning, serve
    from core.logs import configure_logging
    from core.settings import load_settings

    probe = SoakProbe(Path(argv[0]))
    probe.install()
    time_the_intake(probe)
    time_the_database(probe)
    original = gc_tuning.tune_garbage_collection
    background: list[asyncio.Task[None]] = []

    def tune_and_record() -> None:
        original()
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, probe.dump_tasks)
        background.append(asyncio.ensure_future(probe.tick()))
        background.append(asyncio.ensure_future(probe.keep_writing()))

    # ``serve`` calls it as it starts (before its worker and listener), by the name it
    # imported: the recorders start on the running loop from there.
    vars(serve)["tune_garbage_collection"] = tune_and_record
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve.serve(settings))
        return 0
    finally:
        probe.write()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

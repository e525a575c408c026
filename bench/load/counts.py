"""What a replica does per turn, counted: ``python -m bench.load.counts OUT.json``.

Started by ``bench.load.turns`` in place of ``python -m bot serve`` when it counts (``turns
… --counts``; with ``--floor`` too, ``… OUT.json bench.load.floor`` counts the floor's server
instead), it runs the same ``serve`` with counters around it and writes them to ``OUT.json``
whenever it receives SIGUSR2; the benchmark asks at the start and at the end of its wave and
divides the difference by the turns run:

- **the event loop's passes** (``BaseEventLoop._run_once``) and the **callbacks** they ran
  (``Handle._run``): how often a turn's work wakes the loop;
- **Slack Web API calls by method** (``AsyncBaseClient.api_call``, which every call of the
  replica's ``AsyncWebClient`` goes through);
- **database transactions**, write and read (``Database.write`` / ``Database.read``), the CPU
  of the thread inside them (``db_*_cpu_us``: a write that waits for the write lock counts what
  the thread ran meanwhile), and the **reads of one statement** run outside any transaction
  (``Prepared.fetch``: ``db_reads_alone``);
- **timers armed** (``call_at``, which ``call_later`` and ``sleep`` use) and **tasks created**.

With ``BENCH_CPROFILE=FILE`` the turns' loop also runs under cProfile from the first SIGUSR2
to the second (the wave alone, no start-up, no warm-up turn), and its statistics go to FILE
(read them with ``python -m pstats FILE``; a deterministic profile inflates small calls, so
read shares and call counts, not milliseconds)::

    BENCH_CPROFILE=turns.prof uv run slack-agent bench turns "" 10 --counts

CPU by thread is read by the benchmark from ``/proc`` (it needs no help from inside). Counting
costs a counter increment per loop pass and per callback, a little CPU the benchmark's
``cpu_ms_per_turn`` includes: compare CPU figures between runs without ``--counts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any


class Counts:
    """The counters of one process; ``install`` before its loop runs."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.counts: Counter[str] = Counter()
        self.answered = 0  # SIGUSR2s answered: the benchmark waits for its own
        # Timers and tasks also by where they were made (``BENCH_COUNT_SITES=1``): slower.
        self.sites = os.environ.get("BENCH_COUNT_SITES") == "1"
        profile_to = os.environ.get("BENCH_CPROFILE")
        self.profile_to = Path(profile_to) if profile_to else None
        # The thread's CPU time, not the clock: the loop's waits in epoll are not the turn's.
        self.profile = cProfile.Profile(time.thread_time_ns, 1e-9) if profile_to else None

    def install(self) -> None:
        from slack_sdk.web.async_base_client import AsyncBaseClient

        from core.storage.engine import Database
        from core.storage.prepared import Prepared

        counts = self.counts
        main = threading.get_ident()

        def count(name: str) -> None:
            counts[name] += 1
            if self.sites:
                counts[f"{name}@{_site()}"] += 1

        base = asyncio.base_events.BaseEventLoop
        run_once, call_at, create_task = base._run_once, base.call_at, base.create_task  # type: ignore[attr-defined]
        handle_run = asyncio.events.Handle._run

        # By loop: the turns' (the main thread's) and the intake's (a thread of its own).
        def counted_run_once(loop: Any) -> None:
            counts["loop_passes" if threading.get_ident() == main else "intake.loop_passes"] += 1
            run_once(loop)

        def counted_handle(handle: asyncio.Handle) -> None:
            counts["callbacks" if threading.get_ident() == main else "intake.callbacks"] += 1
            handle_run(handle)

        def counted_call_at(loop: Any, *args: Any, **kwargs: Any) -> Any:
            count("timers")
            return call_at(loop, *args, **kwargs)

        def counted_create_task(loop: Any, *args: Any, **kwargs: Any) -> Any:
            count("tasks")
            return create_task(loop, *args, **kwargs)

        base._run_once = counted_run_once  # type: ignore[attr-defined]
        base.call_at = counted_call_at  # type: ignore[method-assign,assignment]
        base.create_task = counted_create_task  # type: ignore[method-assign,assignment]
        asyncio.events.Handle._run = counted_handle  # type: ignore[method-assign,assignment]

        api_call = AsyncBaseClient.api_call

        async def counted_api_call(client: Any, api_method: str, **kwargs: Any) -> Any:
            counts[f"slack.{api_method}"] += 1
            return await api_call(client, api_method, **kwargs)

        AsyncBaseClient.api_call = counted_api_call  # type: ignore[method-assign,assignment]

        def counted_transactions(kind: str) -> Any:
            opened = getattr(Database, kind)

            @contextlib.asynccontextmanager
            async def counted(db: Database, **options: bool) -> AsyncIterator[Any]:
                count(f"db_{kind}_transactions")
                # A write that finds this process's write lock taken waits for it, and the
                # thread's CPU meanwhile is other tasks': such writes are counted apart too
                # (``db_write_queued``), and the others split into opening (the lock and
                # BEGIN), the body and closing (the commit).
                queued = kind == "write" and db._write_lock._held
                start = time.thread_time_ns()
                opened_at = body_end = 0
                try:
                    async with opened(db, **options) as conn:
                        opened_at = time.thread_time_ns()
                        yield conn
                        body_end = time.thread_time_ns()
                finally:
                    end = time.thread_time_ns()
                    counts[f"db_{kind}_cpu_us"] += (end - start) // 1000
                    if queued:
                        counts["db_write_queued"] += 1
                        counts["db_write_queued_cpu_us"] += (end - start) // 1000
                    elif body_end:
                        counts[f"db_{kind}_open_cpu_us"] += (opened_at - start) // 1000
                        counts[f"db_{kind}_body_cpu_us"] += (body_end - opened_at) // 1000
                        counts[f"db_{kind}_close_cpu_us"] += (end - body_end) // 1000

            return counted

        Database.write = counted_transactions("write")  # type: ignore[method-assign]
        if os.environ.get("BENCH_SQL_TRACE"):
            _trace_writes(Path(os.environ["BENCH_SQL_TRACE"]))
        Database.read = counted_transactions("read")  # type: ignore[method-assign]

        fetch = Prepared.fetch

        async def counted_fetch(
            statement: Prepared, db: Database, params: dict[str, Any], *, raw: bool = False
        ) -> Sequence[Any]:
            count("db_reads_alone")
            return await fetch(statement, db, params, raw=raw)

        Prepared.fetch = counted_fetch  # type: ignore[method-assign,assignment]

    def write(self) -> None:
        """The counts so far, to ``out``; the first call also starts the profile (if asked
        for), the second stops it and writes it out."""
        partial = self.out.with_suffix(".tmp")
        self.answered += 1
        if self.profile is not None and self.profile_to is not None:
            if self.answered == 1:
                self.profile.enable()  # the signal handler runs on the turns' loop
            elif self.answered == 2:
                self.profile.disable()
                self.profile.dump_stats(self.profile_to)
        partial.write_text(json.dumps({**self.counts, "answered": self.answered}))
        partial.replace(self.out)


def _trace_writes(path: Path) -> None:
    """Every statement of SQLite's inline write transactions, to ``path``, for ``slack-agent
    bench write-replay`` (``bench.load.replay``): one line each, its thread's name, a tab and
    the ``repr`` of

    - what SQLite's trace callback gives (``BEGIN IMMEDIATE``, ``COMMIT``, ``ROLLBACK``, a
      statement sent SQLAlchemy's ordinary way with its values written in, and again each
      statement of a trigger it fires), or, with a ``P`` before the thread's name,
    - a ``Prepared`` statement's SQL and values, just before SQLite's line for it.
    """
    from core.storage.engine import Database
    from core.storage.prepared import Prepared

    out = path.open("w")
    traced: set[int] = set()
    writer_begin, on_sqlite = Database._sqlite_writer_begin, Prepared._on_sqlite

    async def traced_begin(db: Database) -> Any:
        conn = await writer_begin(db)
        raw: Any = conn.connection.dbapi_connection
        if id(raw) not in traced:
            traced.add(id(raw))
            tag = threading.current_thread().name
            raw.set_trace_callback(lambda sql: out.write(f"{tag}\t{sql!r}\n"))
            out.write(f"{tag}\t'BEGIN IMMEDIATE'\n")  # sent before the callback was set
        return conn

    def traced_on_sqlite(
        statement: Prepared, raw: Any, dialect: Any, params: dict[str, Any], *, first: bool
    ) -> Any:
        if id(raw) in traced:
            compiled = statement._compile(dialect)
            sql_values = (compiled.sql, compiled.values(params))
            out.write(f"P{threading.current_thread().name}\t{sql_values!r}\n")
        return on_sqlite(statement, raw, dialect, params, first=first)

    Database._sqlite_writer_begin = traced_begin  # type: ignore[method-assign,assignment]
    Prepared._on_sqlite = traced_on_sqlite  # type: ignore[method-assign,assignment]


def _site() -> str:
    """The first caller outside asyncio, contextlib, this module and the database's own
    plumbing (``Database.autocommit`` and ``Prepared`` open transactions for their callers):
    who armed the timer, made the task, opened the transaction."""
    frame = sys._getframe(2)
    while frame is not None and (
        "/asyncio/" in frame.f_code.co_filename
        or frame.f_code.co_filename in (__file__, contextlib.__file__)
        or frame.f_code.co_filename.endswith(("storage/engine.py", "storage/prepared.py"))
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"


def _answer_sigusr2(counts: Counts) -> None:
    """On the running loop: each SIGUSR2 writes the counts."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, counts.write)


def read_counts(path: Path) -> dict[str, int]:
    """What ``OUT.json`` holds (nothing before the first SIGUSR2 was answered)."""
    try:
        return {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def main(argv: list[str]) -> int:
    """``python -m bench.load.counts OUT.json [bench.load.floor]``: ``serve`` (or the floor
    server) with the counters on."""
    if not argv or argv[1:] not in ([], ["bench.load.floor"]):
        print("usage: python -m bench.load.counts OUT.json [bench.load.floor]", file=sys.stderr)
        return 2
    counts = Counts(Path(argv[0]))
    counts.install()
    if argv[1:]:
        from bench.load import floor

        floor.main(lambda: _answer_sigusr2(counts))
        return 0

    from bot import gc_tuning, serve
    from core.logs import configure_logging
    from core.settings import load_settings

    original = gc_tuning.tune_garbage_collection

    def tune_and_count() -> None:
        original()
        _answer_sigusr2(counts)

    # ``serve`` calls it as it starts, before its listener, by the name it imported (as
    # ``bench.soak.probe`` does): the signal handler is on the running loop from there.
    vars(serve)["tune_garbage_collection"] = tune_and_count
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format)
    asyncio.run(serve.serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``slack-agent soak --profile DIR``: where the time of a soak goes, written to DIR.

What it records, beside the soak's own report:

- every replica through ``bench.soak.probe`` (``replica-N.START.json``): acknowledgements timed
  inside the replica, its loop's lag, its slow steps by task, its garbage collections;
- the soak's own process the same way (``soak.json``): it runs the load generator that times
  the acknowledgements, both stand-ins and the database proxy, so a lagging loop here inflates
  every figure it measures;
- py-spy, sampling from outside (``replica-1.pyspy.txt``, ``soak.pyspy.txt``: collapsed
  stacks, one line a stack and its samples): replica 1 is never killed, so it is profiled for
  the whole load;
- CPU seconds every second by process (``cpu.json``): the replicas, the soak, PostgreSQL (all
  its processes: the server is shared) and the whole machine, with the load average;
- every answer the load generator got (``answers.json``: when, from which replica, status, ms).

``slack-agent bench soak-profile DIR`` prints the summary again from those files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import cpu_times
from bench.soak.load import Answer
from bench.soak.probe import BUCKETS_MS, SoakProbe

PYSPY_RATE = 100  # samples a second
_TICKS = os.sysconf("SC_CLK_TCK")


def pyspy() -> str:
    """The py-spy executable (a dev dependency), or a one-line error naming how to get it."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError("--profile needs py-spy: uv sync (it is a dev dependency)")
    return found


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a process so far (``/proc``), None if it is gone."""
    try:
        return sum(cpu_times(pid))
    except (OSError, IndexError):
        return None


def _scheduled_seconds(pid: int) -> tuple[float, float] | None:
    """Of a process's main thread so far: seconds on a core, and seconds it was runnable but
    waited for one (``schedstat``), None if it is gone."""
    try:
        on_core, waited, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(on_core) / 1e9, int(waited) / 1e9


def _processes_named(name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() == name:
                    found.append(int(entry.name))
    return found


def _load_average() -> str:
    return Path("/proc/loadavg").read_text().strip()


def _machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / _TICKS


def _cpu_row(
    watched: list[tuple[str, int]],
    seen: dict[tuple[str, int], float],
    queued: dict[tuple[str, int], float],
) -> dict[str, Any]:
    """CPU seconds so far: of each watched part (all its processes, gone ones included), this
    process, PostgreSQL's processes alive now, the machine; seconds the main threads waited
    for a core (``NAME waited``); and how many threads are runnable now."""
    for name, pid in watched:
        used = _cpu_seconds(pid)
        if used is not None:
            seen[(name, pid)] = used
    for name, pid in [*watched, ("soak", os.getpid())]:
        scheduled = _scheduled_seconds(pid)
        if scheduled is not None:
            queued[(name, pid)] = scheduled[1]
    running = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("procs_running")
    )
    row: dict[str, Any] = {
        "machine": round(_machine_busy_seconds(), 2),
        "runnable": running,
        "soak": _cpu_seconds(os.getpid()),
        "postgres": round(sum(_cpu_seconds(p) or 0.0 for p in _processes_named("postgres")), 2),
        "load": _load_average().split()[0],
    }
    for name in dict.fromkeys(n for n, _ in watched):
        row[name] = round(sum(v for (n, _), v in seen.items() if n == name), 2)
    for name in dict.fromkeys(n for n, _ in [*watched, ("soak", 0)]):
        row[f"{name} waited"] = round(sum(v for (n, _), v in queued.items() if n == name), 2)
    return row


class SoakProfile:
    """The soak side of ``--profile``: started once the replicas are up, stopped after the load."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.probe = SoakProbe(folder / "soak.json")
        self._tasks: list[asyncio.Task[None]] = []
        self._spies: list[asyncio.subprocess.Process] = []
        self.cpu: list[dict[str, Any]] = []
        self.began_load = ""

    async def start(self, pids: Callable[[], dict[str, int]], seconds: float) -> None:
        """SoakProbe this process, py-spy replica 1 and this process for ``seconds``, count CPU.
        ``pids``: each replica's process now (a killed one is started again as a new one)."""
        self.probe.install()
        self.began_load = _load_average()
        self._tasks += [
            asyncio.create_task(self.probe.tick()),
            asyncio.create_task(self._count_cpu(pids)),
        ]
        spied = {"soak": os.getpid()}
        if "replica-1" in pids():
            spied["replica-1"] = pids()["replica-1"]
        for name, pid in spied.items():
            out = self.folder / f"{name}.pyspy.txt"
            with (self.folder / f"{name}.pyspy.log").open("w") as log:
                spy = await asyncio.create_subprocess_exec(
                    pyspy(),
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(PYSPY_RATE),
                    "--duration",
                    str(int(seconds)),
                    "--format",
                    "raw",
                    "--threads",
                    "--gil",
                    "--nonblocking",
                    "--output",
                    str(out),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log,
                )
            self._spies.append(spy)

    async def _count_cpu(self, pids: Callable[[], dict[str, int]]) -> None:
        """Every second: CPU seconds so far of each part (a replica's processes summed), and
        of the machine."""
        started = time.monotonic()
        seen: dict[tuple[str, int], float] = {}
        queued: dict[tuple[str, int], float] = {}
        while True:
            watched = [*pids().items(), *(("py-spy", spy.pid) for spy in self._spies)]
            row = await asyncio.to_thread(
                _cpu_row, watched, seen, queued
            )  # /proc is a few hundred files
            row["at"] = round(time.monotonic() - started, 1)
            self.cpu.append(row)
            await asyncio.sleep(1.0)

    async def stop(self, answers: list[Answer], recoveries: list[Any]) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for spy in self._spies:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(spy.wait(), 30)
            if spy.returncode is None:
                spy.terminate()
                await spy.wait()
        self.probe.write()
        (self.folder / "cpu.json").write_text(
            json.dumps(
                {
                    "load_before": self.began_load,
                    "load_after": _load_average(),
                    "rows": self.cpu,
                }
            )
        )
        (self.folder / "answers.json").write_text(
            json.dumps(
                {
                    "answers": [asdict(a) for a in answers],
                    "recoveries": [asdict(r) for r in recoveries],
                }
            )
        )


# -- the summary --------------------------------------------------------------------------------


def _histogram_percentile(h: dict[str, Any], q: float) -> str:
    """The bucket bound under which a share ``q`` of the values fell ("≤ 20 ms")."""
    if not h.get("n"):
        return "-"
    wanted = q * h["n"]
    seen = 0
    for bound, count in zip([*h["buckets_ms"], None], h["counts"], strict=True):
        seen += count
        if seen >= wanted:
            return f"≤{bound}" if bound is not None else f">{BUCKETS_MS[-1]}"
    return "-"


def _percentiles(values: list[float]) -> str:
    ordered = sorted(values)
    if not ordered:
        return "none"

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return (
        f"p50 {at(0.5):.0f} p95 {at(0.95):.0f} p99 {at(0.99):.0f} max {ordered[-1]:.0f} ms "
        f"(n {len(ordered)})"
    )


def _client_and_server(folder: Path, answers: list[dict[str, Any]]) -> list[str]:
    """Each replica's acknowledgements as the load generator timed them and as the replica's
    handler did (every answer, whatever its status): the difference is time before the handler
    ran (the request waiting for the replica's loop) and the load generator's own delays."""
    lines = ["  client side against server side (every status), by replica:"]
    for i in sorted({a["replica"] for a in answers if a["replica"] >= 0}):
        timed = [a["ms"] for a in answers if a["replica"] == i and a["status"] != 0]
        server = [
            ms
            for probe in sorted(folder.glob(f"replica-{i}.*.json"))
            for _, ms in json.loads(probe.read_text()).get("ack_handler_samples", [])
        ]
        lines.append(f"    replica-{i} client {_percentiles(timed)}")
        lines.append(f"    replica-{i} server {_percentiles(server)}")
    return lines


def _stacks(path: Path, thread: str = "MainThread") -> Counter[tuple[str, ...]]:
    """py-spy's collapsed stacks (``frame;frame;… count``) of one thread: the turns' event
    loop (``MainThread``) or the intake's (``intake``, ``bot.intake``)."""
    found: Counter[tuple[str, ...]] = Counter()
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = tuple(stack.split(";"))
        if not frames or not frames[0].endswith(f": {thread}"):
            continue
        found[frames[1:]] += int(count)
    return found


def _short(frame: str) -> str:
    """``function (path/to/file.py:12)`` -> ``function (file.py)``: lines apart, one row."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':', 1)[0]}"


# Families of frames a stack is counted under (the first family found from the leaf up).
FAMILIES = (
    ("garbage collection", ("gc_collect", "collect (gc")),
    ("JSON", ("json/", "(json", "orjson")),
    ("SQLAlchemy: building and compiling statements", ("sqlalchemy/sql/",)),
    ("SQLAlchemy: executing and results", ("sqlalchemy/",)),
    ("asyncpg", ("asyncpg",)),
    ("Slack SDK (calls to Slack)", ("slack_sdk/",)),
    ("Bolt (dispatch, listeners)", ("slack_bolt/",)),
    ("aiohttp (HTTP in and out)", ("aiohttp/", "yarl/", "multidict/")),
    ("OpenAI provider", ("openai/", "httpx/", "httpcore/")),
    ("bashkit sandbox", ("bashkit",)),
    ("rendering (bot/render, reply)", ("bot/render", "bot/reply")),
    ("prometheus client", ("prometheus_client",)),
    ("asyncio machinery", ("asyncio/",)),
    ("logging", ("logging/",)),
    ("slack-agent: bot", ("bot/",)),
    ("slack-agent: core", ("core/",)),
    ("slack-agent: bench", ("bench/",)),
)


# What work a sample of the loop belongs to: the first of these whose frames are in its stack.
WORK = (
    (
        "acknowledgements (Listener._events: verify, Bolt, known_thread, record)",
        ("Listener._events",),
    ),
    ("the record's group commit (_GroupCommit._write)", ("_GroupCommit._write",)),
    ("lease upkeep and take-overs (_keep_up)", ("DeliveryWorker._keep_up",)),
    ("the waiting records' watch (_watch_waiting)", ("DeliveryWorker._watch_waiting",)),
    ("turn heartbeats (Turn._beat)", ("Turn._beat",)),
    ("the turns themselves (ThreadAnswers.answer)", ("ThreadAnswers.answer",)),
    (
        "the line's bookkeeping (blocker, waiting in line, reloads, strays, finishing)",
        (
            "DeliveryWorker._wait_in_line",
            "Deliveries.blocker",
            "DeliveryWorker._reload",
            "DeliveryWorker._adopt",
            "DeliveryWorker._wait",
            "DeliveryWorker._start_waiting",
            "DeliveryWorker._finish",
            "_Progress",
            "DeliveryWorker._session_busy",
        ),
    ),
    ("replies streamed on a timer (ReplyStream)", ("ReplyStream",)),
    (
        "the probe itself",
        ("SoakProbe.tick", "SoakProbe.keep_writing", "SoakProbe.write", "timed_method"),
    ),
)


def _work(stack: tuple[str, ...]) -> str | None:
    """The work of a sample; None for SQLAlchemy's greenlets, whose stacks start afresh (py-spy
    sees the greenlet's own stack, not the task that runs it)."""
    if not any("run_forever" in frame for frame in stack):
        return None
    for name, marks in WORK:
        if any(mark in frame for frame in stack for mark in marks):
            return name
    return "the loop itself and other callbacks (transports, futures)"


def _family(stack: tuple[str, ...]) -> str:
    for frame in reversed(stack):
        for family, marks in FAMILIES:
            if any(mark in frame for mark in marks):
                return family
    return "other"


def _pyspy_summary(path: Path, top: int = 15, thread: str = "MainThread") -> list[str]:
    stacks = _stacks(path, thread)
    total = sum(stacks.values())
    if not total:
        return [f"  {path.name} ({thread}): no samples"]
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    families: Counter[str] = Counter()
    work: Counter[str] = Counter()
    greenlets = 0
    for stack, count in stacks.items():
        found = _work(stack)
        if found is None:
            greenlets += count
        else:
            work[found] += count
        if stack:
            leaf[_short(stack[-1])] += count
        for frame in {_short(f) for f in stack}:
            inclusive[frame] += count
        families[_family(stack)] += count
    seconds = total / PYSPY_RATE
    lines = [
        f"  {path.name} ({thread}): {total} samples of the thread holding the GIL "
        f"(~{seconds:.0f} s; "
        "on a busy machine that includes time it waited for a core while holding it)"
    ]
    placed = sum(work.values())
    lines.append(
        f"  by work ({greenlets / total:.0%} of the samples are in SQLAlchemy's greenlets, whose "
        "task py-spy cannot see: the shares are of the rest):"
    )
    lines += [f"    {n / placed:6.1%}  {name}" for name, n in work.most_common()]
    lines.append("  by family (deepest frame that belongs to one):")
    lines += [f"    {n / total:6.1%}  {name}" for name, n in families.most_common()]
    lines.append("  self time, top functions:")
    lines += [f"    {n / total:6.1%}  {name}" for name, n in leaf.most_common(top)]
    lines.append("  inclusive, top functions:")
    lines += [f"    {n / total:6.1%}  {name}" for name, n in inclusive.most_common(top * 2)]
    return lines


def summary(folder: Path) -> str:
    lines = [f"profile in {folder}"]
    answers_file = folder / "answers.json"
    if answers_file.exists():
        data = json.loads(answers_file.read_text())
        ok = [a for a in data["answers"] if a["status"] == 200]
        lines.append(f"acknowledgements, client side (200s): {_percentiles([a['ms'] for a in ok])}")
        by_window: dict[int, list[float]] = {}
        for a in ok:
            by_window.setdefault(int(a["at"] // 10) * 10, []).append(a["ms"])
        lines.append("  by 10 s of the run (when answered):")
        lines += [
            f"    {s:>4}-{s + 10:<4} s {_percentiles(v)}" for s, v in sorted(by_window.items())
        ]
        lines += [f"  fault at {r['at']} s: {r['fault']}" for r in data["recoveries"]]
        lines += _client_and_server(folder, data["answers"])
    for probe_file in sorted(folder.glob("*.json")):
        if probe_file.name in ("answers.json", "cpu.json"):
            continue
        p = json.loads(probe_file.read_text())
        acks = p["ack_handler_ms"]
        lag = p["loop_lag_ms"]
        lines.append(
            f"{probe_file.stem}: cpu {p['cpu_seconds']} s in {p['seconds']} s; "
            f"acks in the handler n {acks['n']} p50 {_histogram_percentile(acks, 0.5)} "
            f"p99 {_histogram_percentile(acks, 0.99)} max {acks['max_ms']} ms; "
            f"loop lag p50 {_histogram_percentile(lag, 0.5)} "
            f"p99 {_histogram_percentile(lag, 0.99)} "
            f"max {lag['max_ms']} ms; gc ms by generation {p['gc_pause_ms_by_generation']}"
        )
        parts = p.get("ack_parts_ms", {})
        handler_ms = acks.get("sum_ms") or 0.0
        shares = [
            f"{name} {parts[name]['sum_ms'] / handler_ms:.0%}"
            for name in ("known_thread", "read_intake_open", "record", "record_insert")
            if name in parts and handler_ms
        ]
        if shares:
            lines.append(f"  of the handler's time (sums): {', '.join(shares)}")
        for part, h in parts.items():
            lines.append(
                f"  {part}: n {h['n']} p50 {_histogram_percentile(h, 0.5)} "
                f"p99 {_histogram_percentile(h, 0.99)} max {h['max_ms']} ms"
            )
        slow_total = sum(p["slow_steps_ms_by_task"].values())
        lines.append(
            f"  steps over 20 ms: {sum(p['slow_steps_by_task'].values())}, "
            f"{slow_total / 1000:.1f} s in all, {p.get('slow_steps_gc_ms', 0.0) / 1000:.1f} s "
            "of it collecting garbage; by task:"
        )
        lines += [
            f"    {ms / 1000:6.1f} s  {p['slow_steps_by_task'][task]:>5} x  {task}"
            for task, ms in list(p["slow_steps_ms_by_task"].items())[:8]
        ]
        longest = sorted(p["slow_steps"], key=lambda s: -s["ms"])[:5]
        lines += [
            f"    longest: {s['ms']} ms (gc {s.get('gc_ms', '?')}) at {s['at']} s, {s['task']} "
            f"(stopped at {s['stopped_at']})"
            for s in longest
        ]
    cpu_file = folder / "cpu.json"
    if cpu_file.exists():
        cpu = json.loads(cpu_file.read_text())
        rows = cpu["rows"]
        if len(rows) > 1:
            first, last = rows[0], rows[-1]
            span = last["at"] - first["at"]
            parts = [
                k
                for k in last
                if k not in ("at", "load") and last[k] is not None and first.get(k) is not None
            ]
            used = {k: last[k] - first[k] for k in parts if k != "runnable" and "waited" not in k}
            used["others"] = used["machine"] - sum(v for k, v in used.items() if k != "machine")
            waited = {
                k.removesuffix(" waited"): last[k] - first[k]
                for k in parts
                if "waited" in k and "py-spy" not in k
            }
            lines.append(
                f"CPU over {span:.0f} s of load (cores busy on average; the machine has "
                f"{os.cpu_count()}): " + ", ".join(f"{k} {v / span:.2f}" for k, v in used.items())
            )
            lines.append(
                "main threads' time runnable but waiting for a core (share of the wall time): "
                + ", ".join(f"{k} {v / span:.0%}" for k, v in waited.items())
            )
        runnable = sorted(r["runnable"] for r in rows if "runnable" in r)
        if runnable:
            lines.append(
                f"threads runnable (sampled each second): median {runnable[len(runnable) // 2]}, "
                f"max {runnable[-1]}"
            )
        lines.append(f"load average before {cpu['load_before']}, after {cpu['load_after']}")
    for spy in sorted(folder.glob("*.pyspy.txt")):
        lines += _pyspy_summary(spy)
        if _stacks(spy, "intake"):
            lines += _pyspy_summary(spy, thread="intake")
    return "\n".join(lines)


def run_part(argv: list[str]) -> None:
    """``slack-agent bench soak-profile DIR``: a soak's profile summarised again."""
    print(summary(Path(argv[0])))

"""``slack-agent soak``: load and faults together, then the product's promises checked.

Several ``serve`` replicas on one database, the Slack stand-in and a stand-in model (both in
this process, on 127.0.0.1), and a load generator sending what Slack would send
(``bench.soak.load``).
While the load runs: Slack answers a share of calls with 429 and 500, the model times out and
cuts streams at the rates given, one replica is killed with SIGKILL and started again, and the
database goes away once (a real restart when a command is given, otherwise every connection cut
for a few seconds through a proxy), and on PostgreSQL one replica is cut off from the
database by a blackhole (nothing forwarded, nothing closed) for longer than the staleness
window while it still reaches Slack and the model. When the load is done and the replicas
have settled, the promises are checked from the database and from what the stand-ins saw:

- every acknowledged message is in its thread's transcript exactly once, answered right after;
- every thread's positions are contiguous;
- no two model calls of one conversation were ever in flight at once;
- no delivery record is left unfinished, expired or failed;
- no reply was posted twice (finished replies per thread = answers in its transcript; a stream
  the killed replica left open is counted apart);
- no 5xx outside the database outage (inside it a 500 is the right answer: Slack sends again),
  nor from the cut-off replica but while it was cut off.

It reports acknowledgement latency, turns per second and how long each fault took to recover
from. Bounded in time; everything stays on 127.0.0.1; the replicas are stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import shlex
import shutil
import signal
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from sqlalchemy import text as sql

from bench.soak.load import CHANNEL, Answer, Plan, Sender
from bench.soak.profile import SoakProfile
from bench.soak.replicas import Replica
from bot import texts as text
from core.conversation.conversations import answers_nothing
from core.errors import SlackAgentError
from core.messages import message_text, slack_message_id
from core.storage.deliveries import Deliveries
from core.storage.engine import create_database
from core.storage.migrate import upgrade
from core.storage.sessions import SessionStore
from standins.openai import ModelFaults, SoakModel
from standins.scripted import Span
from standins.slack import TEAM, SlackFaults, SlackStandIn
from standins.tcp_proxy import TcpProxy

SECRET = "soak-signing-secret"

# The faults a soak can inject, each switched on or off by name (``--faults``): every one by
# default. Switching them off one at a time says which one a figure comes from.
FAULTS = ("slack-429", "slack-500", "model-timeout", "model-cut", "kill", "outage", "blackhole")


class SoakFailed(SlackAgentError):
    """``slack-agent soak`` found a promise broken (its report says which)."""

    code = "soak_failed"


# Every scope and unit, far above what a soak spends (a turn here is about 100 tokens).
ROOMY_BUDGETS: Final = (
    "user:day:1000000000tokens,workspace:day:1000000000tokens,all:month:1000000usd"
)


@dataclass(frozen=True)
class SoakConfig:
    database_url: str
    replicas: int = 3
    threads: int = 200
    messages: int = 2000
    seconds: float = 120.0
    retry_share: float = 0.10
    pair_share: float = 0.30
    slack_faults: SlackFaults = field(
        default_factory=lambda: SlackFaults(rate_limited=0.05, server_error=0.01)
    )
    model_faults: ModelFaults = field(
        default_factory=lambda: ModelFaults(timeout=0.02, cut=0.01, tool=0.25, silence_seconds=6)
    )
    model_timeout_seconds: float = 3.0
    staleness_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    kill_at: float = 0.3  # share of ``seconds``
    restart_after: float = 5.0
    outage_at: float = 0.6  # share of ``seconds``
    outage_seconds: float = 4.0  # proxy outage (no restart command)
    # One replica (the last) cut off from PostgreSQL by a blackhole (nothing forwarded, nothing
    # closed) for longer than the staleness window, while it still reaches Slack and the model:
    # it must stop its turns before another replica takes them over (SPEC's partition rule).
    blackhole_at: float = 0.42  # share of ``seconds``
    blackhole_windows: float = 1.5  # how long, in staleness windows
    restart_command: str | None = (
        None  # e.g. "pg_ctlcluster --skip-systemctl-redirect 15 main restart"
    )
    settle_seconds: float = 120.0  # after the load, at most this long for the last answers
    seed: int = 1
    faults: frozenset[str] = frozenset(FAULTS)  # the ones injected (see ``FAULTS``)
    # The replicas reach PostgreSQL through the soak's TCP proxy: when the outage needs it (no
    # restart command), or always with True (to measure what the proxy itself costs).
    proxy: bool = False
    profile_dir: str | None = None  # ``--profile``: see ``bench.soak.profile``
    # Budgets no turn reaches, so every claim takes the budgeted way (on PostgreSQL the
    # accounts' advisory locks first, then the claim admitting the turn and writing its
    # reservation) while the faults hit, and the promises are checked on it; "" for none.
    budgets: str = ROOMY_BUDGETS


@dataclass
class Recovery:
    fault: str
    at: float
    seconds: float | None  # None: not recovered within the run
    detail: str = ""


@dataclass
class SoakReport:
    config: dict[str, Any]
    sent: int = 0
    distinct_messages: int = 0
    acknowledged: int = 0
    abandoned: int = 0
    answers_2xx: int = 0
    ack_ms: dict[str, float] = field(default_factory=dict)
    # Answers (any status) that took 3 s or more: Slack would have retried each.
    acks_over_3s: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    five_xx_outside_outage: int = 0
    # Answers from the replica cut off from the database (the blackhole), while it was: it can
    # record nothing, so it answers 5xx (Slack sends again) once its database calls time out.
    answers_while_cut_off: int = 0
    acks_over_3s_while_cut_off: int = 0
    turns: int = 0
    turns_per_second: float = 0.0
    model_errors: int = 0
    resumed: int = 0
    cut_off_streams: int = 0  # replies left streaming: must be none
    # replies cut short (a replica died or lost the database mid-reply), closed with a note and
    # followed by the answer picked back up
    closed_for_a_takeover: int = 0
    slack_faults: dict[str, int] = field(default_factory=dict)
    model_faults: dict[str, int] = field(default_factory=dict)
    recoveries: list[Recovery] = field(default_factory=list)
    exit_statuses: list[int | None] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    duration_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {}

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {
        "p50": round(statistics.median(ordered), 2),
        "p95": at(0.95),
        "p99": at(0.99),
        "max": round(ordered[-1], 2),
        "n": len(ordered),
    }


class Soak:
    def __init__(self, config: SoakConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.report = SoakReport(config=_plain(config))
        on = config.faults
        self.slack = SlackStandIn(
            TEAM,
            replace(
                config.slack_faults,
                rate_limited=config.slack_faults.rate_limited if "slack-429" in on else 0.0,
                server_error=config.slack_faults.server_error if "slack-500" in on else 0.0,
            ),
            history=True,
        )
        model_faults = replace(
            config.model_faults,
            timeout=config.model_faults.timeout if "model-timeout" in on else 0.0,
            cut=config.model_faults.cut if "model-cut" in on else 0.0,
        )
        self.model = SoakModel(model_faults, seed=config.seed)
        self.profile = None if config.profile_dir is None else SoakProfile(Path(config.profile_dir))
        self.replicas: list[Replica] = []
        self.outage: tuple[float, float] | None = None  # (start, end), seconds from the start
        self.blackholed: tuple[float, float] | None = None  # the same, for the cut-off replica
        self.hole: TcpProxy | None = None  # the cut-off replica's own path to the database
        self.started = 0.0
        self.plan: Plan | None = None
        self.acknowledged: set[str] = set()

    @property
    def postgres(self) -> bool:
        return urlsplit(self.config.database_url).scheme.startswith("postgres")

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _span(self, span: Span) -> str:
        """A model call's span in the soak's seconds, and the replica that made it."""
        end = "still open" if span.end is None else f"{span.end - self.started:.2f} s"
        who = span.sender.rpartition("sk-soak-")[2] or span.sender
        return f"call {span.number} by {who} from {span.start - self.started:.2f} s to {end}"

    async def run(self) -> SoakReport:
        c = self.config
        db = create_database(c.database_url)
        await upgrade(db)  # once, before the replicas (they would migrate one at a time too)
        await self.slack.start()
        await self.model.start()
        parts = urlsplit(c.database_url)
        proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
        try:
            # The replicas stop before the proxy closes: a replica still working when the load
            # ends (a run that did not settle) must not lose its database while it stops.
            async with proxy, contextlib.AsyncExitStack() as replicas:
                replica_url = c.database_url
                outage_by_proxy = "outage" in c.faults and c.restart_command is None
                if self.postgres and (outage_by_proxy or c.proxy):
                    replica_url = _through(c.database_url, proxy.port)
                urls = [replica_url] * c.replicas
                if self.postgres and "blackhole" in c.faults:
                    # The last replica's own path, in front of whatever the others use (entered
                    # before the replicas' stop below, so it outlives them).
                    ahead = urlsplit(replica_url)
                    self.hole = await replicas.enter_async_context(
                        TcpProxy(ahead.hostname or "127.0.0.1", ahead.port or 5432)
                    )
                    urls[-1] = _through(c.database_url, self.hole.port)
                replicas.push_async_callback(self._stop_replicas)
                self.replicas = [
                    Replica(
                        f"replica-{i}",
                        # Its own model key: the model's stand-in tells the replicas apart.
                        self._env(url) | {"OPENAI_API_KEY": f"sk-soak-replica-{i}"},
                        self.workdir / f"replica-{i}.log",
                        probe=None if self.profile is None else self.profile.folder,
                    )
                    for i, url in enumerate(urls)
                ]
                await asyncio.gather(*(r.start() for r in self.replicas))
                await asyncio.gather(*(r.ready() for r in self.replicas))
                await self._drive(db, proxy)
        finally:
            await self.model.stop()
            await self.slack.stop()
        await self._check(db)
        await db.dispose()
        return self.report

    async def _stop_replicas(self) -> None:
        statuses = await asyncio.gather(*(r.stop() for r in self.replicas))
        self.report.exit_statuses = list(statuses)

    def _env(self, database_url: str) -> dict[str, str]:
        c = self.config
        return {
            "DATABASE_URL": database_url,
            "SLACK_BOT_TOKEN": "xoxb-soak",
            "SLACK_SIGNING_SECRET": SECRET,
            "SLACK_API_URL": self.slack.api_url,
            "MODEL_PROVIDER": "openai",
            "OPENAI_API_KEY": "sk-soak",
            "OPENAI_BASE_URL": self.model.base_url,
            "MODEL_TIMEOUT_SECONDS": str(c.model_timeout_seconds),
            "TURN_LOCK_STALENESS_SECONDS": str(c.staleness_seconds),
            "TURN_HEARTBEAT_SECONDS": str(c.heartbeat_seconds),
            "BUSY_MODE": "queue",
            "BUSY_POLL_SECONDS": "0.5",
            "SHUTDOWN_GRACE_SECONDS": "10",
            "LOG_LEVEL": "WARNING",
            "BUDGETS": c.budgets,
            # A replica that crashes in native code (exit -11) says where, in its log.
            "PYTHONFAULTHANDLER": "1",
        }

    async def _drive(self, db: Any, proxy: TcpProxy) -> None:
        c = self.config
        plan = Plan.make(
            threads=c.threads,
            messages=c.messages,
            seconds=c.seconds,
            retry_share=c.retry_share,
            pair_share=c.pair_share,
            seed=c.seed,
        )
        self.plan = plan
        self.report.sent = len(plan.sends)
        self.report.distinct_messages = len(plan.messages)
        self.started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=200)
        async with aiohttp.ClientSession(connector=connector) as http:
            sender = Sender(
                [r.url for r in self.replicas],
                SECRET,
                started=self.started,
                posted=lambda send: self.slack.user_post(
                    CHANNEL,
                    send.user,
                    send.text,
                    None if send.thread_ts == send.ts else send.thread_ts,
                    send.ts,
                ),
            )
            if self.profile is not None:
                await self.profile.start(self._pids, c.seconds)
            load = asyncio.create_task(sender.run(plan, http))
            faults = asyncio.create_task(self._faults(db, proxy, http))
            await load
            await faults
            settled = await self._settle(db)
            if not settled and self.profile is not None:
                for replica in self.replicas:  # where their tasks wait (``bench.soak.probe``)
                    replica.signal(signal.SIGUSR1)
                await asyncio.sleep(1.0)
            if self.profile is not None:
                await self.profile.stop(sender.answers, self.report.recoveries)
        self.report.duration_seconds = round(self._elapsed(), 1)
        self.report.acknowledged = len(sender.acknowledged)
        self.report.abandoned = len(sender.abandoned - sender.acknowledged)
        ok = [a.ms for a in sender.answers if a.status == 200]
        self.report.answers_2xx = len(ok)
        self.report.ack_ms = _percentiles(ok)
        self.report.acks_over_3s = sum(1 for a in sender.answers if a.ms >= 3000)
        self.report.status_counts = {
            str(k): v for k, v in Counter(a.status for a in sender.answers).items()
        }
        self.report.five_xx_outside_outage = sum(
            1 for a in sender.answers if a.status >= 500 and not self._in_outage(a)
        )
        cut_off = [a for a in sender.answers if self._cut_off(a)]
        self.report.answers_while_cut_off = len(cut_off)
        self.report.acks_over_3s_while_cut_off = sum(1 for a in cut_off if a.ms >= 3000)
        self.acknowledged = sender.acknowledged
        if not settled:
            self.report.violations.append("the replicas did not settle within settle_seconds")
            if self.postgres:
                self.report.violations += await database_sessions(db)

    def _in_outage(self, answer: Answer) -> bool:
        """Sent to a replica that could not reach the database then: a 5xx is its right answer
        (Slack sends again)."""
        window = self.outage or (0.0, 0.0)
        return window[0] - 1 <= answer.at <= window[1] + 5 or self._cut_off(answer)

    def _cut_off(self, answer: Answer) -> bool:
        """Answered by the blackholed replica while (or just after) it was cut off."""
        if self.blackholed is None or answer.replica != len(self.replicas) - 1:
            return False
        begun, ended = self.blackholed
        return begun <= answer.at <= ended + 5

    def _pids(self) -> dict[str, int]:
        return {r.name: r.proc.pid for r in self.replicas if r.proc is not None}

    async def _faults(self, db: Any, proxy: TcpProxy, http: aiohttp.ClientSession) -> None:
        blackhole = None
        if self.hole is not None:
            blackhole = asyncio.create_task(self._blackhole(self.hole, db, http))
        await self._kill_then_outage(db, proxy, http)
        if blackhole is not None:
            await blackhole

    async def _kill_then_outage(
        self, db: Any, proxy: TcpProxy, http: aiohttp.ClientSession
    ) -> None:
        c = self.config
        await asyncio.sleep(c.seconds * c.kill_at)
        if "kill" in c.faults:
            await self._kill(db)
        await asyncio.sleep(max(0.0, c.seconds * c.outage_at - self._elapsed()))
        if self.postgres and "outage" in c.faults:
            await self._database_outage(proxy, http)

    async def _kill(self, db: Any) -> None:
        victim = self.replicas[0]
        owner = await victim.owner()
        killed_at = self._elapsed()
        victim.kill()
        deliveries = Deliveries(db, "slack")
        restart = asyncio.create_task(self._restart(victim))
        held = await deliveries.count_owned_by(owner)
        recovered = await self._until(lambda: deliveries.count_owned_by(owner), lambda n: n == 0)
        self.report.recoveries.append(
            Recovery(
                "replica killed (SIGKILL) mid-turn",
                round(killed_at, 1),
                None if recovered is None else round(recovered - killed_at, 2),
                f"{held} delivery records it held were taken over and carried on",
            )
        )
        await restart

    async def _restart(self, victim: Replica) -> None:
        assert victim.proc is not None
        await victim.proc.wait()
        await asyncio.sleep(self.config.restart_after)
        await victim.start()
        with contextlib.suppress(RuntimeError):
            await victim.ready()

    async def _blackhole(self, hole: TcpProxy, db: Any, http: aiohttp.ClientSession) -> None:
        """The last replica cut off from the database (nothing forwarded, nothing closed) for
        longer than the staleness window. That it stopped its turns before the others took them
        over is checked at the end: never two model calls at once for a session, and every
        answer shown once."""
        c = self.config
        await asyncio.sleep(max(0.0, c.seconds * c.blackhole_at - self._elapsed()))
        victim = self.replicas[-1]
        owner = await victim.owner()
        deliveries = Deliveries(db, "slack")
        held = await deliveries.count_owned_by(owner)
        lasting = c.staleness_seconds * c.blackhole_windows
        begun = self._elapsed()
        hole.blackhole()
        taken = await self._until(
            lambda: deliveries.count_owned_by(owner), lambda n: n == 0, within=lasting
        )
        await asyncio.sleep(max(0.0, begun + lasting - self._elapsed()))
        hole.restore()
        ended = self._elapsed()
        self.blackholed = (begun, ended)
        healthy = await self._until(lambda: victim.healthy(http), bool)
        self.report.recoveries.append(
            Recovery(
                f"{victim.name} cut off from the database for {lasting:g} s (a blackhole)",
                round(begun, 1),
                None if healthy is None else round(healthy - ended, 2),
                "seconds from the path's return until its /healthz is 200; the "
                f"{held} delivery records it held were "
                + (
                    f"all taken over {round(taken - begun, 1)} s after the cut"
                    if taken is not None
                    else "not all taken over while it was cut off"
                ),
            )
        )

    async def _database_outage(self, proxy: TcpProxy, http: aiohttp.ClientSession) -> None:
        c = self.config
        begun = self._elapsed()
        stops_before = self._finished_replies()
        if c.restart_command is not None:
            process = await asyncio.create_subprocess_exec(*shlex.split(c.restart_command))
            await process.wait()
            label = f"PostgreSQL restarted ({c.restart_command})"
        else:
            proxy.cut()
            await asyncio.sleep(c.outage_seconds)
            proxy.restore()
            label = f"database unreachable for {c.outage_seconds:g} s (every connection cut)"
        ended = self._elapsed()
        self.outage = (begun, ended)

        async def all_healthy() -> bool:
            answers = await asyncio.gather(*(r.healthy(http) for r in self.replicas))
            return all(answers)

        healthy = await self._until(all_healthy, bool)
        answering = await self._until(self._replies_now, lambda n: n > stops_before)
        self.report.recoveries.append(
            Recovery(
                label,
                round(begun, 1),
                None if healthy is None else round(healthy - ended, 2),
                "seconds from the database's return until every replica's /healthz is 200; "
                + (
                    "first reply after it " + f"{round(answering - ended, 2)} s"
                    if answering is not None
                    else "no reply after it"
                ),
            )
        )

    async def _until(self, probe: Any, done: Any, within: float = 120.0) -> float | None:
        """Seconds from the start at which ``done(await probe())`` first held, or None."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                if done(await probe()):
                    return self._elapsed()
            except Exception:  # the database may be the thing that is down
                pass
            await asyncio.sleep(0.2)
        return None

    async def _replies_now(self) -> int:
        return self._finished_replies()

    def _finished_replies(self) -> int:
        return len(self.slack.named("chat.stopStream"))

    async def _settle(self, db: Any) -> bool:
        """Wait until nothing is left to do: no unfinished delivery record."""
        deliveries = Deliveries(db, "slack")

        async def unfinished() -> int:
            return sum(c.count for c in await deliveries.counts())

        return (
            await self._until(unfinished, lambda n: n == 0, self.config.settle_seconds) is not None
        )

    async def _check(self, db: Any) -> None:
        report, v = self.report, self.report.violations
        store = SessionStore(db)
        deliveries = Deliveries(db, "slack")
        left = await deliveries.counts()
        if left:
            v.append(
                f"unfinished delivery records: {[(c.state, c.wait_reason, c.count) for c in left]}"
            )
        if self.model.overlapping():
            v.append(f"two model calls at once for: {sorted(self.model.overlapping())}")
            for key in sorted(self.model.overlapping()):
                for a, b in self.model.overlaps(key):
                    v.append(f"  {key}: {self._span(a)} and {self._span(b)}")
        report.model_faults = dict(self.model.injected)
        report.slack_faults = dict(self.slack.injected)
        if report.five_xx_outside_outage:
            v.append(f"{report.five_xx_outside_outage} answers of 5xx outside the database outage")
        if any(status not in (0, None) for status in report.exit_statuses):
            v.append(f"a replica did not stop cleanly: exit statuses {report.exit_statuses}")
        threads: dict[str, list[str]] = {}
        for ts in self.acknowledged:
            threads.setdefault(self._thread_of(ts), []).append(ts)
        answers = 0
        for root in sorted(threads):
            session = await store.find_session("slack", f"{TEAM}/{CHANNEL}/{root}")
            if session is None:
                v.append(f"thread {root}: no session")
                continue
            messages = await store.messages(session.id)
            if [m.position for m in messages] != list(range(len(messages))):
                v.append(f"thread {root}: positions not contiguous")
            ids = [m.message_id for m in messages]
            for ts in threads[root]:
                wanted = slack_message_id(TEAM, CHANNEL, ts)
                if ids.count(wanted) != 1:
                    v.append(f"message {ts}: stored {ids.count(wanted)} times")
                    continue
                after = ids.index(wanted) + 1
                # Answered: an answer that says something follows it, before the next message
                # (an answer interrupted before its model said anything answers nothing: the
                # message is answered again after it).
                following = itertools.takewhile(lambda m: m.role == "assistant", messages[after:])
                if all(answers_nothing(m) for m in following):
                    v.append(f"message {ts}: not answered")
                    v += self._around(messages, after - 1, ts)
            thread_answers = [
                m for m in messages if m.role == "assistant" and not answers_nothing(m)
            ]
            answers += len(thread_answers)
            report.model_errors += sum(
                1 for m in thread_answers if (m.message.get("metadata") or {}).get("error")
            )
            replies = [
                p
                for p in self.slack.thread(CHANNEL, root)
                if p.author == "agent" and p.visible_to is None and p.ts != root
            ]
            open_streams = [p.ts for p in replies if p.streaming]
            report.cut_off_streams += len(open_streams)
            if open_streams:
                v.append(f"thread {root}: replies {open_streams} left streaming")
                v += self._left_open(root, replies, open_streams, messages, threads[root])
            # Replies that say they were interrupted (by a take-over, a failure, a stop): what
            # they showed is answered again, or kept, elsewhere.
            marks = (text.cut_short(), text.will_retry(), text.shut_down())
            interim = [p for p in replies if any(mark in p.text for mark in marks)]
            report.closed_for_a_takeover += len(interim)
            # Each answer shown once: a reply whose stream broke goes on in a message of its
            # own (nothing lost), so answers are matched by their text across the thread's
            # replies, not by counting messages.
            thread_text = "".join(p.text for p in replies if p not in interim)
            shown = Counter(_ANSWERED.findall(thread_text))
            stored = Counter(
                found
                for m in thread_answers
                for found in _ANSWERED.findall(message_text(m.message))
            )
            if shown != stored:
                v.append(
                    f"thread {root}: answers shown {sum(shown.values())} times for "
                    f"{sum(stored.values())} answers ({sorted((shown - stored).elements())} "
                    f"more, {sorted((stored - shown).elements())} missing)"
                )
                ts_of = {slack_message_id(TEAM, CHANNEL, ts): ts for ts in threads[root]}
                for extra in sorted(set(shown - stored)):
                    v += self._shown_twice(extra, replies, messages, ts_of)
        report.turns = answers
        report.resumed = sum(
            1
            for call in self.slack.calls
            if text.resumed() in str(call.args.get("markdown_text") or call.args.get("text") or "")
        )
        busy = self.config.seconds + self.config.settle_seconds
        report.turns_per_second = round(answers / max(1.0, min(busy, report.duration_seconds)), 2)
        for recovery in report.recoveries:
            if recovery.seconds is None:
                v.append(f"not recovered: {recovery.fault}")

    def _around(self, messages: list[Any], at: int, ts: str) -> list[str]:
        """The transcript around an unanswered message, and what the replicas logged of it."""
        return _transcript(messages[max(0, at - 2) : at + 4]) + self._logged(ts)

    def _logged(self, ts: str) -> list[str]:
        """The replicas' last log lines about the message ``ts``."""
        lines = []
        for log in sorted(self.workdir.glob("*.log")):
            mentions = [ln for ln in log.read_text().splitlines() if ts in ln]
            lines += [f"  {log.name}: {ln[:300]}" for ln in mentions[-20:]]
        return lines

    def _left_open(
        self,
        root: str,
        replies: list[Any],
        open_streams: list[str],
        messages: list[Any],
        asked: list[str],
    ) -> list[str]:
        """Where a reply left streaming came from: every Web API call about the thread (on
        its root, or on one of its replies), those answered with an injected fault included,
        in the soak's seconds; the transcript's last messages; what the replicas logged of the
        thread's messages and of the reply."""
        about = {root, *(p.ts for p in replies)}
        calls = sorted(
            (
                c
                for c in [*self.slack.calls, *self.slack.faulted]
                if about & {c.args.get("thread_ts"), c.args.get("ts"), c.result.get("ts")}
            ),
            key=lambda c: c.at,
        )
        lines = [
            f"  {c.at - self.started:7.2f} s {c.method} ts={c.args.get('ts') or c.result.get('ts')}"
            f" ok={c.result.get('ok')} {c.result.get('error') or ''} text=…{c.text[-60:]!r}"
            for c in calls
        ]
        lines += _transcript(messages[-6:])
        for ts in [*asked, *open_streams]:
            lines += self._logged(ts)
        return lines

    def _shown_twice(
        self,
        answer: str,
        replies: list[Any],
        messages: list[Any],
        ts_of: dict[str, str],
    ) -> list[str]:
        """Where an answer shown more often than stored was shown: the replies holding it, the
        Web API calls that wrote them (in order), the stored answers holding it and the user
        message before each, and what the replicas logged about that message."""
        shown = [p for p in replies if answer in p.text]
        lines = [
            f"  shown in reply {p.ts} (streaming={p.streaming}): …{p.text[-160:]!r}" for p in shown
        ]
        holding = {p.ts for p in shown}
        for i, call in enumerate(self.slack.calls):
            ts = call.args.get("ts") or call.result.get("ts")
            if ts in holding:
                lines.append(
                    f"  call #{i} {call.method} ts={ts} ok={call.result.get('ok')} "
                    f"{call.result.get('error') or ''} text=…{call.text[-80:]!r}"
                )
        for at, m in enumerate(messages):
            if m.role != "assistant" or answer not in message_text(m.message):
                continue
            asked = next((u for u in reversed(messages[:at]) if u.role == "user"), None)
            ts = ts_of.get(asked.message_id, "?") if asked is not None else "?"
            lines.append(
                f"  stored at position {m.position} with {m.message.get('metadata')}, "
                f"answering message {ts}"
            )
            lines += self._logged(ts)
        return lines

    def _thread_of(self, ts: str) -> str:
        return self.plan.messages.get(ts, ts) if self.plan else ts


def _transcript(messages: list[Any]) -> list[str]:
    """Stored messages, a line each, for a violation's report."""
    lines = []
    for m in messages:
        metadata = m.message.get("metadata") or {}
        lines.append(
            f"  {m.position} {m.role} {message_text(m.message)[:60]!r} "
            f"interrupted_by={metadata.get('interrupted_by')} error={metadata.get('error')}"
        )
    return lines


# What the stand-in model answers (``standins.openai.SoakModel``): one per finished answer.
_ANSWERED = re.compile(r"\(t\d+\) answered after \d+ messages\.")


def _through(database_url: str, port: int) -> str:
    """``database_url`` by way of a proxy on 127.0.0.1:``port``."""
    parts = urlsplit(database_url)
    netloc = f"{parts.username or 'postgres'}@127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _plain(config: SoakConfig) -> dict[str, Any]:
    plain = {
        k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
        for k, v in asdict(config).items()
    }
    plain["faults"] = [f for f in FAULTS if f in config.faults]
    return plain


async def run_soak(config: SoakConfig) -> SoakReport:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        soak = Soak(config, Path(tmp))
        try:
            report = await soak.run()
        except Exception:
            print(await asyncio.to_thread(_logs, Path(tmp)))
            raise
        else:
            if not report.ok:  # what the replicas said, for the promise that broke
                print(await asyncio.to_thread(_logs, Path(tmp)))
            return report
        finally:
            if config.profile_dir is not None:  # the replicas' logs go with their profile
                await asyncio.to_thread(_keep_logs, Path(tmp), Path(config.profile_dir))


def _keep_logs(folder: Path, into: Path) -> None:
    for log in folder.glob("*.log"):
        shutil.copy(log, into / log.name)


def _logs(folder: Path) -> str:
    """The replicas' logs, for a run that failed."""
    return "\n".join(
        f"--- {log.name} ---\n{log.read_text()[-4000:]}" for log in sorted(folder.glob("*.log"))
    )


QUICK = {"messages": 300, "threads": 30, "seconds": 40.0}


def parse_faults(value: str) -> frozenset[str]:
    """``--faults``: ``all``, ``none``, names from ``FAULTS`` separated by commas (only those),
    or ``all`` followed by names with a leading ``-`` (all but those: ``all,-outage``)."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    every = names[:1] == ["all"]
    rest = names[1:] if every else names
    if every and any(not n.startswith("-") for n in rest):
        raise ValueError("after all, only faults to take away (all,-outage,-kill)")
    if not every and any(n.startswith("-") for n in rest):
        raise ValueError("a fault to take away follows all (all,-outage)")
    chosen = {n.removeprefix("-") for n in rest}
    unknown = sorted(chosen - set(FAULTS))
    if unknown or not names:
        raise ValueError(
            f"unknown fault {unknown[0] if unknown else value!r}: "
            f"use all, none, some of {', '.join(FAULTS)}, or all,-NAME"
        )
    return frozenset(FAULTS) - chosen if every else frozenset(chosen)


def soak_config(database_url: str, args: Any) -> SoakConfig:
    """The configuration ``slack-agent soak`` runs with, from its arguments."""
    sizes: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in ("messages", "threads", "seconds"):
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    return SoakConfig(
        database_url=database_url,
        replicas=args.replicas,
        restart_command=args.restart_command,
        seed=args.seed,
        faults=args.faults,
        proxy=args.proxy,
        profile_dir=args.profile,
        budgets=ROOMY_BUDGETS if args.budgets is None else args.budgets,
        **sizes,
    )


def format_report(report: SoakReport) -> str:
    r = report
    lines = [
        f"soak: {r.config['replicas']} replicas, {r.distinct_messages} messages in "
        f"{r.config['threads']} threads over {r.config['seconds']:g} s "
        f"({r.sent} deliveries with retries and doubles); ran {r.duration_seconds:g} s",
        f"acknowledged {r.acknowledged}, abandoned by 'Slack' {r.abandoned}; answers by status "
        f"{r.status_counts}",
        f"ack latency (200s): {r.ack_ms}; answers taking 3 s or more (Slack retries those): "
        f"{r.acks_over_3s}"
        + (
            f" ({r.acks_over_3s_while_cut_off} of them from the replica cut off from the "
            f"database, of its {r.answers_while_cut_off} answers then)"
            if r.answers_while_cut_off
            else ""
        ),
        f"turns {r.turns} ({r.turns_per_second:g}/s), model errors shown {r.model_errors}, "
        f"resumed after a take-over {r.resumed}, replies cut short and closed with a note "
        f"(a dead replica's, or one that lost the database) {r.closed_for_a_takeover}, "
        f"left cut off {r.cut_off_streams}",
        f"faults injected: Slack {r.slack_faults}, model {r.model_faults}"
        + (
            f" (switched off: {', '.join(sorted(off))})"
            if (off := set(FAULTS) - set(r.config["faults"]))
            else ""
        ),
    ]
    for rec in r.recoveries:
        took = "not recovered" if rec.seconds is None else f"recovered in {rec.seconds:g} s"
        lines.append(f"fault at {rec.at:g} s: {rec.fault}: {took} ({rec.detail})")
    lines.append(f"replicas stopped with {r.exit_statuses}")
    if r.ok:
        lines.append("every promise held")
    else:
        lines.append(f"BROKEN ({len(r.violations)}):")
        lines += [f"  - {violation}" for violation in r.violations[:50]]
    return "\n".join(lines)


# The database's own sessions that are not idle: what holds or waits for locks when the replicas
# cannot settle (every replica's connections are bounded by statement and idle-in-transaction
# timeouts, so a session here for long is the bug to look at).
_BUSY_SESSIONS = sql(
    "SELECT pid, application_name, state, wait_event_type, wait_event,"
    " round(extract(epoch FROM now() - xact_start)::numeric, 1) AS in_transaction_s,"
    " (SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted) AS waiting_locks,"
    " left(query, 160) AS query"
    " FROM pg_stat_activity a"
    " WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'"
    " ORDER BY xact_start"
)


async def database_sessions(db: Any) -> list[str]:
    """One line per PostgreSQL session of the soak's database that is not idle (what it
    runs, how long its transaction is open, whether it waits for a lock), for a soak whose
    replicas did not settle."""
    async with db.read() as conn:
        rows = (await conn.execute(_BUSY_SESSIONS)).all()
    return [
        f"database session {r.pid} ({r.application_name or 'no name'}): {r.state}, "
        f"transaction open {r.in_transaction_s} s, waiting for {r.wait_event_type or '-'}"
        f"/{r.wait_event or '-'}, {r.waiting_locks} lock(s) not granted: {r.query}"
        for r in rows
    ]

"""What usage, budgets and traces cost a turn.

- ``tracing``: a whole agent turn (the offline model, no sleeps, so the turn's own work is all
  there is to measure: claim, history, model stream, pricing, the usage ledger's row, storing
  the answer; sessions of up to ``HISTORY`` messages) with tracing off, on with a live local
  collector (the OTLP stand-in), and on with a collector nobody listens at. Modes take turns
  round by round, so drift on a shared machine falls on all three alike. Export runs on the
  SDK's batch thread; what a turn pays is building its spans and queueing them (and, on a
  machine short of cores, the batch thread's share of the interpreter).
- ``budget_check``: a turn's bookkeeping (``run_turn``: claim, user message, the answer's one
  ledger row, answer, release; no model) without budgets and with three (user, workspace,
  shared), on an empty ledger and on one of ``LEDGER_ROWS`` requests this month: the check and
  reservation inside the claim transaction, read from running totals (issue 35: at most 1.2x
  without, whatever the ledger). ``slack-agent bench budget-check [URL|- [ROWS]]`` runs
  it alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from bench.common import database, summarize
from core.agent.accounting import Accounting, Attribution, Payer
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.agent.turn import run_turn
from core.messages import assistant_message, user_message
from core.providers.base import Usage
from core.settings import Settings, load_settings
from core.storage.budgets import Budgets
from core.storage.engine import Database
from core.storage.migrate import upgrade
from core.storage.sessions import SessionStore
from core.storage.usage import LedgerEntry, UsageLedger
from core.tracing.spans import Tracer
from core.usage.budgets import parse_budgets
from core.usage.totals import RequestUsage
from standins.otlp import OtlpReceiver
from standins.processes import free_port

PAYER = Payer("slack:T1:U1", "T1")
HISTORY = 20  # the most messages a measured turn's session holds before it
BUDGETS = "user:day:1000000000tokens,workspace:month:1000000usd,all:month:1000000usd"
LEDGER_ROWS = 100_000  # the ledger a budget check must not slow down with (issue 35)


def _tracer(endpoint: str) -> Tracer:
    # A short export timeout, so the unreachable collector's batches fail fast as configured.
    return Tracer.from_settings(
        load_settings(otel_exporter_otlp_traces_endpoint=endpoint, otel_exporter_otlp_timeout=500)
    )


async def _rounds(
    samples: int, warmup: int, modes: dict[str, Callable[[], Awaitable[object]]]
) -> dict[str, list[float]]:
    """Each mode once per round, in turn; ``warmup`` rounds are not kept."""
    loop = asyncio.get_running_loop()
    times: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(warmup + samples):
        for name, operation in modes.items():
            start = loop.time()
            await operation()
            if round_ >= warmup:
                times[name].append(loop.time() - start)
    return times


def _ratio(times: dict[str, Any], name: str) -> float:
    return round(float(times[name]["p50"]) / float(times["off"]["p50"]), 3)


async def bench_observability(database_url: str | None, *, quick: bool = False) -> dict[str, Any]:
    samples, warmup = (60, 10) if quick else (300, 30)
    async with database(database_url) as (db, _temporary):
        await upgrade(db)
        store = SessionStore(db)
        ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
        cache = ProviderCache(Settings(model_provider="offline"))
        result: dict[str, Any] = {"database": db.dialect}
        try:
            result["tracing"] = await _tracing(store, ledger, cache, samples, warmup)
        finally:
            await cache.aclose()
    result["budget_check"] = await bench_budget_check(
        database_url, samples=samples, warmup=warmup, ledger_rows=2_000 if quick else LEDGER_ROWS
    )
    return result


async def bench_budget_check(
    database_url: str | None,
    *,
    samples: int = 300,
    warmup: int = 30,
    ledger_rows: int = LEDGER_ROWS,
) -> dict[str, Any]:
    """A turn's bookkeeping with three budgets against without, on an empty ledger and then
    with ``ledger_rows`` requests of this month in it (``budget_check`` in the result)."""
    async with database(database_url) as (db, _temporary):
        await upgrade(db)
        store = SessionStore(db)
        ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
        result: dict[str, Any] = {"database": db.dialect}
        result.update(await _budget_check(db, store, ledger, samples, warmup))
        result["ledger_rows"] = await _seed(ledger, ledger_rows)
        result.update(await _budget_check(db, store, ledger, samples, warmup, seeded=True))
        for suffix in ("", "_seeded"):
            with_, without = result[f"with_budgets{suffix}"], result[f"without_budgets{suffix}"]
            result[f"ratio_p50{suffix}"] = round(with_["p50"] / without["p50"], 3)
            result[f"ratio_p95{suffix}"] = round(with_["p95"] / without["p95"], 3)
    return result


async def _tracing(
    store: SessionStore, ledger: UsageLedger, cache: ProviderCache, samples: int, warmup: int
) -> dict[str, Any]:
    async with OtlpReceiver() as collector:
        tracers = {
            "off": Tracer.off(),
            "live_collector": _tracer(collector.endpoint),
            "unreachable_collector": _tracer(f"http://127.0.0.1:{free_port()}/v1/traces"),
        }
        modes: dict[str, Callable[[], Awaitable[object]]] = {}
        for name, tracer in tracers.items():
            agent = Agent(
                store,
                cache,
                AgentConfig(auto_compact_tokens=0),
                accounting=Accounting(ledger, None, tracer),
            )
            modes[name] = _agent_turn(agent, name)
        times = await _rounds(samples, warmup, modes)
        received = len(collector.spans)
        for tracer in tracers.values():
            await asyncio.to_thread(tracer.shutdown, 2.0)
    out: dict[str, Any] = {name: summarize(values) for name, values in times.items()}
    out["live_vs_off_p50"] = _ratio(out, "live_collector")
    out["unreachable_vs_off_p50"] = _ratio(out, "unreachable_collector")
    out["spans_received"] = received
    return out


def _agent_turn(agent: Agent, name: str) -> Callable[[], Awaitable[object]]:
    """Turns in sessions of up to ``HISTORY`` messages (a new one every ``HISTORY / 2``
    turns), so each mode's turns carry the same history whatever the number of samples."""
    made = 0

    async def one() -> None:
        nonlocal made
        store = agent.store
        user_id = await store.get_or_create_user(PAYER.user)
        key = f"tracing/{name}/{made // (HISTORY // 2)}"
        made += 1
        session, _ = await store.get_or_create_session("bench", key, user_id=user_id)
        session_id = session.id
        tail = await agent.store.tail(session_id)
        result = await agent.run_turn(
            session_id,
            user_message=user_message("what is in the sandbox?"),
            last_message_id=tail.message_id if tail else None,
            attribution=Attribution("bench", PAYER),
        )
        if result.error is not None:
            raise RuntimeError(f"bench turn failed: {result.error}")

    return one


async def _seed(ledger: UsageLedger, rows: int) -> int:
    """``rows`` requests this month, spread over 50 people of 5 workspaces and the measured
    payer (whose accounts the check reads)."""
    request = RequestUsage(
        "openai",
        "gpt-4.1-mini",
        Usage(1200, 80, 1000),
        None,
    )
    payers = [PAYER, *(Payer(f"slack:T{i % 5}:U{i}", f"T{i % 5}") for i in range(50))]
    batch = [
        LedgerEntry(request, "answer", 1280, False, payer=payers[i % len(payers)])
        for i in range(rows)
    ]
    for start in range(0, rows, 1000):
        await ledger.record_many(batch[start : start + 1000])
    return rows


async def _budget_check(
    db: Database,
    store: SessionStore,
    ledger: UsageLedger,
    samples: int,
    warmup: int,
    *,
    seeded: bool = False,
) -> dict[str, Any]:
    user_id = await store.get_or_create_user("slack:T1:U1")
    request = RequestUsage("openai", "gpt-4.1-mini", Usage(1200, 80, 1000), None)

    def bookkeeping(name: str, with_budgets: bool) -> Callable[[], Awaitable[object]]:
        # Both read the budgets in force, as every claim does; without, none are set.
        accounting = Accounting(ledger, Budgets(db, parse_budgets(BUDGETS if with_budgets else "")))

        async def one() -> None:
            reservation = ledger.reservation(await accounting.in_force(), PAYER)
            session, _ = await store.get_or_create_session("bench", name, user_id=user_id)
            tail = await store.tail(session.id)
            async with run_turn(
                store,
                session.id,
                user_message=user_message("hello"),
                last_message_id=tail.message_id if tail else None,
                reservation=reservation,
            ) as turn:
                # The answer's one model request, as every turn records it (its totals too).
                entry = LedgerEntry(request, "answer", 1280, False, session.id, payer=PAYER)
                await ledger.record(entry)
                await turn.finish([assistant_message("hi")])

        return one

    suffix = "_seeded" if seeded else ""
    times = await _rounds(
        samples,
        warmup,
        {
            f"without_budgets{suffix}": bookkeeping(f"budget/off{suffix}", False),
            f"with_budgets{suffix}": bookkeeping(f"budget/on{suffix}", True),
        },
    )
    return {name: summarize(values) for name, values in times.items()}


def format_observability(result: dict[str, Any]) -> list[str]:
    """The ``observability`` part of a bench result, for people."""
    part = result.get("observability")
    if not isinstance(part, dict):
        return []
    tracing, budget = part["tracing"], part["budget_check"]

    def row(timing: dict[str, Any]) -> str:
        return f"p50 {timing['p50']:.2f} ms, p95 {timing['p95']:.2f} ms (n={timing['n']})"

    lines = ["", "observability (one agent turn, offline model):"]
    for name in ("off", "live_collector", "unreachable_collector"):
        lines.append(f"  tracing {name:<22} {row(tracing[name])}")
    lines.append(
        f"  p50 vs off: live {tracing['live_vs_off_p50']:.3f}x, "
        f"unreachable {tracing['unreachable_vs_off_p50']:.3f}x"
    )
    lines.append(f"budget check (a turn's bookkeeping, {budget['ledger_rows']} ledger rows after):")
    for name, timing in budget.items():
        if isinstance(timing, dict):
            lines.append(f"  {name:<28} {row(timing)}")
    lines.append(
        f"  with vs without: p50 {budget['ratio_p50']:.3f}x, "
        f"seeded {budget['ratio_p50_seeded']:.3f}x"
    )
    return lines


def run_part(argv: list[str]) -> None:
    """``slack-agent bench budget-check [DATABASE_URL|- [LEDGER_ROWS]]``."""
    url = argv[0] if argv and argv[0] != "-" else None
    rows = int(argv[1]) if len(argv) > 1 else LEDGER_ROWS
    print(json.dumps(asyncio.run(bench_budget_check(url, ledger_rows=rows))))

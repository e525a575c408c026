"""Child process for concurrency tests: ``python tests/worker.py COMMAND URL ARGS...``.

Each command reports JSON lines on stdout. Steps are ordered by the parent over stdin/stdout
(a "ready" line, then a "go" line back), never by sleeping, so processes contend at one moment.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from typing import Any

from core.conversation.approvals import ApprovalDesk
from core.errors import AgentSessionStale, SlackAgentError
from core.messages import assistant_message, user_message
from core.records import Actor
from core.storage import queries as q
from core.storage.approvals import Approvals
from core.storage.deliveries import Deliveries
from core.storage.engine import Database, create_database
from core.storage.migrate import upgrade
from core.storage.retention import RetentionPolicy
from core.storage.sessions import SessionStore
from core.storage.sweeper import sweep
from core.storage.usage import UsageLedger
from core.usage.budgets import Payer, parse_budgets


def say(**payload: Any) -> None:
    print(json.dumps(payload), flush=True)


async def wait_for_go() -> None:
    say(ready=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def claim(db: Database, session_id: str, last: str, staleness: str = "60") -> None:
    store = SessionStore(db, staleness_seconds=float(staleness))
    await store.is_turn_active(int(session_id))  # connect before the race starts
    await wait_for_go()
    try:
        lease = await store.start_turn(
            int(session_id),
            user_message=user_message("from a child process"),
            last_message_id=None if last == "-" else last,
        )
    except AgentSessionStale as exc:
        say(result=exc.code, actual=exc.actual_last_message_id)
    except SlackAgentError as exc:
        say(result=exc.code)
    except Exception as exc:  # a driver error is a test failure: report it, do not hide it
        say(result=f"unexpected {exc.__class__.__name__}: {exc}")
    else:
        say(result="won", message_id=lease.tail.message_id if lease.tail else None)


async def budget_claim(db: Database, session_id: str, budgets: str, payer: str) -> None:
    """Claim a turn under ``budgets`` for ``payer``: the budget check and reservation run in
    the claim transaction, as a replica's turn runs them."""
    store = SessionStore(db)
    ledger = UsageLedger(db, staleness_seconds=60)
    reservation = ledger.reservation(parse_budgets(budgets), Payer(payer))
    await store.is_turn_active(int(session_id))  # connect before the race starts
    await wait_for_go()
    try:
        await store.start_turn(
            int(session_id),
            user_message=user_message("the last of the budget"),
            last_message_id=None,
            reservation=reservation,
        )
    except SlackAgentError as exc:
        say(result=exc.code)
    except Exception as exc:
        say(result=f"unexpected {exc.__class__.__name__}: {exc}")
    else:
        say(result="won")


async def finish_held(db: Database, session_id: str, token: str, position: str) -> None:
    """The statements of a turn's ``SessionStore.finish`` with one answer (the fence, the
    answer and the release; on PostgreSQL its one statement), in a transaction held open
    between them and the commit: "ready" once they ran, the commit on "go". A claim sent
    meanwhile waits on the session's row (PostgreSQL) or the write lock (SQLite)."""
    lease = {"sid": int(session_id), "token": token}
    answer = assistant_message("the answer, committed while a claim waits")
    row = q.message_row(int(session_id), int(position), answer)
    async with db.write() as conn:
        if conn.dialect.name == "postgresql":
            assert await q.fenced_insert(conn, lease, row, release=True) == 1
        else:
            assert await q.fence(conn, lease, release=True, tail=row["message_id"])
            await q.insert_messages(conn, [row])
        await wait_for_go()
    say(committed=row["message_id"])


async def hang(db: Database, session_id: str, last: str) -> None:
    """Start a turn and never finish it: the parent kills this process with SIGKILL."""
    store = SessionStore(db)
    lease = await store.start_turn(
        int(session_id),
        user_message=user_message("this turn will be killed"),
        last_message_id=None if last == "-" else last,
    )
    say(claimed=lease.tail.message_id if lease.tail else None)
    await asyncio.Event().wait()


async def sweep_once(db: Database, staleness: str, batch: str, idle_days: str, cap: str) -> None:
    await wait_for_go()
    report = await sweep(
        db,
        RetentionPolicy(max_idle_days=float(idle_days), max_per_user=int(cap)),
        staleness_seconds=float(staleness),
        batch_size=int(batch),
    )
    say(report=dataclasses.asdict(report))


async def take_over(db: Database, staleness: str) -> None:
    """Take over every lapsed delivery record this process can get, as a replica's upkeep does."""
    deliveries = Deliveries(db, "slack", staleness_seconds=float(staleness))
    await deliveries.get(0)  # connect before the race starts
    await wait_for_go()
    taken: list[int] = []
    while batch := await deliveries.take_over(1):
        taken += [r.id for r in batch]
    say(taken=taken)


async def decide(db: Database, approval_id: str, operator: str, step: str) -> None:
    """Decide a waiting tool call as the terminal's ``/approve`` does (the local operator, an
    admin, through the conversation API's desk) and never carry it out: the parent kills this
    process with SIGKILL. ``step``: ``decided`` (killed right after the decision) or ``sent``
    (killed after the call was marked as going out to its server)."""
    store = SessionStore(db)
    approvals = Approvals(db, timeout_seconds=3600)
    desk = ApprovalDesk(store, approvals)
    user_id = await store.get_or_create_user(operator)
    decision = await desk.decide(
        approval_id, Actor(user_id=user_id, admin=True), approver_id=None, approve=True, by=operator
    )
    if step == "sent":
        assert await approvals.start_running(approval_id)
    say(decided=type(decision).__name__)
    await asyncio.Event().wait()


async def migrate(db: Database) -> None:
    await wait_for_go()
    before, after = await upgrade(db)
    say(before=before, after=after)


COMMANDS = {
    "claim": claim,
    "budget_claim": budget_claim,
    "finish_held": finish_held,
    "hang": hang,
    "sweep": sweep_once,
    "migrate": migrate,
    "take_over": take_over,
    "decide": decide,
}


async def main() -> None:
    command, url, *args = sys.argv[1:]
    db = create_database(url)
    try:
        await COMMANDS[command](db, *args)  # type: ignore[operator]
    finally:
        await db.dispose()


if __name__ == "__main__":
    asyncio.run(main())

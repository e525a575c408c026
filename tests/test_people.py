"""One person's data, exported then erased, on both databases (``slack-agent user …``).

Three people share the database: the person erased (``T1:U1``), a colleague in the same
workspace (``T1:U2``) and a namesake in another workspace (``T2:U1``, the same Slack user id).
Each has a session with turns, votes, a token, a sign-in, model requests, a delivery record and
what they are looking at; the colleague's session has a tool call the erased person decided.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import insert, select

from core.errors import AgentSessionBusy, UsageError
from core.messages import user_message
from core.operator import Operator
from core.providers.base import Usage
from core.settings import load_settings
from core.storage.models import Delivery, UsageRequest
from core.storage.usage import LedgerEntry
from core.usage.budgets import Payer
from core.usage.totals import RequestUsage
from tests.helpers import add_exchange, new_session
from tests.test_cli import cli

ERASED_ONE, COLLEAGUE, NAMESAKE = "T1:U1", "T1:U2", "T2:U1"


@pytest.fixture
async def operator(database_url: str) -> AsyncIterator[Operator]:
    op = Operator.open(load_settings(database_url=database_url))
    try:
        yield op
    finally:
        await op.close()


async def _person(op: Operator, person: str) -> dict[str, Any]:
    """Give ``person`` one of everything the product keeps about someone."""
    storage = op.storage
    team, user = person.split(":")
    external = f"slack:{team}:{user}"
    user_id, session = await new_session(
        storage.sessions, owner=external, key=f"{team}/C1/{uuid.uuid4().hex[:8]}"
    )
    ids = await add_exchange(storage.sessions, session.id, 2)
    await storage.feedback.record(ids[1], external, "good")
    await storage.web_access.create_token(user_id, name="ci", expires_days=None)
    await storage.web_access.sign_in(user_id, lifetime_seconds=3600)
    await storage.usage.record(
        LedgerEntry(
            RequestUsage("openai", "gpt-4.1-mini", Usage(100, 20), Decimal("0.001")),
            "answer",
            counted_tokens=120,
            counts_estimated=False,
            session_id=session.id,
            message_id=ids[1],
            payer=Payer(external, team),
            surface="slack",
        )
    )
    async with storage.sessions.db.write() as conn:
        await conn.execute(
            insert(Delivery.__table__).values(
                surface="slack",
                event_key=f"{team}/C1/{uuid.uuid4().hex}",
                thread_key=session.project_session_id,
                session_id=session.id,
                author=user,
                message_id=ids[0],
                text="question 0",
                context={},
                state="done",
            )
        )
    await storage.surface("slack").set_viewing(person, {"channel": "C9"})
    return {"session": session.id, "messages": ids, "user_id": user_id}


async def _export(op: Operator, person: str) -> list[dict[str, Any]]:
    # Through JSON as the command prints it: every record must survive the trip.
    return [json.loads(json.dumps(r, default=str)) async for r in op.export_person(person)]


async def _usage_rows(op: Operator) -> list[tuple[Any, ...]]:
    table = UsageRequest.__table__
    async with op.storage.sessions.db.read() as conn:
        rows = await conn.execute(
            select(table.c.user_key, table.c.workspace, table.c.counted_tokens).order_by(table.c.id)
        )
        return [tuple(r) for r in rows]


async def test_export_then_erase__only_anonymised_usage_left_and_nobody_else_touched(
    operator: Operator,
) -> None:
    mine = await _person(operator, ERASED_ONE)
    await _person(operator, NAMESAKE)
    theirs = await _person(operator, COLLEAGUE)
    approvals = operator.storage.approvals
    approval = await approvals.request(
        session_id=theirs["session"],
        message_id=theirs["messages"][1],
        tool_call_id="call-1",
        tool_name="deploy",
        server="ops",
        arguments={"env": "prod"},
        digest="d" * 64,
        approvers=("slack:T1:U1",),
        requested_by="slack:T1:U1",  # their message in the colleague's thread asked
    )
    await approvals.decide(approval, approve=True, by="slack:T1:U1")
    await operator.storage.feedback.record(theirs["messages"][3], "slack:T1:U1", "bad")

    exported = await _export(operator, ERASED_ONE)
    kinds = [r["record"] for r in exported]
    for kind, count in {
        "person": 1,
        "session": 1,
        "message": 4,
        "approval": 1,
        "api_token": 1,
        "web_sign_in": 1,
        "usage": 1,
        "feedback": 2,
        "delivery": 1,
        "viewing": 1,
    }.items():
        assert kinds.count(kind) == count, (kind, kinds)
    assert {r["session_id"] for r in exported if r["record"] == "message"} == {mine["session"]}
    assert [r["message"]["id"] for r in exported if r["record"] == "message"] == mine["messages"]
    assert all("token_hash" not in r and "cookie_hash" not in r for r in exported)
    assert "lock_token" not in next(r for r in exported if r["record"] == "session")

    colleague_before = await _export(operator, COLLEAGUE)
    namesake_before = await _export(operator, NAMESAKE)
    usage_before = await _usage_rows(operator)

    erased = await operator.erase_person(ERASED_ONE)
    assert (erased.sessions, erased.messages, erased.tokens, erased.sign_ins) == (1, 4, 1, 1)
    assert (erased.feedback, erased.deliveries, erased.viewing, erased.person) == (2, 1, 1, 1)
    assert (erased.usage_anonymised, erased.decisions_anonymised) == (1, 1)
    assert erased.requests_anonymised == 1

    assert await _export(operator, ERASED_ONE) == []
    with pytest.raises(Exception, match="does not exist"):
        await operator.storage.sessions.get_session(mine["session"])
    # The accounts keep the spending: same rows, same workspace, the person taken out.
    usage_after = await _usage_rows(operator)
    assert [(w, n) for _, w, n in usage_after] == [(w, n) for _, w, n in usage_before]
    assert [k for k, _, _ in usage_after] == [
        "(erased)" if k == "slack:T1:U1" else k for k, _, _ in usage_before
    ]
    # Nobody else's data changed, but for the name on the decision the erased person made.
    assert await _export(operator, NAMESAKE) == namesake_before
    for record in colleague_before:
        if record["record"] == "approval":
            record["decided_by"] = record["requested_by"] = "(erased)"
    assert await _export(operator, COLLEAGUE) == colleague_before
    again = await operator.erase_person(ERASED_ONE)
    assert not again.anything


async def test_erase__refused_while_a_turn_of_theirs_runs_and_nothing_removed(
    operator: Operator,
) -> None:
    mine = await _person(operator, ERASED_ONE)
    store = operator.storage.sessions
    lease = await store.start_turn(
        mine["session"],
        user_message=user_message("still going"),
        last_message_id=mine["messages"][-1],
    )
    before = await _export(operator, ERASED_ONE)
    with pytest.raises(AgentSessionBusy, match="a turn is running"):
        await operator.erase_person(ERASED_ONE)
    assert await _export(operator, ERASED_ONE) == before
    await store.release(lease)
    assert (await operator.erase_person(ERASED_ONE)).sessions == 1


async def test_erase__refused_while_a_message_of_theirs_waits_to_be_answered(
    operator: Operator,
) -> None:
    await _person(operator, ERASED_ONE)
    deliveries = operator.storage.deliveries("slack")
    recorded = await deliveries.record(
        event_key="T1/C7/1.0",
        thread_key="T1/C7/1.0",
        author="U1",
        message_id=str(uuid.uuid4()),
        text="in someone else's thread",
        context={},
    )
    assert recorded is not None
    with pytest.raises(AgentSessionBusy, match="being answered"):
        await operator.erase_person(ERASED_ONE)
    assert len(await _export(operator, ERASED_ONE)) > 0


async def test_a_person_is_named_team_colon_user(operator: Operator) -> None:
    with pytest.raises(UsageError, match=r"user erase: takes TEAM:USER \(T123:U456\)"):
        await operator.erase_person("U1")


@pytest.mark.slow
async def test_the_commands__json_lines_out_and_a_line_saying_what_went(
    operator: Operator, database_url: str
) -> None:
    await _person(operator, ERASED_ONE)
    exported = cli("user", "export", ERASED_ONE, database_url=database_url)
    assert exported.returncode == 0, exported.stderr
    lines = [json.loads(line) for line in exported.stdout.splitlines()]
    assert lines[0]["record"] == "person"
    assert lines[0]["external_id"] == "slack:T1:U1"
    erased = cli("user", "erase", ERASED_ONE, database_url=database_url)
    assert erased.returncode == 0, erased.stderr
    assert erased.stdout.startswith("erased T1:U1: 1 sessions (4 messages), 1 delivery records")
    assert "kept anonymised: 1 model requests" in erased.stdout
    nothing = cli("user", "erase", ERASED_ONE, database_url=database_url)
    assert nothing.stdout.strip() == "nothing kept about T1:U1"
    bad = cli("user", "export", "nobody", database_url=database_url)
    assert bad.returncode == 2
    assert bad.stderr.startswith("slack-agent: usage_error: user export:")

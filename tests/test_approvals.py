"""Tool calls under a person's approval, through the conversation API every surface calls: a real
notes MCP server (SDK, stdio), the offline model calling it, the real runtime on both databases."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import update

from core.conversation import (
    AlreadyAnswered,
    Answered,
    Conversation,
    Conversations,
    Decided,
    DecisionRefused,
    OverBudget,
    TurnRequest,
)
from core.conversation.rounds import ApprovalRounds
from core.records import ANY_TAIL, Actor
from core.runtime import Runtime
from core.settings import Settings
from core.storage.approvals import ApprovalRecord
from core.storage.dialect import ago
from core.storage.models import ToolApproval
from core.tools import call_digest, canonical_json
from terminal.chat import ChatSession
from terminal.client import Terminal
from tests.helpers import read_json_line, start_worker
from tests.mcp_support import (
    READY_SECONDS,
    calls_counted,
    notes,
    notes_config,
    notes_entry,
    write_config,
)
from tests.terminal_harness import ChatProcess

# Every test starts the notes MCP server as a process (stdio): outside the developer's quick
# subset, like every test that starts real processes (README, *The tests*).
pytestmark = pytest.mark.slow

ADD = 'mcp__notes__add_note {"title": "plan", "text": "ship on friday"}'


@pytest.fixture
async def runtime(tmp_path: Path, database_url: str) -> AsyncIterator[Runtime]:
    entry = notes_entry(tmp_path)
    entry["approvers"] = ["T1:U9"]
    settings = Settings(
        database_url=database_url,
        model_provider="offline",
        mcp_config=write_config(tmp_path, {"notes": entry}),
    )
    opened = await Runtime.open(settings)
    assert opened.tools is not None
    async with asyncio.timeout(READY_SECONDS):
        await opened.tools.wait_for("notes", "connected")
    yield opened
    await opened.close()


@pytest.fixture
def conversations(runtime: Runtime) -> Conversations:
    return runtime.conversations("test")


async def owner(conversations: Conversations) -> Actor:
    return await conversations.person("slack:T1:U1")


async def asked(conversations: Conversations, key: str = "k1") -> tuple[Conversation, str]:
    """A conversation whose last turn stopped at the add_note call; the request's id."""
    conversation = await conversations.open(key, owner=await owner(conversations))
    outcome = await conversation.take_turn(TurnRequest(ADD))
    assert isinstance(outcome, Answered)
    assert outcome.result.approval is not None
    assert outcome.result.answer is not None
    await conversation.showed(outcome.result.answer.message_id)  # as a surface does
    return conversation, outcome.result.approval.id


def part_of(message: dict[str, Any], tool: str = "mcp__notes__add_note") -> dict[str, Any]:
    (part,) = [p for p in message["parts"] if p.get("type") == f"tool-{tool}"]
    return part


async def decide(
    conversations: Conversations,
    approval_id: str,
    who: Actor,
    *,
    approve: bool = True,
    approver_id: str | None = "T1:U1",
) -> Decided | DecisionRefused:
    assert conversations.approvals is not None
    return await conversations.approvals.decide(
        approval_id, who, approver_id=approver_id, approve=approve, by="U1"
    )


async def test_approval__the_turn_ends_at_the_call_with_the_lock_released(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    assert not await conversation.is_busy()
    tail = await conversation.store.tail(conversation.id)
    assert tail is not None
    part = part_of(tail.message)
    assert part["state"] == "approval-requested"
    assert part["approval"] == {"id": approval_id}
    waiting = await conversation.pending_approval()
    assert waiting is not None
    assert waiting.id == approval_id
    assert waiting.arguments == {"title": "plan", "text": "ship on friday"}
    assert notes(tmp_path) == {}  # nothing ran


async def test_approval__approve_runs_the_call_once_and_the_model_continues(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    decided = await decide(conversations, approval_id, await owner(conversations))
    assert isinstance(decided, Decided)
    assert await conversation.pending_approval() is None  # every surface stops asking
    outcome = await conversation.carry_out(approval_id)
    assert isinstance(outcome, Answered)
    assert notes(tmp_path) == {"plan": "ship on friday"}
    assert "answered" in outcome.result.text  # the model continued from the result
    messages = await conversation.store.messages(conversation.id)
    part = part_of(messages[-2].message)
    assert part["state"] == "output-available"
    assert part["approval"]["approved"] is True
    assert messages[-1].role == "assistant"
    again = await conversation.carry_out(approval_id)
    assert isinstance(again, AlreadyAnswered)
    record = await conversations.approvals.get(approval_id)  # type: ignore[union-attr]
    assert record is not None
    assert record.state == "ran"


async def test_approval__deny_tells_the_model_and_nothing_runs(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    decided = await decide(conversations, approval_id, await owner(conversations), approve=False)
    assert isinstance(decided, Decided)
    outcome = await conversation.carry_out(approval_id)
    assert isinstance(outcome, Answered)
    assert notes(tmp_path) == {}
    messages = await conversation.store.messages(conversation.id)
    part = part_of(messages[-2].message)
    assert part["state"] == "output-denied"
    assert "declined" in part["approval"]["reason"]
    assert "declined" in outcome.result.text


async def test_approval__only_owner_admins_and_the_servers_approvers_decide(
    conversations: Conversations,
) -> None:
    _, approval_id = await asked(conversations)
    stranger = await conversations.person("slack:T1:U2")
    refused = await decide(conversations, approval_id, stranger, approver_id="T1:U2")
    assert refused == DecisionRefused("not_allowed", refused.record)  # type: ignore[union-attr]
    assert (await conversations.approvals.get(approval_id)).state == "pending"  # type: ignore[union-attr]
    approver = await conversations.person("slack:T1:U9")
    assert isinstance(
        await decide(conversations, approval_id, approver, approver_id="T1:U9"), Decided
    )
    _, second = await asked(conversations, "k2")
    admin = Actor(stranger.user_id, admin=True)
    assert isinstance(await decide(conversations, second, admin, approver_id=None), Decided)


async def test_approval__two_decisions_at_once_one_wins(conversations: Conversations) -> None:
    _, approval_id = await asked(conversations)
    who = await owner(conversations)
    results = await asyncio.gather(
        *(decide(conversations, approval_id, who, approve=i % 2 == 0) for i in range(6))
    )
    assert sum(isinstance(r, Decided) for r in results) == 1
    assert all(r.reason == "decided" for r in results if isinstance(r, DecisionRefused))


async def test_approval__a_new_message_supersedes_the_request(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    outcome = await conversation.take_turn(TurnRequest("never mind"))
    assert isinstance(outcome, Answered)
    messages = await conversation.store.messages(conversation.id)
    part = part_of(messages[-3].message)
    assert part["state"] == "output-denied"
    assert part["approval"]["reason"].startswith("superseded")
    refused = await decide(conversations, approval_id, await owner(conversations))
    assert isinstance(refused, DecisionRefused)
    assert refused.reason == "superseded"
    assert await conversation.pending_approval() is None
    assert notes(tmp_path) == {}


async def test_approval__a_decision_after_the_timeout_is_refused(
    tmp_path: Path, database_url: str
) -> None:
    settings = Settings(
        database_url=database_url,
        model_provider="offline",
        mcp_config=notes_config(tmp_path),
        approval_timeout_seconds=0.001,
    )
    runtime = await Runtime.open(settings)
    try:
        assert runtime.tools is not None
        async with asyncio.timeout(READY_SECONDS):
            await runtime.tools.wait_for("notes", "connected")
        conversations = runtime.conversations("test")
        conversation, approval_id = await asked(conversations)
        await asyncio.sleep(0.05)  # past the (tiny) timeout on the database clock
        assert await conversation.pending_approval() is None
        refused = await decide(conversations, approval_id, await owner(conversations))
        assert isinstance(refused, DecisionRefused)
        assert refused.reason == "expired"
        outcome = await conversation.take_turn(TurnRequest("and now?"))
        assert isinstance(outcome, Answered)
        messages = await conversation.store.messages(conversation.id)
        assert part_of(messages[-3].message)["approval"]["reason"].startswith("expired")
        assert notes(tmp_path) == {}
    finally:
        await runtime.close()


async def test_approval__a_rewound_request_is_refused(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    first = (await conversation.store.messages(conversation.id))[0]
    await conversation.rewind(first.message_id, await owner(conversations))
    refused = await decide(conversations, approval_id, await owner(conversations))
    assert isinstance(refused, DecisionRefused)
    assert refused.reason == "rewound"
    assert notes(tmp_path) == {}


@pytest.mark.parametrize("approval_id", ["", "x" * 32, "0" * 32, "../../etc", "1" * 5000])
async def test_approval__an_unknown_or_tampered_id_is_refused(
    conversations: Conversations, approval_id: str
) -> None:
    await asked(conversations)
    refused = await decide(conversations, approval_id, await owner(conversations))
    assert refused == DecisionRefused("unknown")


async def test_approval__a_fork_does_not_copy_the_request_as_pending(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    tail = await conversation.store.tail(conversation.id)
    assert tail is not None
    forked = await conversation.fork(tail.message_id, await owner(conversations), "fork-1")
    fork = forked.conversation
    assert await fork.pending_approval() is None
    outcome = await fork.take_turn(TurnRequest("go on"))
    assert isinstance(outcome, Answered)
    messages = await fork.store.messages(fork.id)
    assert part_of(messages[-3].message)["state"] == "output-denied"
    # The original still waits, and its approval runs there only.
    assert (await conversation.pending_approval()) is not None
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    assert isinstance(await conversation.carry_out(approval_id), Answered)
    assert notes(tmp_path) == {"plan": "ship on friday"}


async def test_approval__a_call_sent_by_a_turn_that_died_is_never_sent_again(
    conversations: Conversations, runtime: Runtime, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    # A turn took it to the server and died before recording the result.
    assert await runtime.storage.approvals.start_running(approval_id)
    outcome = await conversation.carry_out(approval_id)
    assert isinstance(outcome, Answered)
    assert notes(tmp_path) == {}  # not sent a second time
    messages = await conversation.store.messages(conversation.id)
    part = part_of(messages[-2].message)
    assert part["state"] == "output-error"
    assert "not sent again" in part["errorText"]


@pytest.mark.slow  # a real process
@pytest.mark.parametrize("step", ["decided", "sent"])
async def test_approval__a_decision_whose_process_died_is_carried_out_once_by_another(
    conversations: Conversations, database_url: str, tmp_path: Path, step: str
) -> None:
    """The terminal decides, then its process dies (SIGKILL) before the carry-out (``decided``)
    or after marking the call as sent (``sent``): the decision is left behind, and whoever picks
    it up (two at once here) carries it out once; a call already sent is never sent again."""
    desk = conversations.approvals
    assert desk is not None
    conversation, approval_id = await asked(conversations)
    before = calls_counted("notes", "add_note", "ok")
    child = start_worker("decide", database_url, approval_id, "cli:tester", step)
    try:
        assert await asyncio.to_thread(read_json_line, child) == {"decided": "Decided"}
    finally:
        child.kill()
        await asyncio.to_thread(child.communicate)
    record = await desk.get(approval_id)
    assert record is not None
    assert record.state == ("approved" if step == "decided" else "running")
    assert record.decided_by == "cli:tester"
    # A decision younger than the window may still be claiming its turn in a live process.
    assert await desk.left_behind(3600) == []
    (left,) = await desk.left_behind(0)
    assert left.id == approval_id
    outcomes = await asyncio.gather(
        conversations.carry_out_left_behind(left), conversations.carry_out_left_behind(left)
    )
    assert sum(isinstance(o, Answered) for o in outcomes) == 1, outcomes
    assert await desk.left_behind(0) == []  # carried out: nobody picks it up again
    again = await conversations.carry_out_left_behind(left)
    assert isinstance(again, AlreadyAnswered)
    done = await desk.get(approval_id)
    assert done is not None
    assert done.state == "ran"
    messages = await conversation.store.messages(conversation.id)
    part = part_of(messages[-2].message)
    if step == "decided":
        assert part["state"] == "output-available"
        assert notes(tmp_path) == {"plan": "ship on friday"}
        assert calls_counted("notes", "add_note", "ok") == before + 1  # the call ran once
    else:
        assert part["state"] == "output-error"
        assert "not sent again" in part["errorText"]
        assert notes(tmp_path) == {}  # what a dead turn may have sent is never sent again
        assert calls_counted("notes", "add_note", "ok") == before
    assert messages[-1].role == "assistant"  # and the model continued


@pytest.mark.slow  # a real terminal client
async def test_approval__the_terminal_carries_out_its_own_decision_left_behind(
    runtime: Runtime, database_url: str, tmp_path: Path
) -> None:
    """A terminal session's decision that its client never carried out (killed after
    ``/approve``): with no ``serve`` running, the next ``slack-agent chat`` of that session
    carries it out when it opens, once."""
    terminal = runtime.conversations("cli")
    operator = await terminal.person("cli:tester", admin=True)
    conversation = await terminal.open("tester/left", owner=operator)
    outcome = await conversation.take_turn(TurnRequest(ADD))
    assert isinstance(outcome, Answered)
    assert outcome.result.approval is not None
    approval_id = outcome.result.approval.id
    desk = terminal.approvals
    assert desk is not None
    decided = await desk.decide(
        approval_id, operator, approver_id=None, approve=True, by="cli:tester"
    )
    assert isinstance(decided, Decided)
    # ... and the client died; the staleness window has passed since (the database's clock).
    async with runtime.storage.approvals.db.write() as conn:
        await conn.execute(update(ToolApproval.__table__).values(decided_at=ago(600)))
    before = calls_counted("notes", "add_note", "ok")
    chat = ChatProcess(database_url, str(conversation.id), mcp_config=str(tmp_path / "mcp.json"))
    try:
        await chat.expect("was never carried out", within=120)
        await chat.expect("answered", within=120)
        await chat.prompt()
        chat.line("/quit")
        assert await chat.exit_status() == 0
    finally:
        chat.kill()
    record = await desk.get(approval_id)
    assert record is not None
    assert record.state == "ran"
    assert notes(tmp_path) == {"plan": "ship on friday"}
    assert calls_counted("notes", "add_note", "ok") == before  # it ran in the client, not here


async def test_approval__the_approved_digest_binds_the_exact_call(
    conversations: Conversations, runtime: Runtime, tmp_path: Path
) -> None:
    _, approval_id = await asked(conversations)
    record = await runtime.storage.approvals.get(approval_id)
    assert record is not None
    assert runtime.tools is not None
    other = await runtime.tools.call(
        "mcp__notes__add_note", {"title": "plan", "text": "other"}, approval=record.digest
    )
    assert other.kind == "approval_required"
    assert notes(tmp_path) == {}
    assert json.loads(json.dumps(record.arguments)) == {"title": "plan", "text": "ship on friday"}


async def test_rewind_plan__names_the_calls_that_went_out_and_a_fork_runs_nothing(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    assert isinstance(await conversation.carry_out(approval_id), Answered)
    messages = await conversation.store.messages(conversation.id)
    plan = await conversation.rewind_plan(messages[0].message_id)
    assert plan is not None
    assert plan.outside == ('mcp__notes__add_note {"text":"ship on friday","title":"plan"}',)
    before = calls_counted("notes", "add_note", "ok")
    forked = await conversation.fork(messages[-1].message_id, await owner(conversations), "f2")
    assert forked.copied == len(messages)
    assert calls_counted("notes", "add_note", "ok") == before  # copied, never re-run
    # A request that was refused before reaching its server is not named.
    other, second = await asked(conversations, "k3")
    first = (await other.store.messages(other.id))[0]
    assert (await other.rewind_plan(first.message_id)).outside == ()  # type: ignore[union-attr]
    assert second


async def test_approval__a_nul_in_the_arguments_is_asked_approved_and_run(
    conversations: Conversations, tmp_path: Path
) -> None:
    """The transcript replaces a NUL (PostgreSQL stores none in JSONB or text); the request
    keeps the call exactly as the model made it, so asking for it never fails the turn."""
    conversation = await conversations.open("nul", owner=await owner(conversations))
    text = 'mcp__notes__add_note {"title": "plan", "text": "ship\\u0000 on friday"}'
    outcome = await conversation.take_turn(TurnRequest(text))
    assert isinstance(outcome, Answered)
    assert outcome.result.error is None
    assert outcome.result.approval is not None
    approval_id = outcome.result.approval.id
    record = await conversations.approvals.get(approval_id)  # type: ignore[union-attr]
    assert record is not None
    assert record.arguments == {"title": "plan", "text": "ship\x00 on friday"}
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    assert isinstance(await conversation.carry_out(approval_id), Answered)
    assert notes(tmp_path) == {"plan": "ship\x00 on friday"}


class _NoLines:
    """The terminal's line source for a test that hands it each line itself."""

    async def read(self, prompt: str, default: str) -> str:
        raise EOFError


async def test_approval__a_nul_in_the_terminals_reason_is_one_line_and_decides_nothing(
    runtime: Runtime, backend: str, tmp_path: Path
) -> None:
    """A reason is what a person types; PostgreSQL refuses a NUL in it (SQLSTATE 22021). The
    terminal says so in one line (``database_value_refused``), not "sent again" (it would be
    refused again), and the call still waits, undecided; a reason without it then decides.
    SQLite stores a NUL: there the first reason decides."""
    chat = ChatSession(runtime)
    chat.actor = await chat.conversations.person(chat.operator, admin=True)
    printed = io.StringIO()
    terminal = Terminal(chat, _NoLines(), Console(file=printed, width=400))
    await terminal._handle(ADD)
    approval_id = terminal.asking
    assert approval_id is not None
    assert chat.conversation is not None
    before = await chat.conversation.store.messages(chat.conversation.id)
    await terminal._handle("/deny not\x00 now")
    record = await _record(chat.conversations, approval_id)
    if backend == "postgresql":
        (said,) = [line for line in printed.getvalue().splitlines() if "Not decided" in line]
        assert "database_value_refused" in said
        assert "sends it again" not in said
        assert record.state == "pending"
        assert terminal.asking == approval_id
        assert await chat.pending_approval() is not None
        assert await chat.conversation.store.messages(chat.conversation.id) == before
        await terminal._handle("/deny not now")
        record = await _record(chat.conversations, approval_id)
    assert record.state == "declined"
    assert record.decision_reason in ("not now", "not\x00 now")
    assert notes(tmp_path) == {}


async def test_approval__arguments_read_back_exactly_as_they_were_digested(
    runtime: Runtime, conversations: Conversations
) -> None:
    """JSONB would hand back ``1e2`` as ``100`` and normalise other numbers: the arguments a
    request keeps are the ones its digest names, whatever the database."""
    conversation = await conversations.open("numbers", owner=await owner(conversations))
    arguments = {"round": 100.0, "big": 2**70, "small": 0.1, "neg": -(2**65), "exp": 1e300}
    approval_id = await runtime.storage.approvals.request(
        session_id=conversation.id,
        message_id="m" * 36,
        tool_call_id="call-1",
        tool_name="mcp__notes__add_note",
        server="notes",
        arguments=arguments,
        digest="0" * 64,
        approvers=(),
    )
    record = await runtime.storage.approvals.get(approval_id)
    assert record is not None
    assert canonical_json(record.arguments) == canonical_json(arguments)
    assert [type(v) for v in record.arguments.values()] == [type(v) for v in arguments.values()]


async def test_approval__the_digest_binds_the_servers_tool_not_only_its_offered_name(
    conversations: Conversations, runtime: Runtime, tmp_path: Path
) -> None:
    """A digest of the offered name and arguments alone does not authorise the call: it names
    the server as configured and the tool by the server's own name too."""
    _, approval_id = await asked(conversations)
    record = await runtime.storage.approvals.get(approval_id)
    assert record is not None
    assert runtime.tools is not None
    by_name = call_digest(record.tool_name, record.arguments)
    assert record.digest != by_name
    refused = await runtime.tools.call(record.tool_name, record.arguments, approval=by_name)
    assert refused.kind == "approval_required"
    assert notes(tmp_path) == {}
    tool = runtime.tools.tool(record.tool_name)
    assert tool is not None
    assert record.digest == tool.digest(record.arguments)
    moved = dataclasses.replace(tool, origin=tool.origin + " --elsewhere")
    assert moved.digest(record.arguments) != record.digest


async def test_approval_rounds__a_replica_with_no_surface_carries_out_what_was_left_behind(
    conversations: Conversations, runtime: Runtime, tmp_path: Path
) -> None:
    """The rounds are the core's: with no surface that shows cards (no Slack), a decision whose
    process died is still carried out, once, though two replicas' rounds find it at once; a
    decision younger than the staleness window is left to the process that made it."""
    desk = conversations.approvals
    assert desk is not None
    conversation, approval_id = await asked(conversations)
    decided = await desk.decide(
        approval_id, await owner(conversations), approver_id=None, approve=True, by="slack:T1:U1"
    )
    assert isinstance(decided, Decided)
    rounds = [ApprovalRounds(runtime.settings, conversations) for _ in range(2)]
    await asyncio.gather(*(r.round() for r in rounds))
    record = await desk.get(approval_id)
    assert record is not None
    assert record.state == "approved"  # still within the window: its process may be at it
    async with runtime.storage.approvals.db.write() as conn:  # ... which has passed since
        await conn.execute(update(ToolApproval.__table__).values(decided_at=ago(600)))
    before = calls_counted("notes", "add_note", "ok")
    await asyncio.gather(*(r.round() for r in rounds))
    for r in rounds:  # the carrying out runs beside the rounds: wait for it
        await r.carried_out()
    record = await desk.get(approval_id)
    assert record is not None
    assert record.state == "ran"
    assert calls_counted("notes", "add_note", "ok") == before + 1
    assert notes(tmp_path) == {"plan": "ship on friday"}
    tail = await conversation.store.tail(conversation.id)
    assert tail is not None
    assert tail.role == "assistant"
    await asyncio.gather(*(r.round() for r in rounds))  # nothing left: nothing runs again
    assert calls_counted("notes", "add_note", "ok") == before + 1
    # The decider pays for the continuation, in their workspace (its budgets apply).
    charged = await runtime.storage.usage.report("workspace")
    assert "T1" in {line.key for line in charged}


# -- every request reaches an end state with a reason (issue 35, items 3 and 6) ------------------


async def _moved_on(conversation: Conversation) -> None:
    """Something follows the message that asked, added without a turn settling the request
    (as a compaction adds its checkpoint)."""
    store = conversation.store
    lease = await store.start_turn(conversation.id, user_message=None, last_message_id=ANY_TAIL)
    note = {"id": str(uuid.uuid4()), "role": "assistant", "parts": [{"type": "text", "text": "-"}]}
    await store.finish(lease, [note])


async def _record(conversations: Conversations, approval_id: str) -> ApprovalRecord:
    assert conversations.approvals is not None
    record = await conversations.approvals.get(approval_id)
    assert record is not None
    return record


async def test_approval__a_request_running_when_a_new_message_comes_may_have_run(
    conversations: Conversations, runtime: Runtime
) -> None:
    """A turn sent the approved call and died before recording it; a new message comes: the
    model is told the call may have run, never that it did not."""
    conversation, approval_id = await asked(conversations)
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    assert await runtime.storage.approvals.start_running(approval_id)
    outcome = await conversation.take_turn(TurnRequest("did it work?"))
    assert isinstance(outcome, Answered)
    messages = await conversation.store.messages(conversation.id)
    reason = part_of(messages[-3].message)["approval"]["reason"]
    assert "may have run" in reason
    assert "did not run" not in reason
    record = await _record(conversations, approval_id)
    assert (record.state, record.reason) == ("ran", "may_have_run")


async def test_approval__a_decision_refused_for_budget_ends_and_never_runs_by_itself(
    conversations: Conversations, database_url: str, tmp_path: Path
) -> None:
    """The decider is over a budget when the call is to run: the request ends (refused, with
    the reason), and when the budget allows again nothing runs without a fresh decision."""
    conversation, approval_id = await asked(conversations)
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    tight = await Runtime.open(
        Settings(database_url=database_url, model_provider="offline", budgets="all:day:1tokens")
    )
    try:
        there = await tight.conversations("test").get(conversation.id)
        assert isinstance(await there.carry_out(approval_id), OverBudget)
    finally:
        await tight.close()
    record = await _record(conversations, approval_id)
    assert (record.state, record.reason) == ("refused", "over_budget")
    # The budget no longer applies (this runtime has none), and the decision is long past.
    async with conversations.store.db.write() as conn:
        await conn.execute(update(ToolApproval.__table__).values(decided_at=ago(600)))
    assert conversations.approvals is not None
    assert await conversations.approvals.left_behind(60) == []
    assert isinstance(await conversation.carry_out(approval_id), AlreadyAnswered)
    assert notes(tmp_path) == {}
    # The next message tells the model why the call did not run.
    assert isinstance(await conversation.take_turn(TurnRequest("and?")), Answered)
    messages = await conversation.store.messages(conversation.id)
    assert "budget" in part_of(messages[-3].message)["approval"]["reason"]


async def test_approval__a_compaction_ends_the_waiting_request(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    await conversation.compact(await owner(conversations))
    record = await _record(conversations, approval_id)
    assert (record.state, record.reason) == ("superseded", "compacted")
    refused = await decide(conversations, approval_id, await owner(conversations))
    assert isinstance(refused, DecisionRefused)
    assert refused.reason == "moved_on"
    assert notes(tmp_path) == {}


async def test_approval__a_request_no_longer_the_tail_cannot_be_decided_or_carried_out(
    conversations: Conversations, tmp_path: Path
) -> None:
    conversation, approval_id = await asked(conversations)
    await _moved_on(conversation)
    refused = await decide(conversations, approval_id, await owner(conversations))
    assert isinstance(refused, DecisionRefused)
    assert refused.reason == "moved_on"
    record = await _record(conversations, approval_id)
    assert (record.state, record.reason) == ("superseded", "moved_on")
    # Decided while it was the tail, then the conversation moved on before it was carried out.
    other, second = await asked(conversations, "k2")
    assert isinstance(await decide(conversations, second, await owner(conversations)), Decided)
    await _moved_on(other)
    assert isinstance(await other.carry_out(second), AlreadyAnswered)
    record = await _record(conversations, second)
    assert (record.state, record.reason) == ("superseded", "moved_on")
    assert notes(tmp_path) == {}


async def test_approval__a_decision_not_carried_out_in_time_expires_and_never_runs(
    conversations: Conversations, runtime: Runtime, tmp_path: Path
) -> None:
    past = runtime.settings.approval_timeout_seconds + 60
    first, one = await asked(conversations)
    second, two = await asked(conversations, "k2")
    for approval_id in (one, two):
        assert isinstance(
            await decide(conversations, approval_id, await owner(conversations)), Decided
        )
    async with conversations.store.db.write() as conn:
        await conn.execute(update(ToolApproval.__table__).values(decided_at=ago(past)))
    # Carried out late: the model hears it expired.
    outcome = await second.carry_out(two)
    assert isinstance(outcome, Answered)
    messages = await second.store.messages(second.id)
    part = part_of(messages[-2].message)
    assert part["state"] == "output-denied"
    assert "not carried out in time" in part["approval"]["reason"]
    # Left behind: the pass ends it instead of running it.
    assert conversations.approvals is not None
    assert await conversations.approvals.left_behind(60) == []
    for approval_id in (one, two):
        record = await _record(conversations, approval_id)
        assert (record.state, record.reason) == ("expired", "decision_expired")
    assert notes(tmp_path) == {}
    assert await first.pending_approval() is None


async def test_approval__the_left_behind_pass_cannot_starve(
    conversations: Conversations, runtime: Runtime, tmp_path: Path
) -> None:
    """More decisions than one pass takes that nobody can carry out (their session is busy)
    come first; a real left-behind decision behind them is still found within a few passes."""
    approvals = runtime.storage.approvals
    store = conversations.store
    busy, _ = await asked(conversations, "busy")
    tail = await store.tail(busy.id)
    assert tail is not None
    batch = 20
    for index in range(batch + 5):
        stuck = await approvals.request(
            session_id=busy.id,
            message_id=tail.message_id,
            tool_call_id=f"call-{index}",
            tool_name="mcp__notes__add_note",
            server="notes",
            arguments={"title": f"stuck {index}", "text": "x"},
            digest="0" * 64,
            approvers=(),
        )
        assert await approvals.decide(stuck, approve=True, by="slack:T1:U1") is not None
    await store.start_turn(busy.id, user_message=None, last_message_id=ANY_TAIL)  # held
    real, approval_id = await asked(conversations, "real")
    assert isinstance(await decide(conversations, approval_id, await owner(conversations)), Decided)
    table = ToolApproval.__table__
    async with store.db.write() as conn:
        await conn.execute(update(table).values(decided_at=ago(600)))
        await conn.execute(  # the real one decided last
            update(table).where(table.c.id == approval_id).values(decided_at=ago(300))
        )
    assert conversations.approvals is not None
    found: list[str] = []
    for _ in range(3):
        found += [r.id for r in await conversations.approvals.left_behind(60)]
    assert approval_id in found
    outcome = await conversations.carry_out_left_behind(await _record(conversations, approval_id))
    assert isinstance(outcome, Answered)
    assert notes(tmp_path) == {"plan": "ship on friday"}
    assert real.id != busy.id


async def test_approval__a_call_asked_while_carrying_out_a_decision_is_the_askers_request(
    conversations: Conversations, monkeypatch: pytest.MonkeyPatch
) -> None:
    """U2 writes in U1's conversation; the model asks for a call (U2's request), U1 approves,
    and the model, continuing, asks for another: that one is still U2's request (the message
    being answered is theirs), not the decider's nor the owner's."""
    from core.providers import offline
    from core.providers.base import AssistantMessage, ToolCall, ToolResult

    answer = offline.respond

    def then_another(messages: Any, tools: Any, tool_choice: Any = None) -> Any:
        results = [m for m in messages if isinstance(m, ToolResult)]
        if len(results) == 1 and isinstance(messages[-1], ToolResult):
            later = {"title": "later", "text": "x"}
            return AssistantMessage(tool_calls=(ToolCall("second", "mcp__notes__add_note", later),))
        return answer(messages, tools, tool_choice)

    monkeypatch.setattr(offline, "respond", then_another)
    conversation = await conversations.open("k1", owner=await owner(conversations))
    outcome = await conversation.take_turn(TurnRequest(ADD, author="slack:T1:U2"))
    assert isinstance(outcome, Answered)
    assert outcome.result.approval is not None
    first = await conversations.approvals.get(outcome.result.approval.id)  # type: ignore[union-attr]
    assert first is not None
    assert first.requested_by == "slack:T1:U2"
    assert isinstance(await decide(conversations, first.id, await owner(conversations)), Decided)
    carried = await conversation.carry_out(first.id)
    assert isinstance(carried, Answered)
    assert carried.result.approval is not None
    second = await conversations.approvals.get(carried.result.approval.id)  # type: ignore[union-attr]
    assert second is not None
    assert second.arguments == {"title": "later", "text": "x"}
    assert second.requested_by == "slack:T1:U2"

"""Deciding a waiting tool call from the terminal with a reason (``/deny [reason]``,
``/approve [reason]``), as the web page and the API could already: the reason is kept with
the decision (``tool_approvals.decision_reason``) and the model is told it with the refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.storage.approvals import DECISION_REASON_MOST, Approvals
from core.storage.sessions import SessionStore
from tests.helpers import STARTING
from tests.mcp_support import notes, notes_config
from tests.terminal_harness import OPERATOR, ChatProcess
from tests.test_slack_approvals import ADD

# Real processes: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

REASON = "not before Friday's review"


async def test_chat__deny_with_a_reason__kept_with_the_decision_and_told_to_the_model(
    database_url: str, store: SessionStore, tmp_path: Path, chats: list[ChatProcess]
) -> None:
    chat = ChatProcess(database_url, MCP_CONFIG=notes_config(tmp_path))
    chats.append(chat)
    await chat.expect(f"as the local operator {OPERATOR}", within=STARTING)
    await chat.prompt()
    chat.line(ADD)
    await chat.expect("either followed by a reason", within=STARTING)  # the prompt says how
    await chat.prompt()
    chat.line("/deny " + "x" * (DECISION_REASON_MOST + 1))
    await chat.expect(f"at most {DECISION_REASON_MOST} characters")  # refused, still waiting
    await chat.prompt()
    chat.line(f"/deny {REASON}")
    told = f"{OPERATOR} declined it: {REASON}"  # what the model was told, in its answer
    await chat.until(lambda: told in " ".join(chat.log.split()), what=told)
    await chat.prompt()
    assert "moved on elsewhere" not in chat.log  # decided here: not news from elsewhere
    chat.line("/quit")
    assert await chat.exit_status() == 0

    assert notes(tmp_path) == {}  # nothing ran
    (session,) = await store.list_sessions(project_name="cli")
    stored = [m.message for m in await store.messages(session.id)]
    (part,) = [
        p for m in stored for p in m.get("parts", []) if str(p.get("type")).startswith("tool-mcp")
    ]
    assert part["approval"]["approved"] is False
    assert part["approval"]["reason"] == f"{OPERATOR} declined it: {REASON}"  # the model's
    record = await Approvals(store.db, timeout_seconds=600).get(part["approval"]["id"])
    assert record is not None
    assert (record.state, record.decided_by, record.decision_reason) == (
        "declined",
        OPERATOR,
        REASON,
    )
    assert "x" * DECISION_REASON_MOST not in json.dumps(stored)  # the refused one went nowhere

"""``slack-agent chat``, driven through a pseudo-terminal as a person would (issue 7).

Every test spawns the real command (``tests.terminal_harness``) and waits for what it prints;
the database is then read through the core. Tests where the turn lock decides the outcome
(busy, stale, Ctrl-C mid-reply) run on SQLite and PostgreSQL; the busy races and the Slack side
of the story use real ``serve`` processes. Exits: Ctrl-D (new session), Ctrl-C at the prompt
(rewind/fork/compact) and ``/quit`` (the rest) all end with status 0.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import text

from bot import texts as slack_text
from core.messages import assistant_message, message_text, user_message
from core.records import StoredMessage
from core.storage.sessions import SessionStore
from core.storage.snapshots import load_state, messages_with_snapshots
from core.storage.surface_state import SurfaceState
from standins.openai import GatedModel
from standins.slack import SlackClient, SlackStandIn
from terminal.render import message_view, tool_block
from tests.helpers import add_exchange, new_session
from tests.slack_harness import ServeProcess
from tests.terminal_harness import OPERATOR, ChatProcess, chat_env

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

LINK = "https://acme.slack.com/archives/C1/p{digits}"
# The lock decides the tests that run on both databases; the others read and print.
SQLITE_ONLY = pytest.mark.parametrize("backend", ["sqlite"])


def link(ts: str, thread_ts: str | None = None) -> str:
    url = LINK.format(digits=ts.replace(".", ""))
    return f"{url}?thread_ts={thread_ts}&cid=C1" if thread_ts else url


def openai_env(model: GatedModel) -> dict[str, str]:
    return {
        "MODEL_PROVIDER": "openai",
        "OPENAI_API_KEY": "sk-test",
        "OPENAI_BASE_URL": model.base_url,
    }


async def texts(store: SessionStore, session_id: int) -> list[str]:
    return [message_text(m.message) for m in await store.messages(session_id)]


async def slack_session(store: SessionStore, root: str) -> int:
    found = await store.find_session("slack", f"T1/C1/{root}")
    assert found is not None
    return found.id


# -- bad input ----------------------------------------------------------------------------------


BAD_INPUT = [
    ("424242", "agent_session_not_found"),
    (link("1700000099.000001"), "agent_session_not_found"),
    ("https://acme.slack.com/archives/C1/not-a-message", "usage_error"),
    ("my-session", "usage_error"),
]


def test_history__a_tool_part_shows_its_output_once_and_an_mcp_result_its_text() -> None:
    """The answer after a call says only how it ended (the offline model), so the tool block is
    where a result is read: a command's output, or a stored MCP call's result text."""
    shell = tool_block("cat notes.txt", {"stdout": "one\n", "stderr": "", "exit_code": 0})
    mcp = tool_block(
        "mcp__notes__read_note", {"text": "ship on friday", "outcome": "ok"}, shell=False
    )
    assert shell.plain == "$ cat notes.txt\none"
    assert mcp.plain == "call mcp__notes__read_note\nship on friday"  # not typed at a shell


def test_history__a_stored_mcp_call_is_a_call_and_a_shell_command_a_dollar_line() -> None:
    """Read back, a call to an MCP tool is not shown as if typed at a shell."""
    answer: Any = {
        "role": "assistant",
        "parts": [
            {
                "type": "tool-shell",
                "input": {"command": "ls"},
                "state": "output-available",
                "output": {"stdout": "notes.txt\n", "stderr": "", "exit_code": 0},
            },
            {
                "type": "tool-mcp__notes__read_note",
                "input": {"title": "plan"},
                "state": "output-available",
                "output": {"text": "ship on friday"},
            },
        ],
    }
    console = Console(width=80, record=True)
    console.print(message_view(StoredMessage("m1", 3, answer, False), "terminal:me"))
    shown = console.export_text()
    assert "$ ls\nnotes.txt" in shown
    assert "call mcp__notes__read_note\nship on friday" in shown
    assert "$ mcp__" not in shown


def test_chat__bad_input_is_one_line_on_stderr_and_status_2(tmp_path: Path) -> None:
    """Unknown id, a link naming no session, a malformed link, something that is neither, an
    unreachable database (other malformed links: ``test_permalinks``). The processes run side
    by side: most of each one's time is Python starting."""
    sqlite = f"sqlite+aiosqlite:///{tmp_path}/chat.db"
    cases = [(sqlite, argument, code) for argument, code in BAD_INPUT]
    cases.append(("postgresql+asyncpg://nobody@127.0.0.1:1/nothing", "1", "database_error"))
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "bot", "chat", argument],
            env=chat_env(url),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for url, argument, _ in cases
    ]
    for (_, argument, code), proc in zip(cases, running, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (argument, out, err)
        assert err.count("\n") == 1, (argument, err)
        assert err.startswith(f"slack-agent: {code}: "), (argument, err)
        assert "Traceback" not in out + err


# -- a session from the terminal ----------------------------------------------------------------


@SQLITE_ONLY
async def test_chat__new_session_streams_tool_calls_then_history_and_ctrl_d_exits_0(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    chat = ChatProcess(database_url)
    chats.append(chat)
    await chat.expect(f"as the local operator {OPERATOR}")
    await chat.prompt()
    chat.line("$ echo kept > notes.txt; cat notes.txt")
    await chat.expect("$ echo kept > notes.txt; cat notes.txt")  # the tool call, as it runs
    await chat.expect("kept")  # its output
    await chat.expect("ran in the sandbox")  # the answer after it
    await chat.prompt()
    chat.line("/history")
    await chat.expect("[sandbox]")
    await chat.prompt()
    chat.ctrl_d()
    assert await chat.exit_status() == 0

    (session,) = await store.list_sessions(project_name="cli")
    assert session.user_id == await store.get_or_create_user(OPERATOR)
    messages = await store.messages(session.id)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[0].message["metadata"]["author"] == OPERATOR
    assert await messages_with_snapshots(store.db, session.id) == {messages[1].message_id}
    assert not session.is_turn_active


@SQLITE_ONLY
async def test_chat__permalink_of_a_reply_opens_the_thread_checkpoint_first_and_names_the_owner(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    root, reply = "1700000000.000100", "1700000000.000200"
    _, session = await new_session(store, "slack:T1:U1", key=f"T1/C1/{root}")
    state = SurfaceState(store.db, "slack")
    await state.bind_thread(f"T1/C1/{root}", session.id)
    await store.import_messages(
        session.id,
        [
            (user_message("long ago"), False),
            (assistant_message("an old answer"), False),
            (user_message("CHECKPOINT-BODY"), True),
            (user_message("after the checkpoint"), False),
            (assistant_message("the **latest** answer"), False),
        ],
    )
    chat = ChatProcess(database_url, link(reply, root))
    chats.append(chat)
    await chat.expect(f"Session {session.id}")
    log = await chat.expect("the latest answer")  # Markdown rendered: no asterisks
    assert "belongs to slack:T1:U1" in log
    assert "[2] checkpoint" in log
    assert "after the checkpoint" in log
    assert "long ago" not in log
    assert "an old answer" not in log
    await chat.prompt()
    chat.line("/history")
    await chat.expect("long ago")
    await chat.prompt()
    chat.line("/quit")
    assert await chat.exit_status() == 0


@SQLITE_ONLY
async def test_chat__rewind_fork_compact_and_discard(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, OPERATOR)
    await add_exchange(store, session.id, 2)
    chat = ChatProcess(database_url, str(session.id))
    chats.append(chat)
    await chat.expect("answer 1")
    await chat.prompt()
    chat.line("/fork 1")
    log = await chat.expect("Continue it with")
    forked = [s for s in await store.list_sessions(project_name="cli")]
    assert len(forked) == 1
    assert f"Forked into session {forked[0].id}" in log
    assert await texts(store, forked[0].id) == ["question 0", "answer 0"]
    await chat.prompt()
    chat.line("/rewind 2")
    await chat.expect("Rewound: 2 message(s)")
    # The withdrawn user message is back in the line editor, not lost.
    await chat.until(lambda: chat.cursor_line().endswith("> question 1"), what="the draft")
    assert await texts(store, session.id) == ["question 0", "answer 0"]
    chat.line("")  # Enter sends it again
    await chat.expect("question 1")
    await chat.prompt()
    chat.line("/compact the answers")
    await chat.expect("Compacted into a checkpoint")
    await chat.prompt()
    chat.line("/compact")
    await chat.expect("already ends with a checkpoint")
    await chat.prompt()
    chat.line("/discard")
    await chat.expect("No message is waiting")
    await chat.prompt()
    chat.line("/frobnicate now")
    await chat.expect("Unknown command /frobnicate")
    await chat.until(lambda: chat.cursor_line().endswith("> /frobnicate now"), what="line back")
    chat.ctrl_c()
    assert await chat.exit_status() == 0
    messages = await store.messages(session.id)
    assert messages[-1].is_compaction_message
    assert not (await store.get_session(session.id)).is_turn_active


# -- other surfaces at the same time ------------------------------------------------------------


@SQLITE_ONLY
async def test_chat__idle_prompt_prints_what_others_add_without_losing_the_typed_line(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, "slack:T1:U1")
    chat = ChatProcess(database_url, str(session.id))
    chats.append(chat)
    await chat.prompt()
    chat.type("half a line")
    await chat.until(lambda: chat.cursor_line().endswith("> half a line"), what="typing")
    await add_exchange(store, session.id)  # another surface adds a question and its answer
    await chat.expect("new message(s) from elsewhere")
    await chat.expect("answer 0")
    await chat.until(lambda: chat.cursor_line().endswith("> half a line"), what="line intact")
    chat.line(" finished")
    await chat.expect("half a line finished")
    await chat.prompt()
    chat.line("/quit")
    assert await chat.exit_status() == 0
    assert await texts(store, session.id) == [
        "question 0",
        "answer 0",
        "half a line finished",
        (await texts(store, session.id))[-1],
    ]


async def test_chat__stale_prints_the_unseen_messages_and_enter_sends_the_kept_one(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, "slack:T1:U1")
    await add_exchange(store, session.id)
    # Idle polling is slow here, so the terminal has not seen the addition when it sends.
    chat = ChatProcess(database_url, str(session.id), SESSION_POLL_SECONDS=3600)
    chats.append(chat)
    await chat.expect("answer 0")
    await chat.prompt()
    # Another surface's turn, through the same core calls a Slack replica makes.
    tail = await store.tail(session.id)
    assert tail is not None
    lease = await store.start_turn(
        session.id,
        user_message=user_message("from slack meanwhile"),
        last_message_id=tail.message_id,
    )
    await store.finish(lease, [assistant_message("slack's answer")])
    chat.line("from the terminal")
    await chat.expect("slack's answer")
    await chat.expect("moved on elsewhere")
    await chat.expect("Your message was not sent")
    assert "from the terminal" not in await texts(store, session.id)
    await chat.prompt()
    chat.line("")
    await chat.expect('You said: "from the terminal"')
    await chat.prompt()
    chat.line("/quit")
    assert await chat.exit_status() == 0
    assert (await texts(store, session.id))[:5] == [
        "question 0",
        "answer 0",
        "from slack meanwhile",
        "slack's answer",
        "from the terminal",
    ]


async def test_chat__busy_waits_then_stops_checking_and_enter_still_sends_when_free(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, "slack:T1:U1")
    # Another surface's turn holds the lock (the same core call a Slack replica makes).
    lease = await store.start_turn(
        session.id, user_message=user_message("held elsewhere"), last_message_id=None
    )
    chat = ChatProcess(
        database_url, str(session.id), BUSY_POLL_SECONDS=0.2, BUSY_POLL_TIMEOUT_SECONDS=0.6
    )
    chats.append(chat)
    await chat.expect("held elsewhere")
    await chat.prompt()
    chat.line("wait for me")
    await chat.expect("being used elsewhere")
    await chat.expect("I stopped checking")
    await chat.prompt()
    chat.line("another line")  # a second message while one waits goes back to the editor
    await chat.expect("A message is already waiting")
    await chat.until(lambda: chat.cursor_line().endswith("> another line"), what="line back")
    chat.type("\x15")  # Ctrl-U: the person clears the line
    await chat.prompt()
    await store.finish(lease, [assistant_message("done elsewhere")])
    await chat.expect("done elsewhere")  # idle polling shows it, so the send is not stale
    await chat.prompt()
    chat.line("")  # Enter sends the waiting message
    await chat.expect('You said: "wait for me"')
    await chat.prompt()
    chat.line("/quit")
    assert await chat.exit_status() == 0
    assert (await texts(store, session.id))[:3] == [
        "held elsewhere",
        "done elsewhere",
        "wait for me",
    ]


@SQLITE_ONLY
async def test_chat__a_send_that_fails_keeps_the_line_and_enter_sends_it_again(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, OPERATOR)
    chat = ChatProcess(database_url, str(session.id))
    chats.append(chat)
    await chat.prompt()
    # The messages table goes away: the claim's transaction fails and rolls back whole.
    async with store.db.write() as conn:
        await conn.execute(
            text("ALTER TABLE agent_session_messages RENAME TO agent_session_messages_away")
        )
    chat.line("precious words")
    await chat.expect("could not be sent")
    assert not await store.is_turn_active(session.id)
    async with store.db.write() as conn:
        await conn.execute(
            text("ALTER TABLE agent_session_messages_away RENAME TO agent_session_messages")
        )
    await chat.prompt()
    chat.line("")
    await chat.expect('You said: "precious words"')
    await chat.prompt()
    chat.line("/quit")
    assert await chat.exit_status() == 0
    assert (await texts(store, session.id))[0] == "precious words"


async def test_chat__ctrl_c_mid_reply_keeps_the_partial_answer_and_frees_the_lock_at_once(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, OPERATOR)
    async with GatedModel(early="PARTIAL-WORDS ", command="echo made > kept.txt") as model:
        chat = ChatProcess(database_url, str(session.id), **openai_env(model))
        chats.append(chat)
        await chat.prompt()
        chat.line("write a long essay")
        await chat.expect("$ echo made > kept.txt")
        await chat.expect("PARTIAL-WORDS")  # streamed, then the model holds the rest
        assert await store.is_turn_active(session.id)
        chat.ctrl_c()
        await chat.expect("Interrupted")
        # Freed at once: the staleness window (60 s by default) has not passed.
        assert not await store.is_turn_active(session.id)
        messages = await store.messages(session.id)
        assert [m.role for m in messages] == ["user", "assistant"]
        partial = messages[1]
        assert partial.message["metadata"]["interrupted"] is True
        assert "PARTIAL-WORDS" in message_text(partial.message)
        state = await load_state(store.db, session.id)
        assert state is not None
        assert state.message_id == partial.message_id
        await chat.prompt()
        chat.line("/history")
        await chat.expect("(interrupted)  [sandbox]")
        await chat.prompt()
        chat.line("/quit")
        assert await chat.exit_status() == 0


# -- against real serve processes ---------------------------------------------------------------


async def test_busy_race__terminal_meets_a_slack_turn_waits_and_enter_sends_when_free(
    database_url: str, slack: SlackStandIn, store: SessionStore, chats: list[ChatProcess]
) -> None:
    async with GatedModel() as model:
        serve = ServeProcess(database_url, slack, **openai_env(model))
        try:
            await serve.ready()
            async with SlackClient(serve.url) as to_slack:
                root = await to_slack.message("slack asks first", mention=True)
                await asyncio.wait_for(model.arrived.wait(), 30)  # the Slack turn holds the lock
                session_id = await slack_session(store, root)
                chat = ChatProcess(database_url, link(root), **openai_env(model))
                chats.append(chat)
                await chat.expect("slack asks first")
                await chat.prompt()
                chat.line("the terminal asks")
                await chat.expect("being used elsewhere")
                assert "the terminal asks" not in await texts(store, session_id)
                await chat.prompt()
                chat.line("/history")  # commands stay usable while the message waits
                await chat.expect("slack asks first")
                model.release()
                await chat.expect("answer 1")  # the Slack answer, printed from elsewhere
                await chat.expect("The session is free now")
                await chat.prompt()
                chat.line("")
                await chat.expect("answer 2")
                await chat.prompt()
                chat.line("/quit")
                assert await chat.exit_status() == 0
        finally:
            await serve.astop()
    assert await texts(store, session_id) == [
        "slack asks first",
        "answer 1",
        "the terminal asks",
        "answer 2",
    ]
    assert model.max_in_flight == 1


async def test_busy_race__slack_meets_a_terminal_turn_and_is_offered_its_message_after(
    database_url: str, slack: SlackStandIn, store: SessionStore, chats: list[ChatProcess]
) -> None:
    async with GatedModel() as model:
        serve = ServeProcess(database_url, slack, **openai_env(model))
        try:
            await serve.ready()
            async with SlackClient(serve.url) as to_slack:
                model.release()
                root = await to_slack.message("slack starts", mention=True)
                await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 1)
                session_id = await slack_session(store, root)
                model.gate.clear()
                model.arrived.clear()
                chat = ChatProcess(database_url, str(session_id), **openai_env(model))
                chats.append(chat)
                await chat.expect("answer 1")
                await chat.prompt()
                chat.line("the terminal continues")
                await asyncio.wait_for(model.arrived.wait(), 30)  # the terminal's turn runs
                await to_slack.message("slack meanwhile", thread_ts=root, user="U2")
                await slack.wait_for(
                    lambda: slack_text.busy_notice() in [c.text for c in slack.ephemerals("U2")]
                )
                assert "slack meanwhile" not in await texts(store, session_id)
                model.release()
                await chat.expect("answer 2")
                offer = await slack.wait_for(
                    lambda: [c for c in slack.ephemerals("U2") if c.args.get("blocks")]
                )
                assert "free now" in offer[0].text
                await chat.prompt()
                chat.line("/quit")
                assert await chat.exit_status() == 0
        finally:
            await serve.astop()
    assert await texts(store, session_id) == [
        "slack starts",
        "answer 1",
        "the terminal continues",
        "answer 2",
    ]
    assert model.max_in_flight == 1


async def test_stale__slack_thread_shows_what_the_terminal_added_before_sending(
    database_url: str, slack: SlackStandIn, store: SessionStore, chats: list[ChatProcess]
) -> None:
    serve = ServeProcess(database_url, slack)
    try:
        await serve.ready()
        async with SlackClient(serve.url) as to_slack:
            root = await to_slack.message("hello from slack", mention=True)
            await slack.wait_for(lambda: len(slack.named("chat.stopStream")) == 1)
            session_id = await slack_session(store, root)
            chat = ChatProcess(database_url, link(root))
            chats.append(chat)
            await chat.prompt()
            chat.line("TERMINAL-WORDS")
            await chat.expect('You said: "TERMINAL-WORDS"')
            await chat.prompt()
            chat.line("/quit")
            assert await chat.exit_status() == 0
            await to_slack.message("back in slack", thread_ts=root)
            await slack.wait_for(lambda: "continued elsewhere" in slack.shown(root))
            assert "TERMINAL-WORDS" in slack.shown(root)
            offer = await slack.wait_for(
                lambda: [c for c in slack.ephemerals() if c.args.get("blocks")]
            )
            assert "Send it anyway" in offer[0].text
    finally:
        await serve.astop()
    assert "back in slack" not in await texts(store, session_id)


# -- what others wrote never drives the operator's terminal ---------------------------------------

# A screen clear, an OSC 52 clipboard write (BEL- and ST-terminated), a carriage return that
# overwrites the line, and the 8-bit CSI.
HOSTILE = "\x1b[2J\x1b]52;c;b3duZWQ=\x07\x1b]52;p;b3duZWQ=\x1b\\\rCLOBBER\x9b2J"


@SQLITE_ONLY
async def test_chat__control_sequences_from_slack_and_the_sandbox_never_reach_the_terminal(
    database_url: str, store: SessionStore, chats: list[ChatProcess]
) -> None:
    _, session = await new_session(store, "slack:T1:U1")
    await store.import_messages(
        session.id,
        [
            (user_message(f"from slack {HOSTILE} end-of-user"), False),
            (assistant_message(f"**answer** {HOSTILE} end-of-answer"), False),
        ],
    )
    chat = ChatProcess(database_url, str(session.id))
    chats.append(chat)
    await chat.expect("end-of-answer")
    await chat.prompt()
    chat.line("$ printf 'out\\033]52;c;b3duZWQ=\\007\\033[2J\\rtail'; echo; echo done-printing")
    await chat.expect("done-printing")
    await chat.prompt()
    chat.line("/quit")
    assert await chat.exit_status() == 0
    for sequence in ("\x1b[2J", "\x1b]52", "\x9b", "\rCLOBBER", "\rtail"):
        assert sequence not in chat.raw, sequence
    assert "CLOBBER" in chat.log  # the words themselves remain
    assert "end-of-user" in chat.log

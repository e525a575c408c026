"""The offline stand-in: deterministic, labelled, able to drive a tool call and a checkpoint."""

from __future__ import annotations

import json

import pytest

from core.agent.compaction import SECTIONS, Checkpoint, render_checkpoint
from core.errors import ModelProviderRejected
from core.messages import assistant_message, user_message
from core.providers import (
    OFFLINE_LABEL,
    AssistantMessage,
    Finish,
    OfflineProvider,
    SystemMessage,
    TextDelta,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
    estimate_usage,
    step_start_part,
    text_part,
    tool_call_part,
    tool_output_part,
    ui_to_chat,
)
from core.providers.offline import CHECKPOINT_SECTIONS, respond
from tests.providers_fixtures import collect, text_of

SHELL = ToolSpec("shell", "Run a command in the sandbox.")
CHECKPOINT = ToolSpec("write_checkpoint", "Write the checkpoint.")


async def test_reply__is_labelled_echoes_and_is_the_same_every_time() -> None:
    provider = OfflineProvider()
    conversation = [SystemMessage("You are helpful."), UserMessage("What is in /tmp?")]

    first = await collect(provider, conversation, [SHELL])
    second = await collect(provider, conversation, [SHELL])

    assert first == second
    text = text_of(first)
    assert text.startswith(OFFLINE_LABEL)
    assert '"What is in /tmp?"' in text
    assert sum(isinstance(e, TextDelta) for e in first) > 1  # streamed, not one lump
    assert first[-1] == Finish("stop")


async def test_dollar_command__becomes_a_shell_call_with_a_deterministic_id() -> None:
    conversation = [UserMessage("$ ls -la /work")]
    events = await collect(OfflineProvider(), conversation, [SHELL])

    call = ToolCall("offline_call_1", "shell", {"command": "ls -la /work"})
    assert events == [
        call,
        estimate_usage(conversation, [SHELL], AssistantMessage(tool_calls=(call,))),
        Finish("tool_calls"),
    ]


async def test_tool_result__is_summarised_by_what_ran_and_how_it_ended_not_quoted() -> None:
    """The surfaces show a call's output where the call is; the answer after it says what ran
    and a short reference (line count), never the output again (issue 35)."""
    call = ToolCall("offline_call_1", "shell", {"command": "cat notes.txt"})
    conversation = [
        UserMessage("$ cat notes.txt"),
        AssistantMessage(tool_calls=(call,)),
        ToolResult(call.id, "shell", "line one\nline two\n"),
    ]

    text = text_of(await collect(OfflineProvider(), conversation, [SHELL]))

    assert text == f"{OFFLINE_LABEL} `cat notes.txt` ran in the sandbox: 2 lines of output."
    assert "line one" not in text


def test_tool_result__json_shell_output_is_referred_to_by_its_exit_status_and_lines() -> None:
    call = ToolCall("offline_call_1", "shell", {"command": "grep x missing"})
    output = json.dumps({"stdout": "", "stderr": "no such file\n", "exit_code": 2})
    conversation = [
        UserMessage("$ grep x missing"),
        AssistantMessage(tool_calls=(call,)),
        ToolResult(call.id, "shell", output),
    ]

    reply = respond(conversation, [SHELL])

    assert reply.text == (
        f"{OFFLINE_LABEL} `grep x missing` ran in the sandbox: exit status 2, 1 line of output."
    )


def test_tool_result__an_error_is_a_reason_and_is_said() -> None:
    """An error result is not output a surface showed but why the call did not run."""
    call = ToolCall("offline_call_1", "mcp__notes__add_note", {"title": "x"})
    conversation = [
        UserMessage('mcp__notes__add_note {"title": "x"}'),
        AssistantMessage(tool_calls=(call,)),
        ToolResult(call.id, call.name, "not run: declined by alice.\nmore", is_error=True),
    ]

    reply = respond(conversation, [ToolSpec(call.name, "Add a note.")])

    assert reply.text == (
        f'{OFFLINE_LABEL} `mcp__notes__add_note {{"title": "x"}}` failed: '
        "not run: declined by alice."
    )


def test_dollar_command__without_a_shell_tool_says_so() -> None:
    reply = respond([UserMessage("$ rm -rf /")], [])

    assert reply.tool_calls == ()
    assert reply.text.startswith(OFFLINE_LABEL)
    assert "`rm -rf /`" in reply.text


async def test_stored_tool_turn__replays_through_ui_to_chat() -> None:
    """A transcript stored with the AI SDK tool parts drives the stand-in as a live turn does."""
    call = ToolCall("offline_call_1", "shell", {"command": "echo hi"})
    stored = [
        user_message("$ echo hi"),
        {
            "id": "a1",
            "role": "assistant",
            "parts": [step_start_part(), tool_output_part(call, "hi\n")],
            "metadata": {},
        },
        user_message("$ pwd"),
    ]

    events = await collect(OfflineProvider(), ui_to_chat(stored), [SHELL])

    assert events[0] == ToolCall("offline_call_2", "shell", {"command": "pwd"})


async def test_forced_checkpoint__has_every_section_as_a_list_built_from_the_conversation() -> None:
    call = ToolCall("offline_call_1", "shell", {"command": "make build"})
    failed = ToolCall("offline_call_2", "shell", {"command": "make test"})
    conversation = [
        UserMessage("Build the report for Q3 in /work/report.md"),
        AssistantMessage("Sure."),
        UserMessage("It must stay under 2 pages."),
        UserMessage("$ make build"),
        AssistantMessage(tool_calls=(call,)),
        ToolResult(call.id, "shell", "built report.md (2 pages)\n"),
        UserMessage("$ make test"),
        AssistantMessage(tool_calls=(failed,)),
        ToolResult(failed.id, "shell", "3 tests failed", is_error=True),
        AssistantMessage("Tests fail."),
    ]

    events = await collect(
        OfflineProvider(), conversation, [SHELL, CHECKPOINT], tool_choice="write_checkpoint"
    )

    (checkpoint,) = [e for e in events if isinstance(e, ToolCall)]
    assert checkpoint.name == "write_checkpoint"
    assert tuple(checkpoint.arguments) == CHECKPOINT_SECTIONS == SECTIONS
    assert all(isinstance(items, list) for items in checkpoint.arguments.values())
    assert checkpoint.arguments["objectives"] == ["Build the report for Q3 in /work/report.md"]
    assert checkpoint.arguments["constraints"] == ["It must stay under 2 pages."]
    assert checkpoint.arguments["completed_work"] == ["ran `make build`: built report.md (2 pages)"]
    assert checkpoint.arguments["blockers"] == ["`make test` failed: 3 tests failed"]
    assert events[-1] == Finish("tool_calls")
    assert text_of(events) == ""


def test_forced_checkpoint__carries_an_earlier_checkpoint_forward() -> None:
    earlier = Checkpoint(
        {
            "objectives": ["Migrate the billing DB to PostgreSQL 16"],
            "decisions": ["Use pg_dump --format=custom"],
        }
    )
    rendered = render_checkpoint(earlier)
    conversation = [UserMessage(rendered), UserMessage("Also keep the old dump for 30 days")]

    reply = respond(conversation, [CHECKPOINT], "write_checkpoint")

    (call,) = reply.tool_calls
    assert call.arguments["objectives"] == [
        "Migrate the billing DB to PostgreSQL 16",
        "Also keep the old dump for 30 days",
    ]
    assert call.arguments["decisions"] == ["Use pg_dump --format=custom"]
    assert call.arguments["active_work"] == ["Also keep the old dump for 30 days"]


def test_forced_checkpoint__is_deterministic_for_stored_messages() -> None:
    stored = [
        user_message("Plan the launch"),
        assistant_message("Here is a plan."),
        {"id": "a2", "role": "assistant", "parts": [text_part("More.")], "metadata": {}},
    ]
    conversation = ui_to_chat(stored)

    assert respond(conversation, [CHECKPOINT], "write_checkpoint") == respond(
        conversation, [CHECKPOINT], "write_checkpoint"
    )


async def test_forced_unknown_tool__is_rejected() -> None:
    other = ToolSpec("send_email", "Send an email.")

    with pytest.raises(ModelProviderRejected, match="send_email"):
        await collect(OfflineProvider(), [UserMessage("hi")], [other], tool_choice="send_email")


def test_tool_call_part__interrupted_call_is_answered_so_the_history_stays_valid() -> None:
    call = ToolCall("c1", "shell", {"command": "sleep 100"})
    stored = [
        user_message("$ sleep 100"),
        {"id": "a1", "role": "assistant", "parts": [tool_call_part(call)], "metadata": {}},
    ]

    reply = respond(ui_to_chat(stored), [SHELL])

    assert reply.text.startswith(f"{OFFLINE_LABEL} `sleep 100` failed")


async def test_usage__is_an_estimate_from_what_was_sent_and_what_came_back_marked_so() -> None:
    short = await collect(OfflineProvider(), [UserMessage("hi")])
    longer = await collect(OfflineProvider(), [UserMessage("hi " * 400)], [SHELL])

    (small,) = [e for e in short if isinstance(e, Usage)]
    (large,) = [e for e in longer if isinstance(e, Usage)]
    assert small.estimated
    assert large.estimated
    # About four characters a token, what was sent (and the tools offered) in, the reply out.
    assert small.input_tokens == 1
    assert small.output_tokens == -(-len(text_of(short)) // 4)
    assert (large.input_tokens or 0) > 300
    assert short.index(small) == len(short) - 2  # just before Finish

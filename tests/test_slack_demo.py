"""``slack-agent demo`` plays its whole story on a fresh machine."""

from __future__ import annotations

import re

import pytest

from slack_agent.demo import run_demo

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow


async def test_demo__plays_every_step_and_loses_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    await run_demo()
    out = capsys.readouterr().out
    assert "[offline stand-in]" in out
    assert "I'll answer yours right after" in out
    assert "[Send] [Discard]" in out
    assert "Forked from" in out
    assert "step one done" in out.split("Bob's fork")[1]  # the sandbox came with the fork
    terminal = out.split("── the terminal: slack-agent chat ")[1]
    assert "step two done (terminal)" in terminal  # the real client ran a turn in the sandbox
    refreshed = terminal.split("after the terminal client continued it")[1]
    assert "continued elsewhere" in refreshed  # and Slack showed what it added
    assert "[Send anyway] [Discard]" in refreshed
    assert "rewound the conversation" in out
    assert "compacted into a checkpoint" in out
    asked = out.split("the agent asks before it writes a note")[1]
    assert "mcp__notes__add_note" in asked  # the card
    assert "[Approve] [Deny]" in asked
    approved = out.split("after Alice approved on replica B")[1]
    assert "Approved by @alice; the call ran." in approved  # the card shows the outcome, as Slack
    assert "<@U0" not in out  # shows a mention: by name
    assert "saved note 'release'" in approved  # and the answer continued from the result
    assert 'The notes server now holds: {"release": "ship on friday"}' in out
    assert "nothing lost" in out


async def test_demo__every_scene_says_only_what_happened(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Read as a newcomer reads it: what a thread says the terminal did, a terminal scene showed
    first; the checkpoint summarises the conversation, never the request that asked for it; the
    terminal's output has no padding lines."""
    await run_demo()
    out = capsys.readouterr().out
    shown = out.index("> summarise the thread")  # the terminal scene, before the thread says so
    assert out.index("*user*: summarise the thread") > shown
    assert "(from the terminal)" not in out
    assert "(terminal) the thread so far" not in out
    checkpoint = out.split("compacted into a checkpoint:")[1].split("── ")[0]
    assert "*Objectives*" in checkpoint
    assert "checkpoint" not in checkpoint.lower()  # its own instruction is not the work
    terminal = out.split("── the terminal: slack-agent chat ")[1].split("── ")[0]
    lines = terminal.strip().splitlines()[1:]
    blank = [i for i, line in enumerate(lines) if not line.strip()]
    assert not blank, terminal  # the answer is one paragraph: no stray blank lines
    assert not [line for line in lines if line.startswith("   ")], terminal  # nor padding
    # A reply that began with a command is its task card: no empty "agent:" line above it.
    empty = [
        line
        for line in out.splitlines()
        if re.fullmatch(r"  \w+( \(only visible to you\))?: ?", line)
    ]
    assert not empty, empty


def _scenes(out: str) -> dict[str, str]:
    """The demo's scenes by title: the text after each ``── title`` line up to the next."""
    scenes: dict[str, str] = {}
    for chunk in out.split("\n── ")[1:]:
        title, _, body = chunk.partition("\n")
        scenes[title.split(" ──")[0].split(" (as ")[0]] = body
    return scenes


def _words(text: str) -> str:
    """Text as a reader reads it: Markdown's backticks and line wrapping left out."""
    return " ".join(text.replace("`", "").split())


async def test_demo__a_commands_output_is_shown_once_in_every_scene(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 35: the terminal printed a command's output, then the answer quoted it again after
    a blank line. Each scene shows a call's output once, where the call is (the terminal's tool
    block, Slack's task card); the answer after it is there and says how the call ended."""
    await run_demo()
    out = capsys.readouterr().out
    assert "\n\n\n" not in out  # never two blank lines in a row
    scenes = _scenes(out)
    (terminal,) = [body for title, body in scenes.items() if "slack-agent chat" in title]
    lines = terminal.rstrip("\n").splitlines()
    assert not [line for line in lines if not line.strip()], terminal  # no blank line inside
    printed = terminal.replace("echo 'step two done (terminal)'", "")  # the command left out
    assert printed.count("step one done") == 1, terminal  # its output: once
    assert printed.count("step two done (terminal)") == 1, terminal
    assert "ran in the sandbox" in terminal  # and the answer after it
    assert "exit status 0, 2 lines of output" in _words(terminal)
    # Slack: the task card carries the output, the answer says how the call ended.
    done = scenes["#general, once the first reply was done"]
    assert done.replace("echo 'step one done'", "").count("step one done") == 1  # the card
    assert "(complete): step one done" in done
    assert "ran in the sandbox: exit status 0, 1 line of output." in done
    fork = scenes["#general, Bob's fork"]
    assert fork.count("step one done") == 1  # the card: the file came with the fork
    approved = scenes["#general, after Alice approved on replica B"]
    assert approved.count("saved note 'release'") == 1  # the card
    assert "answered: 1 line of output." in approved
    # What a thread says the terminal did, a terminal scene showed: word for word.
    shown = _words("".join(body for title, body in scenes.items() if "the terminal" in title))
    told = [
        line.split("*", 2)[2].removeprefix(": ")
        for body in scenes.values()
        for line in body.splitlines()
        if line.strip().startswith(("*user*:", "*agent*:"))
    ]
    assert told
    for said in told:
        assert _words(said) in shown, said

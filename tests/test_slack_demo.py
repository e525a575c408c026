"""``slack-agent demo`` plays its whole story on a fresh machine."""

from __future__ import annotations

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
    assert "Approved by <@U0ALICE>; the call ran." in approved  # the card shows the outcome
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
    assert len(blank) <= 1, terminal  # one paragraph break in the answer, no stray blank lines
    assert not [line for line in lines if line.startswith("   ")], terminal  # nor padding

"""What a person reads before approving a call: every argument, nothing hidden or reordered, on
the Slack card (and its *Show all* modal, within Block Kit's limits) and in the terminal."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from bot import texts as slack
from core.conversation import argument_lines, pages
from standins.slack import block_limits
from terminal import texts as terminal

# A call whose argument that matters sorts after a long one: a cut at any fixed length hid it.
PUSHED = {"body": "x" * 5_000, "to": "attacker@example.com"}
# Characters that hide or reorder what is read: bidi override and isolate, zero-width space and
# joiner, a no-break space, a tag character, a line separator, an escape (ANSI), a C1 control.
HIDDEN = "\u202e\u2066\u200b\u200d\u00a0\U000e0041\u2028\x1b\x9b"


def _unescape(mrkdwn: str) -> str:
    return mrkdwn.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def _code_texts(blocks: list[dict[str, Any]]) -> list[str]:
    """The code blocks' contents, as Slack shows them."""
    found = []
    for block in blocks:
        inner = (block.get("text") or {}).get("text", "")
        if block["type"] == "section" and inner.startswith("```"):
            found.append(_unescape(inner.removeprefix("```").removesuffix("```")))
    return found


def _everything_read(blocks: list[dict[str, Any]]) -> str:
    texts = [str((b.get("text") or {}).get("text", "")) for b in blocks]
    for block in blocks:
        for element in block.get("elements", []):
            inner = element.get("text", "")
            texts.append(str(inner.get("text", "") if isinstance(inner, dict) else inner))
    return "\n".join(texts)


def _whole_call(approval_id: str, arguments: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Every page of the *Show all* modal, followed with its Next buttons, joined."""
    modals = [slack.call_modal(approval_id, "mcp__mail__send", "mail", arguments)]
    while True:
        buttons = [
            e
            for b in modals[-1]["blocks"]
            if b["type"] == "actions"
            for e in b["elements"]
            if e["text"]["text"] == "Next page"
        ]
        if not buttons:
            break
        page = int(buttons[0]["value"].rsplit(":", 1)[1])
        modals.append(slack.call_modal(approval_id, "mcp__mail__send", "mail", arguments, page))
    return "\n".join(t for m in modals for t in _code_texts(m["blocks"])), modals


def _arguments_back(shown: str) -> dict[str, Any]:
    """The arguments read back from what was shown: each starts a line with its name (a
    nested value's lines are indented or close a bracket; JSON never has a raw line break in a
    string)."""
    return json.loads("{" + ",".join(re.split(r"\n(?=\")", shown)) + "}")


def _same_characters(shown: str, arguments: dict[str, Any]) -> None:
    """What the pages show, block after block, is every character of the call, in order (a
    block boundary may fall inside a long value), and those lines read back as the call."""
    lines = argument_lines(arguments, also="`")
    assert shown.replace("\n", "") == "".join(lines).replace("\n", "")
    assert _arguments_back("\n".join(lines)) == arguments


def test_display__the_card_shows_an_argument_pushed_past_a_long_one() -> None:
    blocks = slack.approval_blocks("a" * 32, "mcp__mail__send", "mail", PUSHED)
    read = _everything_read(blocks)
    assert "attacker@example.com" in read
    assert re.search(r"\+4,7\d\d characters not shown here", read)  # folded, and says how much
    assert "Show all" in read
    assert block_limits(blocks) is None


def test_display__show_all_holds_every_character_of_the_call() -> None:
    shown, modals = _whole_call("a" * 32, PUSHED)
    _same_characters(shown, PUSHED)
    assert len(modals) == 1
    assert all(block_limits(m["blocks"], modal=True) is None for m in modals)


@pytest.mark.parametrize(
    "arguments",
    [
        {"text": "<&>" * 60_000},  # every character an entity in mrkdwn, 180,000 of them
        {f"k{i:04}": "v" * 900 for i in range(1_500)},  # many arguments
        {"nested": {"list": [{"deep": "&" * 5_000, "n": 2**70}] * 40}},
    ],
    ids=["entities", "many", "nested"],
)
def test_display__a_huge_call_is_paged_within_block_kits_limits_and_nothing_is_lost(
    arguments: dict[str, Any],
) -> None:
    card = slack.approval_blocks("a" * 32, "mcp__notes__add", "notes", arguments)
    assert block_limits(card) is None
    assert "Show all" in _everything_read(card)
    shown, modals = _whole_call("a" * 32, arguments)
    assert len(modals) > 1  # paged, not cut
    assert all(block_limits(m["blocks"], modal=True) is None for m in modals)
    _same_characters(shown, arguments)


def test_display__hidden_and_reordering_characters_are_shown_escaped_everywhere() -> None:
    arguments = {"path": f"report{HIDDEN}fdp.exe", f"k{HIDDEN}": 1}
    card = _everything_read(slack.approval_blocks("a" * 32, "t", "s", arguments))
    outcome = _everything_read(
        slack.approval_outcome_blocks("a" * 32, "ran", "slack:T1:U1", "t", "s", arguments)
    )
    shown, _ = _whole_call("a" * 32, arguments)
    prompt = terminal.approval_waiting("t", "s", arguments)
    for read in (card, outcome, shown, prompt):
        assert not any(c in read for c in HIDDEN)
        assert "\\u202e" in read
        assert "\\u2066" in read
        assert "\\udb40\\udc41" in read  # the tag character, as JSON writes it
    _same_characters(shown, arguments)  # the escapes mean the same call


def test_display__a_backtick_cannot_close_the_cards_code_block() -> None:
    arguments = {"q": "```\n*approve me* <!channel>"}
    (code,) = _code_texts(slack.approval_blocks("a" * 32, "t", "s", arguments))
    assert "`" not in code
    raw = slack.approval_blocks("a" * 32, "t", "s", arguments)[1]["text"]["text"]
    assert "<!channel>" not in raw
    assert _arguments_back(code) == arguments


def test_display__the_terminal_prints_every_argument_whole() -> None:
    prompt = terminal.approval_waiting("mcp__mail__send", "mail", PUSHED)
    assert "attacker@example.com" in prompt
    assert "x" * 5_000 in prompt
    assert "…" not in prompt


def test_display__pages_keep_every_line_and_respect_the_weight() -> None:
    lines = argument_lines({"a": "<" * 50, "b": "c" * 7, "d": "e"})

    def measure(text: str) -> int:
        return len(text) + 3 * text.count("<")

    found = pages(lines, 40, measure=measure)
    assert all(measure(p) <= 40 for p in found)
    assert "".join(found).replace("\n", "") == "".join(lines).replace("\n", "")


def test_display__the_card_says_how_every_request_ended() -> None:
    said = {
        ("refused", "over_budget"): "not run",
        ("ran", "may_have_run"): "may have run",
        ("expired", "decision_expired"): "not carried out in time",
        ("superseded", "compacted"): "compacted",
        ("superseded", "moved_on"): "moved on",
    }
    for (state, reason), words in said.items():
        line = slack.approval_outcome(state, "slack:T1:U1", reason)
        assert words in line
        assert not re.search("running the call", line)

"""``bot.render``: escaping for mrkdwn, neutralising for Markdown, and the Markdown splitter."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from bot.render import (
    ZWJ,
    block_end,
    closing_fence,
    escape,
    neutralise,
    open_fence,
    settled,
    split_markdown,
)

CONTROLS = re.compile(r"<[!@#]|<[A-Za-z][A-Za-z0-9+.\-]*:|@(?:here|channel|everyone)\b|&lt;")


def test_escape__ampersands_and_angle_brackets_become_entities() -> None:
    assert escape("a && b <!channel> 1 > 0") == "a &amp;&amp; b &lt;!channel&gt; 1 &gt; 0"


def test_neutralise__no_control_sequence_survives_and_the_text_reads_the_same() -> None:
    hostile = (
        "<!channel> <!here> <@U999> <#C999|secret> <https://evil.example|click me> "
        "@here @channel @everyone &lt;b&gt; && 1 < 2 a<b mail@example.com"
    )
    safe = neutralise(hostile)
    assert not CONTROLS.search(safe)
    assert safe.replace(ZWJ, "") == hostile
    assert "&&" in safe
    assert "1 < 2" in safe
    assert "a<b" in safe


def test_settled__holds_back_a_tail_that_more_text_could_turn_into_a_mention() -> None:
    assert settled("plain words", 0) == len("plain words")
    text = "hello <"
    assert settled(text, 0) == text.index("<")
    # What is settled neutralises the same whatever follows.
    for more in ("!channel>", " 2", "@U1>"):
        cut = settled(text, 0)
        assert neutralise((text + more)[:cut]) == neutralise(text[:cut])


def test_split__paragraphs_stay_whole() -> None:
    paragraphs = ["p" * 7_000, "q" * 7_000, "r" * 3_000]
    text = "\n\n".join(paragraphs)
    pieces = split_markdown(text, 12_000)
    assert "".join(pieces) == text
    assert [p.strip() for p in pieces] == [*paragraphs[:1], "\n\n".join(paragraphs[1:])]


def test_split__a_code_fence_is_not_cut_when_it_fits() -> None:
    fence = "```python\n" + "x = 1\n" * 1_500 + "```\n"
    text = "intro\n" + "a" * 5_000 + "\n" + fence + "after\n"
    pieces = split_markdown(text, 12_000)
    assert "".join(pieces) == text
    assert any(p.startswith("```python") for p in pieces)
    assert all(open_fence(p) is None for p in pieces)
    assert open_fence("a\n```py\nx\n") == "```py"
    assert closing_fence("  ````js") == "````"


def test_split__a_fence_longer_than_a_piece_is_cut_at_line_ends() -> None:
    text = "```\n" + "line of code\n" * 3_000 + "```\n"
    pieces = split_markdown(text, 12_000)
    assert "".join(pieces) == text
    assert all(len(p) <= 12_000 and p.endswith("\n") for p in pieces)


def test_split__one_endless_line_is_cut_at_the_limit() -> None:
    text = "z" * 30_001
    assert [len(p) for p in split_markdown(text, 12_000)] == [12_000, 12_000, 6_001]


_blocks = st.one_of(
    st.text(alphabet="ab <@!>&\n", max_size=80),
    st.builds(
        lambda body, fence: f"\n{fence}lang\n{body}\n{fence}\n",
        st.text(alphabet="cd \n", max_size=60),
        st.sampled_from(["```", "~~~", "````"]),
    ),
    st.just("\n\n"),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_blocks, max_size=30), st.integers(min_value=75, max_value=400))
def test_split__property_whole_bounded_and_never_inside_a_fence_that_fits(
    blocks: list[str], limit: int
) -> None:
    text = "".join(blocks)
    pieces = split_markdown(text, limit)
    assert "".join(pieces) == text
    assert all(0 < len(p) <= limit for p in pieces)
    # Every fence here is shorter than a piece, so no cut falls inside one.
    done = ""
    for piece in pieces[:-1]:
        done += piece
        assert open_fence(done) is None, (done, piece)


def test_block_end__the_last_paragraph_or_fence_that_ended() -> None:
    assert block_end("no end yet") == 0
    assert block_end("one\n\ntwo so") == len("one\n\n")
    assert block_end("```\nx\n```\nmore") == len("```\nx\n```\n")

"""``core.messages.message_text``: what a person would read of a message, however its parts are
shaped (it runs for every message of a loaded history, so it has a fast path for one part)."""

from __future__ import annotations

from typing import Any

import pytest

from core.messages import message_text


@pytest.mark.parametrize(
    ("parts", "text"),
    [
        ([{"type": "text", "text": "one part"}], "one part"),
        (
            [
                {"type": "text", "text": "a"},
                {"type": "reasoning", "text": "x"},
                {"type": "text", "text": "b"},
            ],
            "ab",
        ),
        ([{"type": "tool-notes", "input": {}}], ""),
        ([{"type": "text"}], ""),
        (["not a part"], ""),
        ([], ""),
        ("x", ""),
    ],
)
def test_message_text__reads_only_text_parts(parts: Any, text: str) -> None:
    assert message_text({"id": "m", "role": "assistant", "parts": parts}) == text


def test_message_text__no_parts_is_empty() -> None:
    assert message_text({"id": "m", "role": "user"}) == ""


def test_message_text__a_text_that_is_not_a_string_is_refused_one_part_or_several() -> None:
    with pytest.raises(TypeError):
        message_text({"parts": [{"type": "text", "text": 3}]})
    with pytest.raises(TypeError):
        message_text({"parts": [{"type": "text", "text": "a"}, {"type": "text", "text": 3}]})

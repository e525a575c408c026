"""The Node check the chat tests rely on: it passes what the ``ai`` package accepts, and only that.

If this check could not fail, a chat test built on it would prove nothing; so every way a stream
can go wrong that the AI SDK notices (an unknown chunk, a delta before its start, no terminator)
is shown to fail it, on both majors of the package (6 and 7).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.ui_stream import RejectedStream, parse_ui_stream


def sse(*chunks: dict[str, object], done: bool = True) -> bytes:
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    if done:
        events.append("data: [DONE]\n\n")
    return "".join(events).encode()


ANSWER = (
    {"type": "start", "messageId": "m1"},
    {"type": "start-step"},
    {"type": "text-start", "id": "t1"},
    {"type": "text-delta", "id": "t1", "delta": "Hel"},
    {"type": "text-delta", "id": "t1", "delta": "lo"},
    {"type": "text-end", "id": "t1"},
    {"type": "tool-input-available", "toolCallId": "c1", "toolName": "fetch", "input": {"u": 1}},
    {"type": "tool-approval-request", "approvalId": "a1", "toolCallId": "c1"},
    {"type": "finish-step"},
    {"type": "finish"},
)


@pytest.mark.parametrize("major", [6, 7])
def test_a_valid_answer_becomes_its_ui_message(major: int) -> None:
    message = parse_ui_stream(sse(*ANSWER), ai_major=major)
    assert message["id"] == "m1"
    assert message["role"] == "assistant"
    text = [part["text"] for part in message["parts"] if part["type"] == "text"]
    assert text == ["Hello"]
    tool = next(part for part in message["parts"] if part["type"] == "tool-fetch")
    assert tool["state"] == "approval-requested"
    assert tool["approval"] == {"id": "a1"}


@pytest.mark.parametrize("major", [6, 7])
def test_an_error_chunk_is_part_of_the_protocol(major: int) -> None:
    message = parse_ui_stream(
        sse(ANSWER[0], {"type": "error", "errorText": "the model failed"}, {"type": "finish"}),
        ai_major=major,
    )
    assert message["id"] == "m1"


@pytest.mark.parametrize("major", [6, 7])
@pytest.mark.parametrize(
    ("body", "words"),
    [
        (sse(*ANSWER[:-1], {"type": "finished"}), "rejected chunk"),
        (sse(ANSWER[0], {"type": "text-delta", "id": "t9", "delta": "x"}), "text-delta"),
        (sse(*ANSWER, done=False), "[DONE]"),
        (b"", "[DONE]"),
        (b"data: [DONE]\n\n", "no UI message"),
    ],
    ids=["unknown-chunk", "delta-before-start", "no-terminator", "empty", "only-terminator"],
)
def test_what_the_package_rejects_fails(major: int, body: bytes, words: str) -> None:
    with pytest.raises(RejectedStream, match=re.escape(words)):
        parse_ui_stream(body, ai_major=major)

"""What provider tests share besides the model stand-ins (``standins.openai`` and
``standins.anthropic``): a sleep that records the retry policy's waits, and the events of one
streamed answer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.providers import ChatMessage, ModelProvider, StreamEvent, TextDelta, ToolSpec


class RecordingSleep:
    """The retry policy's sleep: records each wait instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


async def collect(
    provider: ModelProvider,
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] = (),
    **options: Any,
) -> list[StreamEvent]:
    return [event async for event in provider.stream(messages, tools, **options)]


def text_of(events: Sequence[StreamEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))

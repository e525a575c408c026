"""The neutral conversation format every model provider speaks, and the provider protocol.

The agent loop, compaction and the offline stand-in are written once against these types; each
wire format (OpenAI Chat Completions, Anthropic Messages) is a translation at the edge. Keeping
the format this small (text, tool calls, tool results, one system prompt) is deliberate: it is
the common ground of both APIs, so nothing here can silently fail to translate.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class SystemMessage:
    text: str


@dataclass(frozen=True)
class UserMessage:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call: providers yield one only once its arguments parsed as a JSON object."""

    id: str
    name: str
    arguments: JsonObject


@dataclass(frozen=True)
class AssistantMessage:
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolResult:
    """What a tool returned for one call, as text (both wire formats take a string).

    ``is_error`` tells the model the call failed, so it can react instead of trusting the text.
    """

    tool_call_id: str
    tool_name: str
    content: str
    is_error: bool = False


ChatMessage = SystemMessage | UserMessage | AssistantMessage | ToolResult


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call; ``parameters`` is the JSON schema of its arguments object."""

    name: str
    description: str
    parameters: JsonObject = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class Usage:
    """What one model request used, as the provider reported it: yielded once per successful
    stream, just before its ``Finish``, even when the server reported nothing (then with
    ``None`` counts), so every request that answered is counted as a request.

    A count the provider did not report is ``None``, never 0, so "unknown" cannot pass for
    "free". ``input_tokens`` is every prompt token the model read, cached ones included (OpenAI's
    ``prompt_tokens``; Anthropic's ``input_tokens`` + ``cache_read_input_tokens`` +
    ``cache_creation_input_tokens``); ``cached_tokens`` is the part of it read from the
    provider's prompt cache (billed cheaper) and ``cache_write_tokens`` the part written to it
    (Anthropic bills that dearer). ``estimated`` marks counts we computed, not the provider's.
    A stream that fails yields no ``Usage``: what a broken request used is unknown.
    """

    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None
    estimated: bool = False

    @property
    def total_tokens(self) -> int | None:
        if self.input_tokens is None or self.output_tokens is None:
            return None
        return self.input_tokens + self.output_tokens


# Both APIs name their stop reasons differently; callers only need to tell these apart.
StopReason = Literal["stop", "tool_calls", "length", "other"]


@dataclass(frozen=True)
class Finish:
    """The last event of every successful stream; ``raw_stop_reason`` is the provider's word."""

    stop_reason: StopReason
    raw_stop_reason: str | None = None


StreamEvent = TextDelta | ToolCall | Usage | Finish
# A generator, not just an iterator, so callers can ``aclose`` it (``contextlib.aclosing``)
# and have the HTTP response released at once when they stop early.
EventStream = AsyncGenerator[StreamEvent, None]


class ModelProvider(Protocol):
    """What the agent loop calls. ``name`` is what ``stamp_session_model`` records.

    ``stream`` yields text as it arrives, each tool call once complete, one ``Usage`` and
    then exactly one ``Finish``; any failure is a ``ModelProviderError`` carrying the text
    already yielded.
    ``tool_choice`` names a tool the model must call (compaction forces ``write_checkpoint``);
    ``None`` lets the model decide. ``model`` overrides ``default_model`` for one call.
    """

    name: str
    default_model: str

    def stream(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
        *,
        tool_choice: str | None = None,
        model: str | None = None,
    ) -> EventStream: ...

    async def aclose(self) -> None: ...


def check_tool_choice(tools: Sequence[ToolSpec], tool_choice: str | None) -> None:
    """Forcing a tool the model was not given is a bug in the caller, not a provider fault."""
    if tool_choice is not None and tool_choice not in {tool.name for tool in tools}:
        raise ValueError(f"tool_choice {tool_choice!r} is not among the tools given")

"""The spans of a turn: the only tracing API the agent loop, compaction and tools call.

One trace per turn, as OpenInference draws an agent::

    AGENT  turn                    session.id, slack_agent.surface, user.id (opt-in)
    ├── CHAIN  compaction          an automatic compaction before the answer
    │   └── LLM  model request
    ├── LLM  model request         llm.model_name, llm.provider, llm.token_count.*, messages
    ├── TOOL  tool: shell          tool.name, arguments (input.value), result (output.value)
    └── LLM  model request         ...

Parents are passed explicitly (``turn.llm(...)``), never through OpenTelemetry's ambient
context, so nothing depends on which asyncio task or generator a span was opened in, and no
other library's instrumentation is drawn into our traces. Every handle is a context manager
that ends its span; an exception leaving it marks the span as an error and is re-raised.

With tracing off (``Tracer.off()``: no endpoint) every call returns a shared inert handle and
builds no attributes: the cost of a turn is a few method calls. With ``TRACE_CONTENT=0`` no
message text, tool argument or result is built at all, only names, sizes and counts, and an
error is recorded by its code alone (its message and traceback quote model output); with
``TRACE_USER_IDS=0`` (the default) no user id is recorded anywhere, the approving person's
included.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from decimal import Decimal
from types import TracebackType
from typing import TYPE_CHECKING, Any

from openinference.semconv.trace import (
    OpenInferenceMimeTypeValues,
    OpenInferenceSpanKindValues,
    SpanAttributes,
    ToolCallAttributes,
)
from opentelemetry import trace as trace_api
from opentelemetry.context import Context

from core.providers.base import AssistantMessage, ChatMessage, ToolCall, ToolSpec, Usage
from core.trace_links import trace_url
from core.tracing import attributes as attrs
from core.tracing.config import TraceConfig, TraceOptions

if TYPE_CHECKING:
    from core.settings import Settings
    from core.tracing.export import CountingProcessor

log = logging.getLogger(__name__)

SCOPE = "slack_agent"  # the instrumentation scope our spans are reported under
KIND = SpanAttributes.OPENINFERENCE_SPAN_KIND
TEXT = OpenInferenceMimeTypeValues.TEXT.value
JSON = OpenInferenceMimeTypeValues.JSON.value


class SpanHandle:
    """One open span. Subclasses add what their kind records; all are context managers."""

    def __init__(self, tracer: Tracer | None, span: trace_api.Span | None) -> None:
        self._tracer = tracer
        self._span = span
        # Kept after the span ends, so a finished turn can still give its trace's link.
        self._context = None if span is None else span.get_span_context()

    @property
    def recording(self) -> bool:
        return self._span is not None

    @property
    def options(self) -> TraceOptions:
        return self._tracer.options if self._tracer is not None else TraceOptions()

    def set(self, attributes: attrs.Attributes) -> None:
        if self._span is not None and attributes:
            self._span.set_attributes(attributes)

    def _child(self, name: str, kind: OpenInferenceSpanKindValues) -> trace_api.Span | None:
        if self._tracer is None or self._span is None:
            return None
        return self._tracer.start(name, kind, parent=self._span)

    def end(self, error: BaseException | None = None) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        if error is not None:
            content = self.options.content
            span.set_status(trace_api.Status(trace_api.StatusCode.ERROR, _describe(error, content)))
            if isinstance(error, Exception):
                if content:
                    span.record_exception(error)
                else:  # an error's message and traceback quote model output and arguments
                    span.add_event("exception", {attrs.EXCEPTION_TYPE: _error_name(error)})
        span.end()

    def __enter__(self) -> Any:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.end(error)


def _error_name(error: BaseException) -> str:
    """Our stable code when the error has one, else its class: never its message."""
    code = getattr(error, "code", None)
    return code if isinstance(code, str) else type(error).__name__


def _describe(error: BaseException, content: bool) -> str:
    name = _error_name(error)
    return f"{name}: {error}" if content and str(error) else name


class LlmSpan(SpanHandle):
    """One model request: what was sent, what came back, what it used and cost."""

    def __enter__(self) -> LlmSpan:
        return self

    def record_usage(self, usage: Usage, cost_usd: Decimal | None = None) -> None:
        if self.recording:
            self.set({**attrs.token_counts(usage), **attrs.cost(cost_usd)})

    def record_output(self, message: AssistantMessage) -> None:
        if not self.recording:
            return
        if self.options.content:
            self.set(attrs.output_message_content(message))
        else:
            self.set({attrs.OUTPUT_CHARS: len(message.text)})


class ToolSpan(SpanHandle):
    """One tool call: its arguments, its result, and for MCP calls who allowed it."""

    def __enter__(self) -> ToolSpan:
        return self

    def record_approval(self, decision: str, decided_by: str | None = None) -> None:
        """``decision``: e.g. ``approved``, ``denied``, ``expired``, ``superseded``,
        ``not_required``; ``decided_by``: the person's id, ``None`` when a rule decided.
        The id is recorded only with ``TRACE_USER_IDS=1``; that a person decided, always."""
        if not self.recording:
            return
        values: attrs.Attributes = {
            attrs.APPROVAL_DECISION: decision,
            attrs.APPROVAL_DECIDER: "rule" if decided_by is None else "person",
        }
        if decided_by is not None and self.options.user_ids:
            values[attrs.APPROVAL_DECIDED_BY] = decided_by
        self.set(values)

    def record_result(self, content: str, *, is_error: bool = False) -> None:
        if not self.recording:
            return
        if self.options.content:
            values: attrs.Attributes = {
                SpanAttributes.OUTPUT_VALUE: content,
                SpanAttributes.OUTPUT_MIME_TYPE: TEXT,
            }
        else:
            values = {attrs.OUTPUT_CHARS: len(content)}
        values[attrs.TOOL_ERROR] = is_error
        self.set(values)
        if is_error and self._span is not None:
            self._span.set_status(trace_api.Status(trace_api.StatusCode.ERROR, "tool error"))


class _Parent(SpanHandle):
    """A span that model requests hang from: the turn and a compaction."""

    def llm(
        self,
        *,
        provider: str,
        model: str,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
    ) -> LlmSpan:
        span = self._child("model request", OpenInferenceSpanKindValues.LLM)
        if span is None:
            return _OFF_LLM
        handle = LlmSpan(self._tracer, span)
        values: attrs.Attributes = {
            SpanAttributes.LLM_MODEL_NAME: model,
            SpanAttributes.LLM_PROVIDER: provider,
            attrs.INPUT_MESSAGES: len(messages),
        }
        if self.options.content:
            values.update(attrs.input_messages_content(messages, self.options.input_chars))
            values.update(attrs.tools_content(tools))
        else:
            values[attrs.INPUT_CHARS] = attrs.chars(messages)
        handle.set(values)
        return handle


class CompactionSpan(_Parent):
    def __enter__(self) -> CompactionSpan:
        return self

    def record_output(self, checkpoint_text: str) -> None:
        if not self.recording:
            return
        if self.options.content:
            self.set(
                {
                    SpanAttributes.OUTPUT_VALUE: checkpoint_text,
                    SpanAttributes.OUTPUT_MIME_TYPE: TEXT,
                }
            )
        else:
            self.set({attrs.OUTPUT_CHARS: len(checkpoint_text)})


class TurnSpan(_Parent):
    """The root of a turn's trace (OpenInference ``AGENT``)."""

    def __enter__(self) -> TurnSpan:
        return self

    @property
    def trace_id(self) -> str | None:
        """32 hex digits, or ``None`` when not recorded (tracing off, or not sampled)."""
        context = self._sampled_context()
        return None if context is None else format(context.trace_id, "032x")

    @property
    def url(self) -> str | None:
        """The ``TRACE_URL_TEMPLATE`` link to this trace, when there is one to follow (also
        after the turn's span ended: the finished reply is written after it)."""
        context = self._sampled_context()
        if context is None:
            return None
        return trace_url(self.options.url_template, context.trace_id)

    def _sampled_context(self) -> trace_api.SpanContext | None:
        context = self._context
        return context if context is not None and context.trace_flags.sampled else None

    def compaction(self, *, automatic: bool = True) -> CompactionSpan:
        span = self._child("compaction", OpenInferenceSpanKindValues.CHAIN)
        if span is None:
            return _OFF_COMPACTION
        handle = CompactionSpan(self._tracer, span)
        handle.set({attrs.COMPACTION_AUTOMATIC: automatic})
        return handle

    def tool(self, call: ToolCall, *, server: str | None = None) -> ToolSpan:
        """A tool call; ``server`` names the MCP server (``None``: the sandbox shell)."""
        span = self._child(f"tool: {call.name}", OpenInferenceSpanKindValues.TOOL)
        if span is None:
            return _OFF_TOOL
        handle = ToolSpan(self._tracer, span)
        arguments = json.dumps(call.arguments, ensure_ascii=False)
        values: attrs.Attributes = {
            SpanAttributes.TOOL_NAME: call.name,
            ToolCallAttributes.TOOL_CALL_ID: call.id,
        }
        if server is not None:
            values[attrs.TOOL_SERVER] = server
        if self.options.content:
            values[SpanAttributes.INPUT_VALUE] = arguments
            values[SpanAttributes.INPUT_MIME_TYPE] = JSON
        else:
            values[attrs.INPUT_CHARS] = len(arguments)
        handle.set(values)
        return handle

    def record_output(self, text: str, *, outcome: str | None = None) -> None:
        """The answer as the user sees it, and how the turn ended (``answered``, ...)."""
        if not self.recording:
            return
        values: attrs.Attributes = {}
        if self.options.content:
            values[SpanAttributes.OUTPUT_VALUE] = text
            values[SpanAttributes.OUTPUT_MIME_TYPE] = TEXT
        else:
            values[attrs.OUTPUT_CHARS] = len(text)
        if outcome is not None:
            values[attrs.TURN_OUTCOME] = outcome
        self.set(values)


class Tracer:
    """Builds the spans of turns; one per process, built at start-up (``from_settings``).

    ``provider`` is an OpenTelemetry tracer provider handed in (the SDK's, built by
    ``core.tracing.export`` from settings, or one a test made); ``None`` is tracing off.
    Nothing here touches OpenTelemetry's global provider.
    """

    def __init__(
        self,
        provider: trace_api.TracerProvider | None,
        options: TraceOptions | None = None,
        *,
        processor: CountingProcessor | None = None,
    ) -> None:
        self.options = options or TraceOptions()
        self._otel = None if provider is None else provider.get_tracer(SCOPE)
        self._provider = provider
        self._processor = processor

    @classmethod
    def off(cls) -> Tracer:
        return cls(None)

    @classmethod
    def from_config(cls, config: TraceConfig | None) -> Tracer:
        if config is None:
            return cls.off()
        from core.tracing.export import build_provider  # the SDK is imported only when on

        provider, processor = build_provider(config)
        return cls(provider, config.options, processor=processor)

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracer:
        return cls.from_config(TraceConfig.from_settings(settings))

    @property
    def enabled(self) -> bool:
        return self._otel is not None

    def start(
        self,
        name: str,
        kind: OpenInferenceSpanKindValues,
        *,
        parent: trace_api.Span | None,
        attributes: attrs.Attributes | None = None,
    ) -> trace_api.Span | None:
        if self._otel is None:
            return None
        # An explicit context: an empty one for a root, so an ambient span (some other
        # library's) can never adopt our turn; the parent's otherwise.
        context = Context() if parent is None else trace_api.set_span_in_context(parent)
        values: attrs.Attributes = {KIND: kind.value}
        if parent is not None:
            values.update(_inherited(parent))
        values.update(attributes or {})
        return self._otel.start_span(name, context=context, attributes=values)

    def turn(
        self,
        *,
        session_id: int,
        surface: str,
        user_id: str | None = None,
        text: str | None = None,
    ) -> TurnSpan:
        """The root span of one turn. ``session_id`` is the integer ``sessions list`` prints;
        ``text`` the user's message (recorded as the turn's input unless content is off)."""
        if self._otel is None:
            return _OFF_TURN
        values = self._session_attributes(session_id, user_id)
        values[attrs.SURFACE] = surface
        if text is not None:
            if self.options.content:
                values[SpanAttributes.INPUT_VALUE] = text
                values[SpanAttributes.INPUT_MIME_TYPE] = TEXT
            else:
                values[attrs.INPUT_CHARS] = len(text)
        span = self.start("turn", OpenInferenceSpanKindValues.AGENT, parent=None, attributes=values)
        return TurnSpan(self, span)

    def compaction(
        self, *, session_id: int, surface: str, user_id: str | None = None
    ) -> CompactionSpan:
        """A compaction asked for on its own (``/compact``), the root of its own trace."""
        if self._otel is None:
            return _OFF_COMPACTION
        values = self._session_attributes(session_id, user_id)
        values[attrs.SURFACE] = surface
        values[attrs.COMPACTION_AUTOMATIC] = False
        span = self.start(
            "compaction", OpenInferenceSpanKindValues.CHAIN, parent=None, attributes=values
        )
        return CompactionSpan(self, span)

    def _session_attributes(self, session_id: int, user_id: str | None) -> attrs.Attributes:
        values: attrs.Attributes = {SpanAttributes.SESSION_ID: str(session_id)}
        if user_id is not None and self.options.user_ids:
            values[SpanAttributes.USER_ID] = user_id
        return values

    def force_flush(self, timeout_seconds: float = 5.0) -> bool:
        """Send what is queued now (blocking, bounded): for tests and the end of a command."""
        if self._processor is None:
            return True
        return self._processor.force_flush(int(timeout_seconds * 1000))

    def shutdown(self, timeout_seconds: float = 5.0) -> None:
        """Flush for at most ``timeout_seconds`` and stop exporting (blocking: call it in a
        thread from async code). Spans not sent by then are counted as lost."""
        if self._processor is not None:
            self._processor.shutdown_within(timeout_seconds)
        shutdown = getattr(self._provider, "shutdown", None)
        if callable(shutdown):
            shutdown()


# Tracing off: every handle is one of these, shared (they hold no span, so no state).
_OFF_TURN = TurnSpan(None, None)
_OFF_COMPACTION = CompactionSpan(None, None)
_OFF_LLM = LlmSpan(None, None)
_OFF_TOOL = ToolSpan(None, None)

_INHERITED = (SpanAttributes.SESSION_ID, SpanAttributes.USER_ID)


def _inherited(parent: trace_api.Span) -> attrs.Attributes:
    """``session.id`` (and ``user.id`` when recorded) on every span of the trace, as
    OpenInference's own context helpers put them, so a back end can filter any span by them."""
    values = getattr(parent, "attributes", None) or {}
    return {key: values[key] for key in _INHERITED if key in values}

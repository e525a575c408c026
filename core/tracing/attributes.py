"""Span attributes in the OpenInference conventions, named from its conventions package.

OpenInference flattens lists into indexed keys (``llm.input_messages.0.message.role``), which
is what Phoenix and the other back ends that read it expect; this module does that for the
neutral conversation format. What the conventions do not name (the surface, an MCP approval)
is ours, under ``slack_agent.``. Content-bearing attributes are built only by the functions
whose names say ``content``; a caller with ``TRACE_CONTENT=0`` does not call them and records
sizes instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from decimal import Decimal

from openinference.semconv.trace import (
    MessageAttributes,
    SpanAttributes,
    ToolAttributes,
    ToolCallAttributes,
)
from opentelemetry.util.types import AttributeValue

from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    SystemMessage,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)

Attributes = dict[str, AttributeValue]

SURFACE = "slack_agent.surface"
TURN_OUTCOME = "slack_agent.turn.outcome"
USAGE_ESTIMATED = "slack_agent.usage.estimated"
INPUT_CHARS = "slack_agent.input.chars"
OUTPUT_CHARS = "slack_agent.output.chars"
INPUT_MESSAGES = "slack_agent.llm.input_message_count"
INPUT_MESSAGES_OMITTED = "slack_agent.llm.input_messages_omitted"  # the oldest, over the budget
TOOL_SERVER = "slack_agent.tool.server"
TOOL_ERROR = "slack_agent.tool.is_error"
APPROVAL_DECISION = "slack_agent.approval.decision"
APPROVAL_DECIDER = "slack_agent.approval.decider"  # "person" or "rule", always
APPROVAL_DECIDED_BY = "slack_agent.approval.decided_by"  # the person's id: TRACE_USER_IDS=1
COMPACTION_AUTOMATIC = "slack_agent.compaction.automatic"
# OpenTelemetry's exception event key, the one an error event keeps with TRACE_CONTENT=0.
EXCEPTION_TYPE = "exception.type"


def _role_and_text(message: ChatMessage) -> tuple[str, str]:
    if isinstance(message, SystemMessage):
        return "system", message.text
    if isinstance(message, UserMessage):
        return "user", message.text
    if isinstance(message, ToolResult):
        return "tool", message.content
    return "assistant", message.text


def chars(messages: Sequence[ChatMessage]) -> int:
    return sum(len(_role_and_text(message)[1]) for message in messages)


def message_content(prefix: str, index: int, message: ChatMessage) -> Attributes:
    """One message as ``{prefix}.{index}.message.*`` (role, content, tool calls, tool ids)."""
    base = f"{prefix}.{index}."
    role, text = _role_and_text(message)
    out: Attributes = {base + MessageAttributes.MESSAGE_ROLE: role}
    if text:
        out[base + MessageAttributes.MESSAGE_CONTENT] = text
    if isinstance(message, ToolResult):
        out[base + MessageAttributes.MESSAGE_TOOL_CALL_ID] = message.tool_call_id
        out[base + MessageAttributes.MESSAGE_NAME] = message.tool_name
    if isinstance(message, AssistantMessage):
        for number, call in enumerate(message.tool_calls):
            call_base = f"{base}{MessageAttributes.MESSAGE_TOOL_CALLS}.{number}."
            out[call_base + ToolCallAttributes.TOOL_CALL_ID] = call.id
            out[call_base + ToolCallAttributes.TOOL_CALL_FUNCTION_NAME] = call.name
            out[call_base + ToolCallAttributes.TOOL_CALL_FUNCTION_ARGUMENTS_JSON] = json.dumps(
                call.arguments, ensure_ascii=False
            )
    return out


def _content_chars(message: ChatMessage) -> int:
    size = len(_role_and_text(message)[1])
    if isinstance(message, AssistantMessage):
        size += sum(
            len(json.dumps(call.arguments, ensure_ascii=False)) for call in message.tool_calls
        )
    return size


def input_messages_content(messages: Sequence[ChatMessage], budget: int) -> Attributes:
    """The newest messages whose text adds up to at most ``budget`` characters (the newest one
    always), indexed from 0, and how many older ones were left out: a model request carries the
    whole history, and a span that outgrows a collector's request is lost whole."""
    kept = 0
    used = 0
    for message in reversed(messages):
        used += _content_chars(message)
        if kept and used > budget:
            break
        kept += 1
    out: Attributes = {}
    start = len(messages) - kept
    for index, message in enumerate(messages[start:]):
        out.update(message_content(SpanAttributes.LLM_INPUT_MESSAGES, index, message))
    if start:
        out[INPUT_MESSAGES_OMITTED] = start
    return out


def output_message_content(message: AssistantMessage) -> Attributes:
    return message_content(SpanAttributes.LLM_OUTPUT_MESSAGES, 0, message)


def tools_content(tools: Sequence[ToolSpec]) -> Attributes:
    return {
        f"{SpanAttributes.LLM_TOOLS}.{index}.{ToolAttributes.TOOL_JSON_SCHEMA}": json.dumps(
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.parameters,
                },
            },
            ensure_ascii=False,
        )
        for index, tool in enumerate(tools)
    }


def token_counts(usage: Usage) -> Attributes:
    """``llm.token_count.*``, only the counts the provider reported (unknown is absent, not 0)."""
    out: Attributes = {}
    pairs = (
        (SpanAttributes.LLM_TOKEN_COUNT_PROMPT, usage.input_tokens),
        (SpanAttributes.LLM_TOKEN_COUNT_COMPLETION, usage.output_tokens),
        (SpanAttributes.LLM_TOKEN_COUNT_TOTAL, usage.total_tokens),
        (SpanAttributes.LLM_TOKEN_COUNT_PROMPT_DETAILS_CACHE_READ, usage.cached_tokens),
        (SpanAttributes.LLM_TOKEN_COUNT_PROMPT_DETAILS_CACHE_WRITE, usage.cache_write_tokens),
    )
    for key, count in pairs:
        if count is not None:
            out[key] = count
    if usage.estimated:
        out[USAGE_ESTIMATED] = True
    return out


def cost(cost_usd: Decimal | None) -> Attributes:
    return {} if cost_usd is None else {SpanAttributes.LLM_COST_TOTAL: float(cost_usd)}

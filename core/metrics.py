"""What an operator sees on ``/metrics`` (Prometheus, through the standard ``prometheus-client``).

The metrics are module-level objects in the default registry: one process is one replica, and
the sweeper thread counts into the same registry as the event loop. Counters are incremented
where the thing happens (the turn, the store, the provider wrapper below, the sweeper); the
gauges of delivery records are read from the database when ``/metrics`` is scraped, so every
replica reports the whole picture it shares (take ``max`` over replicas, not ``sum``).

Names follow Prometheus conventions: ``slack_agent_`` prefix, ``_total`` counters, base units.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from decimal import Decimal

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from core.errors import ModelProviderError
from core.providers.base import (
    ChatMessage,
    EventStream,
    Finish,
    ModelProvider,
    ToolSpec,
    Usage,
)

REPLICA = Info(
    "slack_agent_replica",
    "This process: ``owner`` is the id its delivery records carry while it works on them.",
)
TURNS_STARTED = Counter("slack_agent_turns_started_total", "Turns that claimed their session.")
TURNS_FINISHED = Counter(
    "slack_agent_turns_finished_total",
    "Turns that ended, by outcome: answered, model_error (partial kept), interrupted (stopped "
    "or shut down; partial kept), lock_lost (taken over after going stale), failed (a bug).",
    ["outcome"],
)
TURN_SECONDS = Histogram(
    "slack_agent_turn_duration_seconds",
    "Wall time of a turn from its claim to its release, by outcome.",
    ["outcome"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
TURN_REFUSALS = Counter(
    "slack_agent_turn_refusals_total",
    "Turns refused before any model call: busy (locked elsewhere) or stale (old view).",
    ["reason"],
)
BUDGET_CHECKS = Counter(
    "slack_agent_budget_checks_total",
    "PostgreSQL: budget checks that reserve (a claim with a user message, a turn's later "
    "request), by how the accounts' locks were taken: at_once (tried inside the one "
    "statement), waiting (that statement wrote nothing: a lock was held elsewhere, a "
    "transaction ended meanwhile, or it refused) or skipped (waited for without trying: "
    "most recent tries had fallen back).",
    ["way"],
)
LOCK_TAKEOVERS = Counter(
    "slack_agent_lock_takeovers_total",
    "Claims that took over a lock whose holder stopped heartbeating (a dead or stuck turn).",
)
LOCKS_LOST = Counter(
    "slack_agent_locks_lost_total",
    "Turns that found their lock taken over and stopped.",
)
TURNS_RECORD_LOST = Counter(
    "slack_agent_turns_record_lost_total",
    "Turns stopped because this replica could not confirm it still held their message (its "
    "lease renewal unconfirmed within 0.8 of the window, or the message taken over).",
)
TURNS_SELF_STOPPED = Counter(
    "slack_agent_turns_self_stopped_total",
    "Turns that stopped themselves because the database did not confirm their lock in time.",
)
DELIVERIES = Gauge(
    "slack_agent_deliveries",
    "Delivery records not yet finished, by state and wait reason (read from the database).",
    ["state", "reason"],
)
DELIVERY_AGE = Gauge(
    "slack_agent_delivery_oldest_age_seconds",
    "Age of the oldest unfinished delivery record, by state (read from the database).",
    ["state"],
)
WAITING_MESSAGES = Gauge(
    "slack_agent_waiting_messages",
    "Messages waiting on a busy session or behind an earlier message of their thread.",
)
DELIVERIES_TAKEN_OVER = Counter(
    "slack_agent_deliveries_taken_over_total",
    "Delivery records this replica took over from a dead, stuck or stopped replica.",
)
DELIVERIES_FINISHED = Counter(
    "slack_agent_deliveries_finished_total",
    "Delivery records this replica finished, by final state.",
    ["state"],
)
ACK_SECONDS = Histogram(
    "slack_agent_ack_seconds",
    "Acknowledgements of Slack's requests (``POST /slack/events``), from the request read to "
    "its answer, by how they were handled: message (recorded on the intake's own loop) or "
    "other (dispatched on the turns' loop).",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10),
)
ACKS_LATE = Counter(
    "slack_agent_acks_late_total",
    "Slack requests answered 503 because handling them (recording a message) did not finish "
    "within the acknowledgement deadline; Slack sends them again.",
    ["kind"],
)
INTAKE_REQUESTS = Gauge(
    "slack_agent_intake_requests",
    "Slack requests the intake is handling now (read, verified, being recorded).",
)
INTAKE_QUEUE = Gauge(
    "slack_agent_intake_queue",
    "Messages recorded by the intake and handed to the turns' loop, not yet taken there.",
)
HELD_MESSAGES = Gauge(
    "slack_agent_held_messages",
    "Delivery records this replica holds and works on now (running, or in line for a turn's "
    "place here); past MAX_HELD_MESSAGES new ones are left for other replicas.",
)
PARKED_MESSAGES = Gauge(
    "slack_agent_parked_messages",
    "Delivery records this replica holds that wait for another turn of their thread or session "
    "to end (not counted toward MAX_HELD_MESSAGES).",
)
MESSAGES_SHED = Counter(
    "slack_agent_messages_shed_total",
    "Messages this replica recorded but left for any replica with room (it was saturated).",
)
MODEL_SECONDS = Histogram(
    "slack_agent_model_request_seconds",
    "One streamed model request, from sending it to its last event, by provider.",
    ["provider"],
    buckets=(0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160),
)
MODEL_ERRORS = Counter(
    "slack_agent_model_errors_total",
    "Model requests that failed (after the provider's own retries), by provider and code.",
    ["provider", "code"],
)
MODEL_TOKENS = Counter(
    "slack_agent_model_tokens_total",
    "Tokens the providers reported, by provider, model and kind (input, output, cached: the "
    "part of input read from the prompt cache). Estimated counts (the offline model) included.",
    ["provider", "model", "kind"],
)
MODEL_COST = Counter(
    "slack_agent_model_cost_usd_total",
    "US dollars model requests cost where the price is known, by provider and model.",
    ["provider", "model"],
)
MODEL_UNPRICED = Counter(
    "slack_agent_model_unpriced_requests_total",
    "Model requests whose cost is unknown (no price for the model, or counts not reported).",
    ["provider", "model"],
)
TRACE_SPANS_DROPPED = Counter(
    "slack_agent_trace_spans_dropped_total",
    "Spans never delivered to the OTLP collector, by reason: queue_full (the export queue was "
    "full: the collector is slow or away), export_failed (the collector refused or did not "
    "answer in time), shutdown (still queued when the process stopped), too_large (one span "
    "larger than TRACE_BATCH_BYTES).",
    ["reason"],
)
SLACK_API_ERRORS = Counter(
    "slack_agent_slack_api_errors_total",
    "Slack Web API calls that failed after retries, by method and error.",
    ["method", "error"],
)
SLACK_RATE_LIMITED = Counter(
    "slack_agent_slack_api_rate_limited_total",
    "Slack Web API answers of 429 (each is waited out as Retry-After says), by method.",
    ["method"],
)
MCP_TOOL_CALLS = Counter(
    "slack_agent_mcp_tool_calls_total",
    "MCP tool calls, by server, tool and outcome (ok, tool_error, invalid_arguments, "
    "unknown_tool, unavailable, approval_required, timeout, server_failed, protocol_error, "
    "cancelled); a name no server offers counts under server and tool (unknown).",
    ["server", "tool", "outcome"],
)
MCP_TOOL_SECONDS = Histogram(
    "slack_agent_mcp_tool_call_seconds",
    "Wall time of MCP tool calls sent to a server (any outcome), by server.",
    ["server"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
MCP_SERVER_CONNECTED = Gauge(
    "slack_agent_mcp_server_connected",
    "1 while this process is connected to the MCP server (its tools are offered), else 0.",
    ["server"],
)
APPROVALS_DECIDED = Counter(
    "slack_agent_approvals_decided_total",
    "Decisions on tool calls that waited for a person, by decision (approved, denied).",
    ["decision"],
)
SWEEPER_DELETED = Counter(
    "slack_agent_sweeper_deleted_total",
    "Rows the sweeper deleted, by rule.",
    ["rule"],
)


def count_tokens(provider: str, model: str, usage: Usage) -> None:
    for kind, count in (
        ("input", usage.input_tokens),
        ("output", usage.output_tokens),
        ("cached", usage.cached_tokens),
    ):
        if count:
            MODEL_TOKENS.labels(provider, model, kind).inc(count)


def count_cost(provider: str, model: str, cost_usd: Decimal | None) -> None:
    """Called where a request is priced (the usage tally); unknown costs are counted apart."""
    if cost_usd is None:
        MODEL_UNPRICED.labels(provider, model).inc()
    else:
        MODEL_COST.labels(provider, model).inc(float(cost_usd))


def exposition() -> tuple[bytes, str]:
    """The body and content type of a ``/metrics`` answer."""
    return generate_latest(), CONTENT_TYPE_LATEST


class ObservedProvider:
    """A model provider that counts its requests: latency and errors by provider, tokens by
    provider and model (what the provider's ``Usage`` said)."""

    def __init__(self, inner: ModelProvider) -> None:
        self.inner = inner
        self.name = inner.name
        self.default_model = inner.default_model

    async def stream(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
        *,
        tool_choice: str | None = None,
        model: str | None = None,
    ) -> EventStream:
        started = time.monotonic()
        source = self.inner.stream(messages, tools, tool_choice=tool_choice, model=model)
        try:
            async for event in source:
                if isinstance(event, Usage):
                    count_tokens(self.name, model or self.default_model, event)
                elif isinstance(event, Finish):
                    MODEL_SECONDS.labels(self.name).observe(time.monotonic() - started)
                yield event
        except ModelProviderError as exc:
            MODEL_ERRORS.labels(self.name, exc.code).inc()
            raise
        finally:
            await source.aclose()

    async def aclose(self) -> None:
        await self.inner.aclose()

"""Traces over real OTLP/HTTP: the SDK exporter posts protobuf to the stand-in collector, which
decodes it with the OpenTelemetry protobuf package; the tree and the attributes are asserted on
what arrived. Faults (a refusing, hanging or absent collector) are asserted by behaviour: the
span-producing code returns while the collector still holds the request, and the losses show
on /metrics."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from core.errors import ConfigError, ModelProviderUnavailable
from core.metrics import exposition
from core.providers import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
    UserMessage,
)
from core.settings import load_settings
from core.tracing.config import DEFAULT_MAX_ATTRIBUTE_CHARS, TraceConfig
from core.tracing.spans import Tracer
from standins import metrics
from standins.otlp import OtlpReceiver, ReceivedSpan

SHELL = ToolSpec("shell", "Run a command in the sandbox.")
CALL = ToolCall("call_1", "shell", {"command": "ls /work"})
SECRET_TEXT = "the quarterly numbers are 4711"


@pytest.fixture
async def collector() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as receiver:
        yield receiver


def tracer_for(endpoint: str, **settings: Any) -> Tracer:
    return Tracer.from_settings(load_settings(otel_exporter_otlp_endpoint=endpoint, **settings))


def dropped(reason: str) -> float:
    """The /metrics sample of spans lost for ``reason``."""
    body, _ = exposition()
    return metrics.value(
        metrics.parse(body.decode()), "slack_agent_trace_spans_dropped_total", reason=reason
    )


def one_turn(tracer: Tracer, *, user_id: str = "slack:T1:U1") -> str | None:
    """A whole turn as the agent loop draws it: compaction, two model requests, a tool call.
    Returns the turn's trace link."""
    history = [SystemMessage("Be brief."), UserMessage(SECRET_TEXT)]
    with tracer.turn(session_id=42, surface="slack", user_id=user_id, text=SECRET_TEXT) as turn:
        with turn.compaction(automatic=True) as compaction:
            with compaction.llm(provider="openai", model="gpt-4.1-mini", messages=history) as llm:
                llm.record_usage(Usage(100, 20, 0), Decimal("0.0001"))
            compaction.record_output(f"## Objectives\n- {SECRET_TEXT}")
        with turn.llm(
            provider="openai", model="gpt-4.1-mini", messages=history, tools=[SHELL]
        ) as llm:
            llm.record_usage(Usage(1200, 30, cached_tokens=1024), Decimal("0.000272"))
            llm.record_output(AssistantMessage("Looking.", (CALL,)))
        with turn.tool(CALL) as tool:
            tool.record_approval("approved", decided_by="slack:T1:U9")
            tool.record_result("report.md\n")
        later = [*history, AssistantMessage("Looking.", (CALL,))]
        later.append(ToolResult("call_1", "shell", "report.md\n"))
        with turn.llm(provider="openai", model="gpt-4.1-mini", messages=later) as llm:
            llm.record_usage(Usage(1300, None))  # completion count not reported: absent
            llm.record_output(AssistantMessage("There is report.md."))
        turn.record_output("There is report.md.", outcome="answered")
    return turn.url  # the finished reply is written after the turn's span ended


async def flush(tracer: Tracer) -> None:
    # The exporter posts from its own thread to the collector on this loop: never block it.
    assert await asyncio.to_thread(tracer.force_flush, 10.0)


def by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


async def test_turn__one_trace_in_openinference_conventions_with_its_tree(
    collector: OtlpReceiver,
) -> None:
    tracer = tracer_for(
        collector.url, trace_url_template="http://phoenix:6006/projects/p/traces/{trace_id}"
    )

    link = one_turn(tracer)
    await flush(tracer)
    await collector.wait_for(spans=6)
    tracer.shutdown(1.0)

    (trace_id,) = collector.traces()
    assert link == f"http://phoenix:6006/projects/p/traces/{trace_id}"
    names = by_name(collector.spans)
    (root,) = names["turn"]
    (compaction,) = names["compaction"]
    (tool,) = names["tool: shell"]
    requests = names["model request"]
    assert len(requests) == 3
    assert root.parent_id is None
    assert root.kind == "AGENT"
    assert compaction.kind == "CHAIN"
    assert tool.kind == "TOOL"
    assert {r.kind for r in requests} == {"LLM"}
    assert compaction.parent_id == root.span_id
    assert tool.parent_id == root.span_id
    assert sorted(r.parent_id for r in requests) == sorted(
        [compaction.span_id, root.span_id, root.span_id]
    )
    assert root.attributes["session.id"] == "42"
    assert root.attributes["slack_agent.surface"] == "slack"
    assert root.attributes["input.value"] == SECRET_TEXT
    assert root.attributes["output.value"] == "There is report.md."
    assert root.attributes["slack_agent.turn.outcome"] == "answered"
    assert root.resource["service.name"] == "slack-agent"
    assert all(span.attributes["session.id"] == "42" for span in collector.spans)
    assert all(span.scope == "slack_agent" for span in collector.spans)

    (answer,) = [r for r in requests if "llm.tools.0.tool.json_schema" in r.attributes]
    assert answer.parent_id == root.span_id
    a = answer.attributes
    assert a["llm.model_name"] == "gpt-4.1-mini"
    assert a["llm.provider"] == "openai"
    assert a["llm.token_count.prompt"] == 1200
    assert a["llm.token_count.completion"] == 30
    assert a["llm.token_count.total"] == 1230
    assert a["llm.token_count.prompt_details.cache_read"] == 1024
    assert a["llm.cost.total"] == pytest.approx(0.000272)
    assert a["llm.input_messages.0.message.role"] == "system"
    assert a["llm.input_messages.1.message.content"] == SECRET_TEXT
    assert a["llm.output_messages.0.message.content"] == "Looking."
    assert a["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "shell"
    assert a["llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments"] == (
        '{"command": "ls /work"}'
    )
    last = next(r for r in requests if "llm.input_messages.3.message.role" in r.attributes)
    assert last.attributes["llm.input_messages.3.message.role"] == "tool"
    assert last.attributes["llm.input_messages.3.message.tool_call_id"] == "call_1"
    assert last.attributes["llm.token_count.prompt"] == 1300
    assert "llm.token_count.completion" not in last.attributes  # unknown, not 0
    assert "llm.token_count.total" not in last.attributes

    assert tool.attributes["tool.name"] == "shell"
    assert tool.attributes["input.value"] == '{"command": "ls /work"}'
    assert tool.attributes["output.value"] == "report.md\n"
    assert tool.attributes["slack_agent.approval.decision"] == "approved"
    assert tool.attributes["slack_agent.approval.decider"] == "person"
    assert compaction.attributes["output.value"].endswith(SECRET_TEXT)
    # User ids are opt-in: neither the actor's nor the approver's is anywhere.
    for span in collector.spans:
        assert "user.id" not in span.attributes
        assert "slack_agent.approval.decided_by" not in span.attributes


async def test_trace_content_off__names_counts_and_sizes_but_no_text(
    collector: OtlpReceiver,
) -> None:
    tracer = tracer_for(collector.url, trace_content=False)

    one_turn(tracer)
    await flush(tracer)
    await collector.wait_for(spans=6)
    tracer.shutdown(1.0)

    for span in collector.spans:
        for key, value in span.attributes.items():
            assert SECRET_TEXT not in str(value), key
            assert "report.md" not in str(value), key
            assert not key.startswith(("llm.input_messages", "llm.output_messages", "llm.tools"))
            assert key not in {"input.value", "output.value"}
    names = by_name(collector.spans)
    (root,) = names["turn"]
    assert root.attributes["slack_agent.input.chars"] == len(SECRET_TEXT)
    (tool,) = names["tool: shell"]
    assert tool.attributes["tool.name"] == "shell"
    assert tool.attributes["slack_agent.output.chars"] == len("report.md\n")
    counts = [r.attributes.get("llm.token_count.prompt") for r in names["model request"]]
    assert sorted(c for c in counts if c is not None) == [100, 1200, 1300]
    assert all("slack_agent.input.chars" in r.attributes for r in names["model request"])


async def test_trace_user_ids_on__the_actor_and_the_approver_are_recorded(
    collector: OtlpReceiver,
) -> None:
    tracer = tracer_for(collector.url, trace_user_ids=True)

    one_turn(tracer, user_id="slack:T1:U1")
    await flush(tracer)
    await collector.wait_for(spans=6)
    tracer.shutdown(1.0)

    assert {span.attributes["user.id"] for span in collector.spans} == {"slack:T1:U1"}
    (tool,) = collector.named("tool: shell")
    assert tool.attributes["slack_agent.approval.decided_by"] == "slack:T1:U9"


async def test_span__an_exception_leaving_it_marks_it_as_an_error_and_propagates(
    collector: OtlpReceiver,
) -> None:
    tracer = tracer_for(collector.url)

    def failing_turn() -> None:
        question = [UserMessage("q")]
        with (
            tracer.turn(session_id=7, surface="terminal") as turn,
            turn.llm(provider="anthropic", model="claude-x", messages=question),
        ):
            raise ModelProviderUnavailable("anthropic: overloaded", provider="anthropic")

    with pytest.raises(ModelProviderUnavailable):
        failing_turn()
    await flush(tracer)
    await collector.wait_for(spans=2)
    tracer.shutdown(1.0)

    assert {span.status for span in collector.spans} == {"error"}
    (request,) = collector.named("model request")
    assert request.status_message == "model_provider_unavailable: anthropic: overloaded"


async def test_trace_content_off__an_error_keeps_its_code_but_not_its_text(
    collector: OtlpReceiver,
) -> None:
    # An error's message quotes what the model wrote or a tool was given.
    tracer = tracer_for(collector.url, trace_content=False)

    def failing_turn() -> None:
        with (
            tracer.turn(session_id=7, surface="terminal") as turn,
            turn.llm(provider="anthropic", model="claude-x", messages=[UserMessage("q")]),
        ):
            raise ModelProviderUnavailable(f"anthropic: {SECRET_TEXT}", provider="anthropic")

    with pytest.raises(ModelProviderUnavailable):
        failing_turn()
    await flush(tracer)
    await collector.wait_for(spans=2)
    tracer.shutdown(1.0)

    (request,) = collector.named("model request")
    assert request.status == "error"
    assert request.status_message == "model_provider_unavailable"
    (event,) = request.events
    assert event.name == "exception"
    assert event.attributes == {"exception.type": "model_provider_unavailable"}
    for span in collector.spans:
        assert SECRET_TEXT not in span.status_message
        for recorded in span.events:
            assert all(SECRET_TEXT not in str(value) for value in recorded.attributes.values())


async def test_collector_hanging__spans_queue_without_delaying_the_turn_and_overflow_is_counted(
    collector: OtlpReceiver,
) -> None:
    collector.mode = "hang"
    tracer = tracer_for(
        collector.url,
        otel_bsp_max_queue_size=4,
        otel_bsp_max_export_batch_size=2,
        otel_exporter_otlp_timeout=60_000,  # the export thread really stays stuck
    )
    full_before = dropped("queue_full")

    for session in (1, 2):  # two spans: a full batch, so the export thread sends it now
        with tracer.turn(session_id=session, surface="slack"):
            pass
    async with asyncio.timeout(30):
        await collector.wait_for(hanging=1)
    for session in range(3, 13):  # ten more turns while the collector holds that request
        with tracer.turn(session_id=session, surface="slack") as turn:
            turn.record_output("ok", outcome="answered")

    # Every turn finished while the export is still held: none waited for the collector.
    assert collector.hanging == 1
    assert collector.spans == []
    # Four fit in the queue; the other six were dropped, and counted.
    assert dropped("queue_full") - full_before == 6

    collector.release()
    collector.mode = "accept"
    await flush(tracer)
    await collector.wait_for(spans=6)
    await asyncio.to_thread(tracer.shutdown, 5.0)
    assert sorted(s.attributes["session.id"] for s in collector.spans) == sorted(
        ["1", "2", "3", "4", "5", "6"]
    )


async def test_collector_hanging__shutdown_gives_up_in_bounded_time_and_counts_the_loss(
    collector: OtlpReceiver,
) -> None:
    collector.mode = "hang"
    tracer = tracer_for(
        collector.url, otel_bsp_max_export_batch_size=1, otel_exporter_otlp_timeout=60_000
    )
    lost_before = dropped("shutdown")
    with tracer.turn(session_id=1, surface="slack"):
        pass
    async with asyncio.timeout(30):
        await collector.wait_for(hanging=1)
    with tracer.turn(session_id=2, surface="slack"):
        pass  # queued behind the held export

    await asyncio.to_thread(tracer.shutdown, 0.2)

    assert collector.hanging == 1  # shutdown returned; the collector still holds the request
    assert dropped("shutdown") - lost_before == 1


async def test_span__a_long_text_attribute_is_cut_at_the_stated_length(
    collector: OtlpReceiver,
) -> None:
    pasted = "x" * (DEFAULT_MAX_ATTRIBUTE_CHARS * 3)
    tracer = tracer_for(collector.url)
    with tracer.turn(session_id=1, surface="slack", text=pasted) as turn:
        turn.record_output(pasted, outcome="answered")
    shorter = tracer_for(collector.url, otel_attribute_value_length_limit=100)
    with shorter.turn(session_id=2, surface="slack", text=pasted):
        pass
    await flush(tracer)
    await flush(shorter)
    await collector.wait_for(spans=2)
    tracer.shutdown(1.0)
    shorter.shutdown(1.0)

    lengths = {
        span.attributes["session.id"]: (
            len(span.attributes["input.value"]),
            len(span.attributes.get("output.value", "")),
        )
        for span in collector.spans
    }
    assert lengths == {
        "1": (DEFAULT_MAX_ATTRIBUTE_CHARS, DEFAULT_MAX_ATTRIBUTE_CHARS),
        "2": (100, 0),
    }


async def test_collector_hanging__the_queue_is_bounded_in_bytes_not_only_in_spans(
    collector: OtlpReceiver,
) -> None:
    collector.mode = "hang"
    queue_bytes = 50_000
    text = "y" * 10_000
    tracer = tracer_for(
        collector.url,
        trace_queue_bytes=queue_bytes,
        otel_bsp_max_export_batch_size=1,
        otel_exporter_otlp_timeout=60_000,
    )
    full_before = dropped("queue_full")
    with tracer.turn(session_id=0, surface="slack"):
        pass  # a full batch: the export thread sends it now, and the collector holds it
    async with asyncio.timeout(30):
        await collector.wait_for(hanging=1)
    for session in range(1, 11):  # far fewer spans than OTEL_BSP_MAX_QUEUE_SIZE (2048)
        with tracer.turn(session_id=session, surface="slack", text=text):
            pass
    lost = dropped("queue_full") - full_before

    collector.release()
    collector.mode = "accept"
    await flush(tracer)
    await collector.wait_for(spans=1 + 10 - int(lost))
    await asyncio.to_thread(tracer.shutdown, 5.0)
    queued = [s for s in collector.spans if s.attributes["session.id"] != "0"]
    assert 0 < len(queued) < 10
    assert len(queued) + lost == 10
    assert sum(len(s.attributes["input.value"]) for s in queued) <= queue_bytes
    # The first spans were kept, the later ones dropped: a queue, not a sample.
    assert sorted(int(s.attributes["session.id"]) for s in queued) == list(
        range(1, len(queued) + 1)
    )


async def test_export__requests_stay_within_the_batch_bytes_and_a_larger_span_is_counted(
    collector: OtlpReceiver,
) -> None:
    batch_bytes = 60_000
    text = "z" * 10_000
    tracer = tracer_for(collector.url, trace_batch_bytes=batch_bytes)
    too_large_before = dropped("too_large")
    for session in range(1, 21):  # 200 kB of text: one batch by count, several by size
        with tracer.turn(session_id=session, surface="slack", text=text):
            pass
    # Many tools with long descriptions: a span no request may carry.
    catalogue = [ToolSpec(f"tool_{n}", "d" * 5_000) for n in range(20)]
    with tracer.turn(session_id=99, surface="slack") as turn:
        turn.llm(provider="openai", model="m", messages=[UserMessage("q")], tools=catalogue).end()
    await flush(tracer)
    await collector.wait_for(spans=21)
    tracer.shutdown(1.0)

    assert len(collector.body_bytes) > 1
    assert max(collector.body_bytes) <= batch_bytes
    assert sorted(int(s.attributes["session.id"]) for s in collector.named("turn")) == [
        *range(1, 21),
        99,
    ]
    assert collector.named("model request") == []
    assert dropped("too_large") - too_large_before == 1


async def test_llm_span__a_long_history_keeps_its_newest_messages_within_the_budget(
    collector: OtlpReceiver,
) -> None:
    batch_bytes = 60_000
    tracer = tracer_for(collector.url, trace_batch_bytes=batch_bytes)
    history = [UserMessage(f"message {n} " + "w" * 9_000) for n in range(20)]
    with tracer.turn(session_id=1, surface="slack") as turn:
        turn.llm(provider="openai", model="m", messages=history).end()
    await flush(tracer)
    await collector.wait_for(spans=2)
    tracer.shutdown(1.0)

    (request,) = collector.named("model request")
    contents = [
        value
        for key, value in request.attributes.items()
        if key.startswith("llm.input_messages.") and key.endswith(".message.content")
    ]
    omitted = request.attributes["slack_agent.llm.input_messages_omitted"]
    assert omitted + len(contents) == len(history)
    assert 0 < len(contents) < len(history)
    assert sum(len(text) for text in contents) <= batch_bytes // 2
    assert request.attributes["llm.input_messages.0.message.content"].startswith(
        f"message {omitted} "
    )
    assert request.attributes["slack_agent.llm.input_message_count"] == len(history)


async def test_collector_refusing__the_batch_is_counted_as_failed(
    collector: OtlpReceiver,
) -> None:
    collector.mode = "refuse"
    tracer = tracer_for(collector.url, otel_exporter_otlp_timeout=500)
    failed_before = dropped("export_failed")

    one_turn(tracer)
    await asyncio.to_thread(tracer.force_flush, 10.0)
    await asyncio.to_thread(tracer.shutdown, 1.0)

    assert collector.requests >= 1
    assert collector.spans == []
    assert dropped("export_failed") - failed_before == 6


async def test_collector_unreachable__the_batch_is_counted_as_failed() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tracer = tracer_for(f"http://127.0.0.1:{port}", otel_exporter_otlp_timeout=500)
    failed_before = dropped("export_failed")

    one_turn(tracer)
    await asyncio.to_thread(tracer.force_flush, 10.0)
    await asyncio.to_thread(tracer.shutdown, 1.0)

    assert dropped("export_failed") - failed_before == 6


def test_tracing_off__no_endpoint_means_inert_handles() -> None:
    tracer = Tracer.from_settings(load_settings())

    assert not tracer.enabled
    with tracer.turn(session_id=1, surface="slack", text="hi") as turn:
        assert not turn.recording
        with turn.llm(provider="offline", model="m", messages=[UserMessage("hi")]) as llm:
            llm.record_usage(Usage(1, 1))
        assert turn.url is None
        assert turn.trace_id is None
    tracer.shutdown(0.1)


def test_tracing_off__otel_sdk_disabled_wins_over_an_endpoint() -> None:
    settings = load_settings(
        otel_exporter_otlp_endpoint="http://127.0.0.1:1", otel_sdk_disabled=True
    )

    assert TraceConfig.from_settings(settings) is None


def test_config__endpoints_headers_and_timeout_follow_the_otel_variables() -> None:
    base = load_settings(
        otel_exporter_otlp_endpoint="http://collector:4318/",
        otel_exporter_otlp_headers="api-key=s%3Dcret,x-team=platform",
        otel_exporter_otlp_timeout=2500,
        otel_resource_attributes="deployment.environment=prod",
    )
    config = TraceConfig.from_settings(base)
    assert config is not None
    assert config.endpoint == "http://collector:4318/v1/traces"
    assert config.headers == {"api-key": "s=cret", "x-team": "platform"}
    assert config.timeout_seconds == 2.5  # milliseconds, as the specification says
    assert config.resource_attributes == {"deployment.environment": "prod"}

    specific = load_settings(
        otel_exporter_otlp_endpoint="http://collector:4318",
        otel_exporter_otlp_traces_endpoint="http://traces:9999/custom",
    )
    assert (TraceConfig.from_settings(specific) or config).endpoint == "http://traces:9999/custom"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "otel_exporter_otlp_endpoint": "http://collector:4318",
                "otel_exporter_otlp_headers": "api-key=x,secret-without-equals",
            },
            "OTEL_EXPORTER_OTLP_HEADERS: entry 2 is not key=value",
        ),
        (
            {"otel_exporter_otlp_endpoint": "collector:4318"},
            "OTEL_EXPORTER_OTLP_ENDPOINT: 'collector:4318/v1/traces' is not an http(s) URL",
        ),
    ],
)
def test_config__malformed_otel_values_are_one_line_naming_the_variable(
    overrides: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        TraceConfig.from_settings(load_settings(**overrides))
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)
    assert "secret-without-equals" not in str(info.value)


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("http://phoenix/traces/{traceid}", "unknown field {traceid}"),
        ("http://phoenix/traces/", "it has no {trace_id}"),
        ("phoenix/{trace_id}", "is not an http(s) URL"),
        ("http://phoenix/{trace_id", "is not a template"),
    ],
)
def test_trace_url_template__a_bad_one_stops_start_up_in_one_line(
    template: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(trace_url_template=template)
    assert str(info.value).startswith("TRACE_URL_TEMPLATE: ")
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


async def test_tracer__an_ambient_span_of_another_library_never_adopts_our_turn(
    collector: OtlpReceiver,
) -> None:
    # Some other instrumentation's provider, its span current in this context: our turn is
    # still the root of its own trace (explicit parents, no global provider involved).
    other = TracerProvider()
    tracer = tracer_for(collector.url)

    with (
        other.get_tracer("someone-else").start_as_current_span("their request"),
        tracer.turn(session_id=5, surface="slack") as turn,
        turn.llm(provider="offline", model="m", messages=[UserMessage("hi")]),
    ):
        pass
    await flush(tracer)
    await collector.wait_for(spans=2)
    tracer.shutdown(1.0)
    other.shutdown()

    (root,) = collector.named("turn")
    (child,) = collector.named("model request")
    assert root.parent_id is None
    assert child.parent_id == root.span_id
    assert {span.scope for span in collector.spans} == {"slack_agent"}

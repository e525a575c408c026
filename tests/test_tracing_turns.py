"""Traces of real turns: the agent loop with the OpenAI stand-in and the real sandbox, exported
over OTLP/HTTP to the stand-in collector, which decodes the protobuf it receives. The span
tree and its attributes are asserted on what arrived; content and user ids only when allowed;
a collector that is not there costs the turn nothing but its spans."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from core.agent.accounting import Accounting, Attribution, Payer
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.messages import user_message
from core.providers.streaming import HttpOptions, RetryPolicy
from core.runtime import Runtime
from core.settings import Settings, load_settings
from core.storage import Storage
from core.storage.engine import Database
from core.storage.sessions import SessionStore
from core.storage.usage import UsageLedger
from core.tracing.spans import Tracer
from standins import openai as fake_openai
from standins.openai import OpenAIStandIn
from standins.otlp import OtlpReceiver, ReceivedSpan
from tests.helpers import add_exchange, new_session
from tests.providers_fixtures import RecordingSleep
from tests.test_tracing import dropped

SECRET = "the launch code is 4711"
TEMPLATE = "http://phoenix:6006/projects/slack-agent/traces/{trace_id}"


@pytest.fixture
async def collector() -> AsyncIterator[OtlpReceiver]:
    async with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
async def openai_server() -> AsyncIterator[OpenAIStandIn]:
    async with OpenAIStandIn() as server:
        yield server  # type: ignore[misc]


AgentFactory = Callable[..., Agent]


@pytest.fixture
async def agent_for(db: Database) -> AsyncIterator[AgentFactory]:
    made: list[tuple[ProviderCache, Tracer]] = []

    def make(store: SessionStore, server: OpenAIStandIn, tracer: Tracer, **config: Any) -> Agent:
        settings = Settings(
            model_provider="openai",
            openai_api_key="sk-test",
            openai_base_url=server.base_url,
            model_name="fake-model",
        )
        cache = ProviderCache(settings, http=HttpOptions(retry=RetryPolicy(sleep=RecordingSleep())))
        made.append((cache, tracer))
        ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
        return Agent(
            store, cache, AgentConfig(**config), accounting=Accounting(ledger, None, tracer)
        )

    yield make
    for cache, tracer in made:
        await cache.aclose()
        await asyncio.to_thread(tracer.shutdown, 1.0)


def tracer_for(endpoint: str, **settings: Any) -> Tracer:
    return Tracer.from_settings(
        load_settings(otel_exporter_otlp_traces_endpoint=endpoint, **settings)
    )


def script_turn(server: OpenAIStandIn) -> None:
    """A compaction's checkpoint, a shell call, then the answer."""
    server.push(
        fake_openai.tool_call_reply([("cp_1", "write_checkpoint", {"objectives": [SECRET]})]),
        fake_openai.tool_call_reply([("call_1", "shell", {"command": f"echo '{SECRET}'"})]),
        fake_openai.text_reply("It said ", SECRET),
    )


async def run(agent: Agent, session_id: int) -> Any:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(f"repeat {SECRET}"),
        last_message_id=tail.message_id if tail else None,
        attribution=Attribution("slack", Payer("slack:T1:U1", "T1")),
    )


def named(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    out: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


async def test_turn_trace__agent_llm_tool_and_compaction_spans_in_one_tree(
    store: SessionStore,
    openai_server: OpenAIStandIn,
    collector: OtlpReceiver,
    agent_for: AgentFactory,
) -> None:
    _, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    tracer = tracer_for(collector.endpoint, trace_url_template=TEMPLATE)
    script_turn(openai_server)
    result = await run(agent_for(store, openai_server, tracer, auto_compact_tokens=1), session.id)
    assert result.error is None
    assert result.compacted
    assert await asyncio.to_thread(tracer.force_flush, 10.0)
    await collector.wait_for(spans=6)

    (trace_id,) = collector.traces()
    assert result.trace_url == TEMPLATE.format(trace_id=trace_id)
    spans = named(collector.spans)
    (root,) = spans["turn"]
    (compaction,) = spans["compaction"]
    (tool,) = spans["tool: shell"]
    requests = spans["model request"]
    assert len(requests) == 3
    assert (root.kind, compaction.kind, tool.kind) == ("AGENT", "CHAIN", "TOOL")
    assert root.parent_id is None
    assert compaction.parent_id == root.span_id
    assert tool.parent_id == root.span_id
    assert sorted(r.parent_id or "" for r in requests) == sorted(
        [compaction.span_id, root.span_id, root.span_id]
    )
    assert all(span.attributes["session.id"] == str(session.id) for span in collector.spans)
    assert root.attributes["slack_agent.surface"] == "slack"
    assert root.attributes["input.value"] == f"repeat {SECRET}"
    assert root.attributes["output.value"] == f"It said {SECRET}"
    assert root.attributes["slack_agent.turn.outcome"] == "answered"
    for request in requests:
        a = request.attributes
        assert (a["llm.model_name"], a["llm.provider"]) == ("fake-model", "openai")
    (checkpoint_call,) = [r for r in requests if r.parent_id == compaction.span_id]
    assert checkpoint_call.attributes["llm.token_count.prompt"] == 30
    answer = [r for r in requests if r.parent_id == root.span_id]
    totals = sorted(r.attributes["llm.token_count.total"] for r in answer)
    assert totals == [19, 41]
    assert any(SECRET in str(r.attributes) for r in answer)  # the messages, content on
    assert tool.attributes["tool.name"] == "shell"
    assert SECRET in tool.attributes["input.value"]
    assert SECRET in tool.attributes["output.value"]
    for span in collector.spans:
        assert "user.id" not in span.attributes


async def test_turn_trace__content_off_and_user_ids_on(
    store: SessionStore,
    openai_server: OpenAIStandIn,
    collector: OtlpReceiver,
    agent_for: AgentFactory,
) -> None:
    _, session = await new_session(store)
    await add_exchange(store, session.id, 2)
    tracer = tracer_for(collector.endpoint, trace_content=False, trace_user_ids=True)
    script_turn(openai_server)
    result = await run(agent_for(store, openai_server, tracer, auto_compact_tokens=1), session.id)
    assert result.error is None
    assert result.trace_url is None  # no TRACE_URL_TEMPLATE
    assert await asyncio.to_thread(tracer.force_flush, 10.0)
    await collector.wait_for(spans=6)
    assert len(collector.spans) == 6
    for span in collector.spans:
        for key, value in span.attributes.items():
            assert SECRET not in str(value), (span.name, key)
            assert not key.startswith(("llm.input_messages", "llm.output_messages"))
    (root,) = named(collector.spans)["turn"]
    assert root.attributes["user.id"] == "slack:T1:U1"
    assert root.attributes["slack_agent.output.chars"] == len(f"It said {SECRET}")
    counts = [
        r.attributes["llm.token_count.prompt"] for r in named(collector.spans)["model request"]
    ]
    assert sorted(counts) == [12, 30, 30]


async def test_turn_trace__an_unreachable_collector_loses_spans_never_the_turn(
    store: SessionStore, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tracer = tracer_for(f"http://127.0.0.1:{port}/v1/traces", otel_exporter_otlp_timeout=500)
    failed_before = dropped("export_failed")
    _, session = await new_session(store)
    openai_server.push(fake_openai.text_reply("Fine."))
    result = await run(agent_for(store, openai_server, tracer), session.id)
    assert result.error is None
    assert result.text == "Fine."
    await asyncio.to_thread(tracer.force_flush, 10.0)
    assert dropped("export_failed") - failed_before == 2  # the turn and its model request


async def test_runtime__builds_the_tracer_from_the_otel_settings(database_url: str) -> None:
    settings = load_settings(
        database_url=database_url, otel_exporter_otlp_endpoint="http://127.0.0.1:4318"
    )
    runtime = Runtime.on(settings, Storage.open(settings))
    try:
        assert runtime.tracer.enabled
        assert runtime.agent.accounting.tracer is runtime.tracer
    finally:
        await runtime.close()
    off = load_settings(database_url=database_url)
    runtime = Runtime.on(off, Storage.open(off))
    try:
        assert not runtime.tracer.enabled
    finally:
        await runtime.close()

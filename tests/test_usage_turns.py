"""Usage and budgets in real turns: the providers' own wire formats (OpenAI's streamed usage,
Anthropic's message usage) from local stand-ins, the real store and ledger on both databases,
and two processes racing for the last of a budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from typing import Any

import pytest

from core.agent.accounting import Accounting, Attribution, Payer
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.conversation import Conversations, OverBudget, TurnRequest
from core.errors import AgentSessionBudgetExceeded
from core.messages import user_message
from core.providers.base import Usage
from core.providers.streaming import HttpOptions, RetryPolicy
from core.records import Actor
from core.settings import Settings
from core.storage.budgets import Budgets
from core.storage.custom_providers import CustomProviderSpec, add_custom_provider
from core.storage.engine import Database, create_database
from core.storage.feedback import Feedback
from core.storage.sessions import SessionStore
from core.storage.usage import LedgerEntry, UsageLedger
from core.usage.budgets import parse_budgets, refused_budget, resets_text
from core.usage.prices import OwnPrices
from core.usage.totals import RequestUsage
from standins import anthropic as fake_anthropic
from standins import openai as fake_openai
from standins.anthropic import AnthropicStandIn
from standins.openai import OpenAIStandIn
from standins.scripted import SseReply, sse_frame
from tests.helpers import new_session, read_json_line, start_worker, stop_workers
from tests.providers_fixtures import RecordingSleep

PAYER = Payer("slack:T1:U1", "T1")


@pytest.fixture
async def openai_server() -> AsyncIterator[OpenAIStandIn]:
    async with OpenAIStandIn() as server:
        yield server


@pytest.fixture
async def anthropic_server() -> AsyncIterator[AnthropicStandIn]:
    async with AnthropicStandIn() as server:
        yield server


AgentFactory = Callable[..., Agent]


@pytest.fixture
async def agent_for(db: Database) -> AsyncIterator[AgentFactory]:
    caches: list[ProviderCache] = []

    def make(store: SessionStore, settings: Settings, budgets: str = "", **config: Any) -> Agent:
        caches.append(
            ProviderCache(settings, http=HttpOptions(retry=RetryPolicy(RecordingSleep())))
        )
        ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
        accounting = Accounting(ledger, Budgets(db, parse_budgets(budgets)))
        return Agent(store, caches[-1], AgentConfig(**config), accounting=accounting)

    yield make
    for cache in caches:
        await cache.aclose()


def openai_settings(server: OpenAIStandIn) -> Settings:
    return Settings(
        model_provider="openai",
        openai_api_key="sk-test",
        openai_base_url=server.base_url,
        model_name="fake-model",
    )


async def turn(agent: Agent, session_id: int, text: str, payer: Payer | None = PAYER) -> Any:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
        attribution=Attribution("slack", payer),
    )


def usage_of(result: Any) -> dict[str, Any]:
    return dict(result.answer.message["metadata"]["usage"])


async def test_usage__openai_streamed_usage_is_the_messages_usage_and_one_ledger_row(
    store: SessionStore, db: Database, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(
        SseReply(
            [
                *fake_openai.text_frames("Hello."),
                sse_frame(fake_openai.usage_chunk(120, 7, cached_tokens=100)),
                fake_openai.DONE,
            ]
        )
    )
    result = await turn(agent_for(store, openai_settings(openai_server)), session.id, "hi")
    assert openai_server.requests[0].body["stream_options"] == {"include_usage": True}
    assert usage_of(result) == {
        "provider": "openai",
        "model": "fake-model",
        "requests": 1,
        "input_tokens": 120,
        "output_tokens": 7,
        "cached_tokens": 100,
        # A local server is not OpenAI's API: genai-prices does not know it, so no price.
        "cost_usd": None,
        "estimated": False,
    }
    (line,) = await UsageLedger(db, staleness_seconds=60).report("user")
    assert (line.key, line.requests, line.input_tokens, line.output_tokens) == (
        "slack:T1:U1",
        1,
        120,
        7,
    )
    assert (line.cached_tokens, line.counted_tokens, line.unpriced) == (100, 127, 1)


async def test_usage__a_tool_round_adds_both_requests(
    store: SessionStore, db: Database, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(
        fake_openai.tool_call_reply([("call_1", "shell", {"command": "echo hi"})]),
        fake_openai.text_reply("Done.", usage=(50, 4)),
    )
    result = await turn(agent_for(store, openai_settings(openai_server)), session.id, "run it")
    usage = usage_of(result)
    assert (usage["requests"], usage["input_tokens"], usage["output_tokens"]) == (2, 80, 15)
    (line,) = await UsageLedger(db, staleness_seconds=60).report("model")
    assert (line.key, line.requests, line.counted_tokens) == ("openai/fake-model", 2, 95)


async def test_usage__anthropic_message_usage_counts_cache_reads_and_writes_as_input(
    store: SessionStore, anthropic_server: AnthropicStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    anthropic_server.push(
        SseReply(
            [
                fake_anthropic.message_start(15, cache_read=200, cache_write=30),
                *fake_anthropic.text_block(0, "Hi."),
                *fake_anthropic.message_end("end_turn", 9),
            ]
        )
    )
    settings = Settings(
        model_provider="anthropic",
        anthropic_api_key="key",
        anthropic_base_url=anthropic_server.url,
        model_name="claude-test",
    )
    result = await turn(agent_for(store, settings), session.id, "hi")
    usage = usage_of(result)
    assert (usage["provider"], usage["model"]) == ("anthropic", "claude-test")
    assert (usage["input_tokens"], usage["output_tokens"], usage["cached_tokens"]) == (245, 9, 200)
    assert usage["estimated"] is False


async def test_usage__a_custom_providers_own_prices_give_the_cost(
    store: SessionStore,
    db: Database,
    openai_server: OpenAIStandIn,
    agent_for: AgentFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PRICED_KEY", "sk-test")
    prices = OwnPrices(Decimal("2.50"), Decimal("10"), Decimal("1.25"))
    await add_custom_provider(
        db,
        CustomProviderSpec("priced", "openai", openai_server.base_url, "PRICED_KEY", "m1", prices),
    )
    _, session = await new_session(store)
    openai_server.push(
        SseReply(
            [
                *fake_openai.text_frames("Hi."),
                sse_frame(fake_openai.usage_chunk(1000, 100, cached_tokens=400)),
                fake_openai.DONE,
            ]
        )
    )
    result = await turn(agent_for(store, Settings(model_provider="priced")), session.id, "hi")
    # 600 input at $2.50/M, 400 cached at $1.25/M, 100 output at $10/M.
    assert usage_of(result)["cost_usd"] == pytest.approx(0.0015 + 0.0005 + 0.001)
    (line,) = await UsageLedger(db, staleness_seconds=60).report("model")
    assert line.cost_usd == Decimal("0.003")
    assert line.unpriced == 0


async def test_usage__a_server_that_reports_none_is_unknown_and_budgets_count_an_estimate(
    store: SessionStore, db: Database, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(SseReply([*fake_openai.text_frames("Some answer."), fake_openai.DONE]))
    result = await turn(agent_for(store, openai_settings(openai_server)), session.id, "hi")
    usage = usage_of(result)
    assert (usage["requests"], usage["input_tokens"], usage["output_tokens"]) == (1, None, None)
    assert usage["cost_usd"] is None
    (line,) = await UsageLedger(db, staleness_seconds=60).report("user")
    assert (line.unreported, line.estimated) == (1, 1)
    assert line.counted_tokens > 0  # the estimate a token budget counts


async def test_usage__the_offline_models_counts_are_estimated_and_free(
    store: SessionStore, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    result = await turn(agent_for(store, Settings(model_provider="offline")), session.id, "hi")
    usage = usage_of(result)
    assert usage["estimated"] is True
    assert usage["cost_usd"] == 0
    assert usage["input_tokens"] > 0


async def test_usage__compactions_model_call_is_counted_apart(
    store: SessionStore, db: Database, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    agent = agent_for(store, Settings(model_provider="offline"))
    await turn(agent, session.id, "first")
    checkpoint = await agent.compact(
        session.id, Actor(None, admin=True), attribution=Attribution("slack", PAYER)
    )
    assert checkpoint.is_compaction_message
    lines = await UsageLedger(db, staleness_seconds=60).report("user")
    assert [(line.key, line.requests) for line in lines] == [("slack:T1:U1", 2)]


# -- budgets ---------------------------------------------------------------------------------


async def spend(db: Database, tokens: int, payer: Payer = PAYER) -> None:
    """A request already in the ledger (as another replica's turn would have written it)."""
    request = RequestUsage("openai", "m", Usage(tokens, 0), None)
    ledger = UsageLedger(db, staleness_seconds=60)
    await ledger.record(LedgerEntry(request, "answer", tokens, False, payer=payer))


async def test_budget__a_payer_over_the_limit_is_refused_before_any_model_request(
    store: SessionStore, db: Database, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    await spend(db, 1000)
    agent = agent_for(store, openai_settings(openai_server), budgets="user:day:1000tokens")
    with pytest.raises(AgentSessionBudgetExceeded) as refused:
        await turn(agent, session.id, "one more")
    assert refused.value.limit == "user:day:1000tokens"
    assert refused.value.during_turn is False
    assert openai_server.requests == []  # zero tokens
    assert await store.messages(session.id) == []  # the message was not added
    assert not (await store.get_session(session.id)).is_turn_active
    # Another payer (another workspace's person) has their own account.
    openai_server.push(fake_openai.text_reply("Hi."))
    result = await turn(agent, session.id, "me", payer=Payer("slack:T2:U2", "T2"))
    assert result.error is None


async def test_budget__the_conversation_api_returns_one_refusal_naming_the_limit(
    store: SessionStore, db: Database, agent_for: AgentFactory
) -> None:
    await spend(db, 5)
    agent = agent_for(store, Settings(model_provider="offline"), budgets="all:day:5tokens")
    conversations = Conversations(store, agent, Feedback(db), project="slack")
    owner = await conversations.person("slack:T1:U1")
    conversation = await conversations.open("T1/C1/1.0", owner=owner)
    outcome = await conversation.take_turn(TurnRequest("hello", payer=PAYER))
    assert isinstance(outcome, OverBudget)
    assert refused_budget(outcome.refusal).describe() == "the shared budget of 5 tokens a day"
    assert resets_text(outcome.refusal).endswith("00:00 UTC")
    assert await conversation.is_empty()


async def test_budget__a_turn_crossing_the_limit_stops_after_the_request_in_flight(
    store: SessionStore, db: Database, openai_server: OpenAIStandIn, agent_for: AgentFactory
) -> None:
    _, session = await new_session(store)
    openai_server.push(
        fake_openai.tool_call_reply([("call_1", "shell", {"command": "echo hi"})]),
        fake_openai.text_reply("never asked for"),
    )
    agent = agent_for(store, openai_settings(openai_server), budgets="workspace:month:40tokens")
    result = await turn(agent, session.id, "go")
    assert isinstance(result.error, AgentSessionBudgetExceeded)
    assert result.error.during_turn is True
    assert result.error.limit == "workspace:month:40tokens"
    assert len(openai_server.requests) == 1  # the request in flight finished; no other
    stored = result.answer.message
    assert stored["metadata"]["interrupted"] is True
    assert stored["metadata"]["error"]["code"] == "agent_session_budget_exceeded"
    assert stored["metadata"]["usage"]["requests"] == 1
    assert [p["type"] for p in stored["parts"]] == ["step-start", "tool-shell"]
    assert not (await store.get_session(session.id)).is_turn_active


async def test_budget__set_at_run_time_applies_and_a_bad_value_changes_nothing(
    db: Database,
) -> None:
    budgets = Budgets(db, parse_budgets("user:day:100tokens"))
    await budgets.set("all:month:5usd,user:day:300tokens")
    assert [str(b) for b in await budgets.in_force()] == [
        "user:day:300tokens",
        "all:month:5usd",
    ]
    with pytest.raises(Exception, match="scope 'team' is not user, workspace or all"):
        await budgets.set("user:day:1tokens,team:day:5usd")
    assert [str(b) for b in await budgets.in_force()] == [
        "user:day:300tokens",
        "all:month:5usd",
    ]
    await budgets.clear("user:day")
    assert [str(b) for b in await budgets.in_force()] == ["all:month:5usd"]
    await budgets.clear()
    assert [str(b) for b in await budgets.in_force()] == ["user:day:100tokens"]


@pytest.mark.slow
async def test_budget__two_processes_racing_for_the_last_of_a_budget_admit_one(
    store: SessionStore, db: Database, database_url: str
) -> None:
    await spend(db, 999, Payer("slack:T1:U7", "T1"))
    sessions = [(await new_session(store, key=f"T1/C1/race{i}"))[1].id for i in range(2)]
    procs = [
        start_worker("budget_claim", database_url, sid, "all:day:1000tokens", "slack:T1:U7")
        for sid in sessions
    ]
    try:
        for proc in procs:
            assert read_json_line(proc) == {"ready": True}
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = sorted(read_json_line(proc)["result"] for proc in procs)
    finally:
        stop_workers(procs, wait=10)
    assert results == ["agent_session_budget_exceeded", "won"]
    # The loser's message was rolled back with its claim.
    counts = [len(await store.messages(sid)) for sid in sessions]
    assert sorted(counts) == [0, 1]


async def test_budget__set_and_clear_from_several_replicas_at_once_all_land(
    db: Database, database_url: str
) -> None:
    """Five replicas each change another limit at the same moment: every change is kept (each
    read the stored value before any wrote, so the last write put back what the others had
    replaced)."""
    replicas = [create_database(database_url) for _ in range(5)]
    try:
        stores = [Budgets(replica, parse_budgets("user:day:100tokens")) for replica in replicas]
        await asyncio.gather(*(store.in_force() for store in stores))  # connected
        periods = ["user:day", "user:month", "workspace:day", "workspace:month", "all:day"]
        await asyncio.gather(
            *(
                store.set(f"{period}:{10 * (i + 1)}tokens")
                for i, (store, period) in enumerate(zip(stores, periods, strict=True))
            )
        )
        assert sorted(str(b) for b in await Budgets(db, ()).in_force()) == sorted(
            f"{period}:{10 * (i + 1)}tokens" for i, period in enumerate(periods)
        )
        await asyncio.gather(
            *(store.clear(period) for store, period in zip(stores, periods, strict=True))
        )
        assert await stores[0].in_force() == ()
    finally:
        await asyncio.gather(*(replica.dispose() for replica in replicas))

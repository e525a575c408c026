"""Budgets at their edges (issue 35): a change made on one replica holds for the next claim on
every other, periods roll over at UTC midnight and month start exactly, the reservation bounds
what concurrent turns overshoot at a budget's end, and a stopped or failed answer is charged."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from core.agent.accounting import Accounting, Attribution, Payer
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.errors import AgentSessionBudgetExceeded
from core.messages import user_message
from core.providers.base import Usage
from core.settings import Settings
from core.storage.budgets import Budgets
from core.storage.engine import Database, create_database
from core.storage.sessions import SessionStore
from core.storage.usage import LedgerEntry, UsageLedger
from core.usage.totals import RequestUsage
from tests.helpers import new_session

PAYER = Payer("slack:T1:U1", "T1")


@pytest.fixture
async def offline() -> AsyncIterator[ProviderCache]:
    cache = ProviderCache(Settings(model_provider="offline"))
    yield cache
    await cache.aclose()


async def spend(db: Database, tokens: int, payer: Payer = PAYER) -> None:
    """A request already in the ledger, as another replica's turn would have written it."""
    request = RequestUsage("openai", "m", Usage(tokens, 0), None)
    await UsageLedger(db, staleness_seconds=60).record(
        LedgerEntry(request, "answer", tokens, False, payer=payer)
    )


async def turn(agent: Agent, session_id: int, text: str) -> object:
    tail = await agent.store.tail(session_id)
    return await agent.run_turn(
        session_id,
        user_message=user_message(text),
        last_message_id=tail.message_id if tail else None,
        attribution=Attribution("slack", PAYER),
    )


async def test_budget_set__holds_for_the_next_claim_on_another_replica(
    db: Database, database_url: str, offline: ProviderCache
) -> None:
    """Replica A runs turns; replica B's operator lowers the limit below what was spent: A's
    very next claim is refused (no cache of the budgets in force to wait out), and raising it
    again admits the claim after that."""
    other = create_database(database_url)
    try:
        store = SessionStore(db)
        ledger = UsageLedger(db, staleness_seconds=store.staleness_seconds)
        agent = Agent(
            store,
            offline,
            AgentConfig(auto_compact_tokens=0),
            accounting=Accounting(ledger, Budgets(db, ())),
        )
        _, session = await new_session(store)
        await turn(agent, session.id, "first")  # no budget yet
        await spend(db, 500)
        await Budgets(other, ()).set("user:day:100tokens")
        with pytest.raises(AgentSessionBudgetExceeded) as refused:
            await turn(agent, session.id, "second")
        assert refused.value.limit == "user:day:100tokens"
        await Budgets(other, ()).set("user:day:1000000tokens")
        await turn(agent, session.id, "third")
        assert len(await store.messages(session.id)) == 4
    finally:
        await other.dispose()

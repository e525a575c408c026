"""What a turn used and what it looked like: usage, budgets and the turn's trace, in one object
the agent loop calls at a few fixed points.

The loop knows nothing of prices, ledgers or spans. Per turn it asks ``Accounting`` for a
``TurnAccount`` and then:

- ``reservation()`` goes into the claim (``run_turn``): the budget check and the reservation
  run inside the claim transaction, so a payer over a limit is refused before anything is
  written or any model is called (``core.storage.usage``);
- ``started()`` once the claim holds: the turn's root span (OpenInference ``AGENT``);
- ``provider(p)`` wraps the turn's model provider: each request gets an ``LLM`` span, its
  ``Usage`` is priced, written to the ledger (one row per request, so replicas share one
  account) and added to the message's ``metadata.usage``;
- ``before_request()`` before every request after the first: a turn whose payer ran out of
  budget while it ran stops there (the request in flight finished; the partial answer is kept);
- ``tool(call)`` and ``compaction()`` open the ``TOOL`` and compaction spans;
- ``ended(...)`` closes the root span with the turn's outcome.

With no budgets, no collector and the offline model, what is left is pricing nothing and one
ledger row per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from core import metrics
from core.agent.charges import LedgerWriter
from core.errors import (
    AgentSessionBudgetExceeded,
    ModelProviderRateLimited,
    ModelProviderRejected,
    ModelProviderUnavailable,
)
from core.messages import Message
from core.providers.base import (
    AssistantMessage,
    ChatMessage,
    EventStream,
    ModelProvider,
    TextDelta,
    ToolCall,
    ToolSpec,
    Usage,
)
from core.providers.estimate import CHARS_PER_TOKEN, estimate_usage
from core.storage.budgets import Budgets
from core.storage.usage import Kind, LedgerEntry, Reservation, UsageLedger
from core.trace_links import TRACE_ID
from core.tracing.spans import CompactionSpan, ToolSpan, Tracer, TurnSpan
from core.usage.budgets import Budget, Payer
from core.usage.prices import PriceSource
from core.usage.totals import MessageUsage, RequestUsage

log = logging.getLogger(__name__)

CLOSE_SECONDS: Final = 5.0  # the most a shutdown waits for the ledger's last rows

# Errors of a request the provider refused before it did any work (a bad key, a rate limit, an
# overloaded or unreachable server): nothing is billed when nothing was answered. Time-outs
# and broken streams are billed: the provider was working when they happened.
UNBILLED: Final = (ModelProviderRejected, ModelProviderRateLimited, ModelProviderUnavailable)


@dataclass(frozen=True)
class Attribution:
    """Who a turn is for and where it came from: ``payer`` for the ledger and budgets (``None``:
    only a deployment-wide budget applies), ``surface`` (``slack``, ``terminal``) for traces."""

    surface: str | None = None
    payer: Payer | None = None


class Accounting:
    """One per process: the ledger, the budgets in force and the tracer, shared by its turns."""

    def __init__(
        self,
        ledger: UsageLedger,
        budgets: Budgets | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.ledger = ledger
        self.writer = LedgerWriter(ledger)  # ledger rows, retried when a write fails
        self.budgets = budgets
        self.tracer = tracer or Tracer.off()
        self._charging: set[asyncio.Task[RequestUsage]] = set()  # outliving a cancelled turn

    async def close(self) -> None:
        """At shutdown: the charges still being written finish, and rows waiting to be written
        again get one last try, within ``CLOSE_SECONDS``; what is left is said in the log."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(CLOSE_SECONDS):
                if self._charging:
                    await asyncio.gather(*self._charging, return_exceptions=True)
                await self.writer.flush()
        await self.writer.close()

    def turn(self, session_id: int, attribution: Attribution | None = None) -> TurnAccount:
        return TurnAccount(self, session_id, attribution or Attribution())

    async def in_force(self) -> tuple[Budget, ...]:
        """The budgets in force, read for every claim (one prepared statement): a change made
        with ``budget set`` holds for the next claim on every replica, with no cache to wait
        out."""
        if self.budgets is None:
            return ()
        return await self.budgets.in_force()


class TurnAccount:
    """One turn's (or one compaction's) usage, budget and spans (see the module)."""

    def __init__(self, accounting: Accounting, session_id: int, attribution: Attribution) -> None:
        self._accounting = accounting
        self.session_id = session_id
        self.attribution = attribution
        self.budgets: tuple[Budget, ...] = ()
        self.requests: list[RequestUsage] = []  # of the answer (compaction's are apart)
        self.compaction_requests: list[RequestUsage] = []
        self.message_id: str | None = None  # the answer's id, once known
        self.span: TurnSpan | CompactionSpan = Tracer.off().turn(session_id=0, surface="")
        self._parent: TurnSpan | CompactionSpan = self.span
        self._kind: Kind = "answer"
        self._made = 0  # model requests made so far
        self._reservation: Reservation | None = None  # taken at the claim

    # -- before the claim ---------------------------------------------------------------------

    async def reservation(self, message: Message | None = None) -> Reservation | None:
        """The budget check the claim runs (``None``: no budget applies to this payer);
        ``message``: the user message the turn adds, part of what its first request sends."""
        self.budgets = await self._accounting.in_force()
        if not self.budgets:
            return None
        reservation = self._accounting.ledger.reservation(self.budgets, self.attribution.payer)
        if reservation is not None and message is not None:
            chars = len(json.dumps(message, ensure_ascii=False))
            reservation.text_tokens = -(-chars // CHARS_PER_TOKEN)
        self._reservation = reservation
        return reservation

    # -- the trace ------------------------------------------------------------------------------

    def started(self, text: str | None) -> None:
        """The claim held: the turn's root span starts."""
        payer = self.attribution.payer
        self.span = self._parent = self._accounting.tracer.turn(
            session_id=self.session_id,
            surface=self.attribution.surface or "unknown",
            user_id=None if payer is None else payer.user,
            text=text,
        )

    def started_compaction(self) -> None:
        """A compaction asked for on its own: the root of its own trace."""
        payer = self.attribution.payer
        span = self._accounting.tracer.compaction(
            session_id=self.session_id,
            surface=self.attribution.surface or "unknown",
            user_id=None if payer is None else payer.user,
        )
        self.span = self._parent = span
        self._kind = "compaction"

    @contextlib.contextmanager
    def compaction(self) -> Iterator[CompactionSpan]:
        """An automatic compaction inside the turn: its model request hangs from its span
        and is counted as compaction's."""
        if not isinstance(self.span, TurnSpan):
            raise RuntimeError("compaction() belongs inside a turn")
        with self.span.compaction(automatic=True) as span:
            self._parent, self._kind = span, "compaction"
            try:
                yield span
            finally:
                self._parent, self._kind = self.span, "answer"

    def tool(self, call: ToolCall, *, server: str | None = None) -> ToolSpan:
        if isinstance(self.span, TurnSpan):
            return self.span.tool(call, server=server)
        return Tracer.off().turn(session_id=0, surface="").tool(call)

    def ended(self, text: str, *, outcome: str, error: BaseException | None = None) -> None:
        if isinstance(self.span, TurnSpan):
            self.span.record_output(text, outcome=outcome)
        self.span.end(error)

    @property
    def trace_url(self) -> str | None:
        return self.span.url if isinstance(self.span, TurnSpan) else None

    def trace(self) -> dict[str, Any]:
        """The answer's ``metadata.trace_id`` (32 hex digits) when its turn's trace was recorded:
        kept with the answer so a transcript read later links to the trace as the reply did
        (``TRACE_URL_TEMPLATE`` is applied when it is read). Empty when tracing is off."""
        trace_id = self.span.trace_id if isinstance(self.span, TurnSpan) else None
        return {} if trace_id is None else {TRACE_ID: trace_id}

    # -- usage and budgets ----------------------------------------------------------------------

    def usage(self) -> dict[str, Any]:
        """The answer's ``metadata.usage`` (empty when no request answered)."""
        total = MessageUsage.total(self.requests)
        return {} if total is None else {"usage": total.to_json()}

    def compaction_usage(self) -> dict[str, Any]:
        total = MessageUsage.total(self.compaction_requests)
        return {} if total is None else {"usage": total.to_json()}

    async def before_request(self) -> None:
        """Before a model request: the first was admitted (and reserved) by the claim; a later
        one takes the claim's step again, so it runs only while its expected cost fits in what
        the payer's budgets have left, or as the one request allowed past their end
        (``AgentSessionBudgetExceeded`` with ``during_turn``)."""
        if not self._made or self._reservation is None:
            return
        await self._accounting.ledger.extend(self._reservation)

    def provider(self, inner: ModelProvider, prices: PriceSource) -> ModelProvider:
        """``inner`` as this turn's requests go through it, priced from ``prices``."""
        return _AccountedProvider(inner, self, prices)

    async def _record(
        self,
        provider: str,
        model: str,
        usage: Usage,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        reply: AssistantMessage,
        source: PriceSource,
    ) -> RequestUsage:
        request = RequestUsage.priced(usage, provider=provider, model=model, source=source)
        metrics.count_cost(provider, model, request.cost_usd)
        if usage.input_tokens is None or usage.output_tokens is None:
            counted, counts_estimated = estimate_usage(messages, tools, reply).total_tokens, True
        else:
            counted, counts_estimated = usage.input_tokens + usage.output_tokens, False
        kind = self._kind
        (self.requests if kind == "answer" else self.compaction_requests).append(request)
        entry = LedgerEntry(
            request=request,
            kind=kind,
            counted_tokens=counted or 0,
            counts_estimated=counts_estimated,
            session_id=self.session_id,
            message_id=self.message_id if kind == "answer" else None,
            payer=self.attribution.payer,
            surface=self.attribution.surface,
        )
        await self._accounting.writer.write(entry)
        return request

    async def _charge_unfinished(
        self,
        provider: str,
        model: str,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        reply: AssistantMessage,
        source: PriceSource,
    ) -> RequestUsage:
        """A request that ended before its provider reported usage (a stop, a time-out, an
        error mid-stream, a lost lock, a shutdown): the provider bills what was sent, so it is
        charged as estimated (what it sent in, what streamed out). The write is its own task,
        shielded like every charge."""
        usage = estimate_usage(messages, tools, reply)
        return await self._charge(provider, model, usage, messages, tools, reply, source)

    async def _charge(
        self,
        provider: str,
        model: str,
        usage: Usage,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec],
        reply: AssistantMessage,
        source: PriceSource,
    ) -> RequestUsage:
        """``_record`` as a task of its own, shielded: a turn cancelled (a stop, a shutdown)
        while its request's row is written does not lose the row."""
        charging = asyncio.ensure_future(
            self._record(provider, model, usage, messages, tools, reply, source)
        )
        self._accounting._charging.add(charging)
        charging.add_done_callback(self._accounting._charging.discard)
        return await asyncio.shield(charging)


class _AccountedProvider:
    """The turn's provider as the loop sees it: every request spanned, priced and recorded."""

    def __init__(self, inner: ModelProvider, account: TurnAccount, prices: PriceSource) -> None:
        self.inner = inner
        self.name = inner.name
        self.default_model = inner.default_model
        self._account = account
        self._source = prices

    async def stream(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolSpec] = (),
        *,
        tool_choice: str | None = None,
        model: str | None = None,
    ) -> EventStream:
        account = self._account
        name = model or self.default_model
        account._made += 1
        text: list[str] = []
        calls: list[ToolCall] = []
        charged = False  # the provider's usage arrived (or the request was refused unbilled)
        with account._parent.llm(
            provider=self.name, model=name, messages=messages, tools=tools
        ) as span:
            source = self.inner.stream(messages, tools, tool_choice=tool_choice, model=model)
            try:
                async for event in source:
                    if isinstance(event, TextDelta):
                        text.append(event.text)
                    elif isinstance(event, ToolCall):
                        calls.append(event)
                    elif isinstance(event, Usage):
                        charged = True
                        reply = AssistantMessage("".join(text), tuple(calls))
                        request = await account._charge(
                            self.name, name, event, messages, tools, reply, self._source
                        )
                        span.record_usage(event, request.cost_usd)
                    yield event
            except UNBILLED:
                charged = charged or not (text or calls)  # refused before it answered
                raise
            finally:
                try:
                    await source.aclose()
                finally:
                    if not charged:
                        reply = AssistantMessage("".join(text), tuple(calls))
                        await account._charge_unfinished(
                            self.name, name, messages, tools, reply, self._source
                        )
            span.record_output(AssistantMessage("".join(text), tuple(calls)))

    async def aclose(self) -> None:
        await self.inner.aclose()


__all__ = [
    "Accounting",
    "AgentSessionBudgetExceeded",
    "Attribution",
    "Payer",
    "TurnAccount",
]

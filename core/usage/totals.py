"""What one assistant message's model requests used, added up: its ``metadata.usage``.

A message is written by one or more requests (one per tool round). Each request's ``Usage``
is priced on arrival (``RequestUsage``) and added to the message's ``MessageUsage``. How
partial knowledge adds up, field by field:

- a sum of counts is known only when every request's count is: ``known + unknown = unknown``
  (``None``), so a message never shows a total smaller than what it used;
- ``cost_usd`` likewise: one unpriced request makes the message's cost unknown;
- ``estimated`` is true when any request's counts were estimated (then the sums are partly
  estimates; an unknown count stays unknown, it is not replaced by an estimate here);
- ``requests`` always counts every request that answered, known or not;
- ``provider`` and ``model`` are the requests' own; in the (today impossible) case of requests
  of one message naming different ones, the field is ``None`` rather than one of them.

The exact accounts (per request, in SQL, what budgets read) keep every request apart; this is
what a person reads next to one message. ``to_json``/``from_json`` give the stored form:
counts as integers, ``cost_usd`` as a JSON number (a float: exact to far below a cent; the
ledger keeps exact decimals), ``null`` for unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from core.providers.base import Usage
from core.usage.prices import PriceSource, request_cost


@dataclass(frozen=True)
class RequestUsage:
    """One model request: who answered, what it used, what it cost (``None``: unknown)."""

    provider: str
    model: str
    usage: Usage
    cost_usd: Decimal | None

    @classmethod
    def priced(
        cls,
        usage: Usage,
        *,
        provider: str,
        model: str,
        source: PriceSource,
        at: datetime | None = None,
    ) -> RequestUsage:
        return cls(provider, model, usage, request_cost(usage, model=model, source=source, at=at))


def _add(left: int | None, right: int | None) -> int | None:
    return None if left is None or right is None else left + right


def _same(left: str | None, right: str | None) -> str | None:
    return left if left == right else None


@dataclass(frozen=True)
class MessageUsage:
    provider: str | None
    model: str | None
    requests: int
    input_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None
    cost_usd: Decimal | None
    estimated: bool

    @classmethod
    def of(cls, request: RequestUsage) -> MessageUsage:
        usage = request.usage
        return cls(
            provider=request.provider,
            model=request.model,
            requests=1,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_tokens=usage.cached_tokens,
            cost_usd=request.cost_usd,
            estimated=usage.estimated,
        )

    def add(self, request: RequestUsage) -> MessageUsage:
        other = MessageUsage.of(request)
        cost = None
        if self.cost_usd is not None and other.cost_usd is not None:
            cost = self.cost_usd + other.cost_usd
        return replace(
            self,
            provider=_same(self.provider, other.provider),
            model=_same(self.model, other.model),
            requests=self.requests + 1,
            input_tokens=_add(self.input_tokens, other.input_tokens),
            output_tokens=_add(self.output_tokens, other.output_tokens),
            cached_tokens=_add(self.cached_tokens, other.cached_tokens),
            cost_usd=cost,
            estimated=self.estimated or other.estimated,
        )

    @classmethod
    def total(cls, requests: list[RequestUsage]) -> MessageUsage | None:
        """The message's usage, or ``None`` for a message no request answered."""
        if not requests:
            return None
        result = cls.of(requests[0])
        for request in requests[1:]:
            result = result.add(request)
        return result

    def to_json(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "model": self.model,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "cost_usd": None if self.cost_usd is None else float(self.cost_usd),
            "estimated": self.estimated,
        }

    @classmethod
    def from_json(cls, value: Any) -> MessageUsage | None:
        """The stored form back; ``None`` for anything that is not one (an older message)."""
        if not isinstance(value, dict):
            return None

        def count(key: str) -> int | None:
            item = value.get(key)
            return item if isinstance(item, int) and not isinstance(item, bool) else None

        def text(key: str) -> str | None:
            item = value.get(key)
            return item if isinstance(item, str) else None

        cost = value.get("cost_usd")
        return cls(
            provider=text("provider"),
            model=text("model"),
            requests=count("requests") or 0,
            input_tokens=count("input_tokens"),
            output_tokens=count("output_tokens"),
            cached_tokens=count("cached_tokens"),
            cost_usd=(
                Decimal(str(cost))
                if isinstance(cost, int | float) and not isinstance(cost, bool)
                else None
            ),
            estimated=value.get("estimated") is True,
        )

"""What a model request cost in US dollars: from ``genai-prices``' table or a provider's own prices.

The rule is *never guessed*: a cost is a ``Decimal`` only when both the price and the counts it
multiplies are known, and ``None`` otherwise. Where the price comes from (``PriceSource``):

- ``table``: ``genai-prices`` recognises the provider from its API URL (``api.openai.com``,
  ``api.anthropic.com``, OpenRouter, Groq, ...) and the model by name. A URL it does not know
  (a local vLLM, an internal gateway) or a model it has no price for gives ``None``; an OpenAI
  -compatible server is not priced as OpenAI just because it speaks the same format.
- ``own``: a custom provider's stated per-million prices, which win over the table.
- ``free``: the offline stand-in, which costs nothing (its counts are estimates; its price is
  not).

Cached tokens: ``Usage.input_tokens`` includes them, as ``genai-prices`` expects its
``input_tokens`` to; they are priced at the model's cache-read price (cache writes at its
cache-write price) and the rest of the input at the input price. A provider that did not say
how much was cached (``cached_tokens is None``) is priced as if nothing was: the most the request
can have cost, never less. Prices that vary over time are taken at the request's time.

The table is ``genai-prices``' bundled snapshot (never fetched at run time, so an upgrade of
the package is how prices move). Importing and indexing it is slow (a large table), so it is
done lazily, and ``warm`` lets a server do it at start-up, off the first turn's path.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genai_prices.types import PriceCalculation

    # Annotations only: ``core.providers`` imports this module (a provider's own prices).
    from core.providers.base import Usage

log = logging.getLogger(__name__)

MILLION = Decimal(1_000_000)


@dataclass(frozen=True)
class OwnPrices:
    """A custom provider's own prices in US dollars per million tokens.

    ``cached_per_million`` is the price of prompt tokens read from the cache; ``None`` prices
    them as other input (a provider that states no discount gives none).
    """

    input_per_million: Decimal
    output_per_million: Decimal
    cached_per_million: Decimal | None = None

    def __post_init__(self) -> None:
        for name in ("input_per_million", "output_per_million", "cached_per_million"):
            value = getattr(self, name)
            if value is not None and (not value.is_finite() or value < 0):
                raise ValueError(f"{name}: {value} is not a price (a finite amount >= 0)")


@dataclass(frozen=True)
class PriceSource:
    """Where one provider's prices come from; build it with the class methods."""

    api_url: str | None = None
    own: OwnPrices | None = None
    free: bool = False

    @classmethod
    def table(cls, api_url: str) -> PriceSource:
        """Prices from ``genai-prices``, the provider recognised by its API (base) URL."""
        return cls(api_url=api_url)

    @classmethod
    def stated(cls, prices: OwnPrices) -> PriceSource:
        return cls(own=prices)

    @classmethod
    def no_cost(cls) -> PriceSource:
        return cls(free=True)

    @classmethod
    def unknown(cls) -> PriceSource:
        return cls()


def _counts(usage: Usage) -> tuple[int, int, int, int] | None:
    """(input, output, cache reads, cache writes), or ``None`` when a count that matters is
    unknown. Unknown cache counts are taken as none (the dearest reading)."""
    if usage.input_tokens is None or usage.output_tokens is None:
        return None
    read = usage.cached_tokens or 0
    written = usage.cache_write_tokens or 0
    if read + written > usage.input_tokens:
        log.warning("usage reports more cached than input tokens (%r); cost unknown", usage)
        return None
    return usage.input_tokens, usage.output_tokens, read, written


def _own_cost(prices: OwnPrices, counts: tuple[int, int, int, int]) -> Decimal:
    input_tokens, output_tokens, read, _written = counts
    cached_price = prices.input_per_million
    if prices.cached_per_million is not None:
        cached_price = prices.cached_per_million
    total = (
        (input_tokens - read) * prices.input_per_million
        + read * cached_price
        + output_tokens * prices.output_per_million
    )
    return total / MILLION


def _table(
    counts: tuple[int, int, int, int], model: str, api_url: str, at: datetime
) -> PriceCalculation | None:
    from genai_prices import Usage as PricedUsage
    from genai_prices import calc_price

    input_tokens, output_tokens, read, written = counts
    usage = PricedUsage(
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cache_read_tokens=read,
        cache_write_tokens=written,
    )
    try:
        return calc_price(usage, model, provider_api_url=api_url, genai_request_timestamp=at)
    except LookupError:  # provider or model not in the table: the price is unknown
        return None
    except ValueError as exc:  # counts the table's rules refuse (e.g. inconsistent parts)
        log.warning("genai-prices could not price %s at %s: %s", model, api_url, exc)
        return None


def request_cost(
    usage: Usage, *, model: str, source: PriceSource, at: datetime | None = None
) -> Decimal | None:
    """The US-dollar cost of one request, or ``None`` when it is not known (see the module)."""
    if source.free:
        return Decimal(0)
    counts = _counts(usage)
    if counts is None:
        return None
    if source.own is not None:
        return _own_cost(source.own, counts)
    if source.api_url is None:
        return None
    priced = _table(counts, model, source.api_url, at or datetime.now(UTC))
    return None if priced is None else priced.total_price


def warm() -> None:
    """Import and index the price table now (blocking, and slow): call it in a thread at
    start-up so the first priced request does not pay for it on the event loop."""
    from genai_prices import Usage as PricedUsage
    from genai_prices import calc_price

    with contextlib.suppress(LookupError):  # only the loading mattered
        calc_price(PricedUsage(input_tokens=1), "gpt-4o", provider_id="openai")

"""Request costs from genai-prices' table, a custom provider's own prices, or unknown.

Expected costs are computed here from the table's own per-million prices, so what is tested is
how our counts map onto it (cached tokens are part of the input, priced apart), not figures
that go stale when the package's prices move."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from genai_prices.data_snapshot import get_snapshot

from core.providers import Usage
from core.usage.prices import OwnPrices, PriceSource, request_cost, warm

OPENAI = PriceSource.table("https://api.openai.com/v1")
ANTHROPIC = PriceSource.table("https://api.anthropic.com")
MILLION = Decimal(1_000_000)


def table_prices(provider: str, model: str) -> dict[str, Decimal]:
    _, info = get_snapshot().find_provider_model(model, None, provider, None)
    price = info.get_prices(datetime.now(UTC))
    return {
        key: value
        for key in ("input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok")
        if isinstance(value := getattr(price, key), Decimal)
    }


def test_known_model__cached_input_is_priced_at_the_cache_read_price() -> None:
    prices = table_prices("openai", "gpt-4.1-mini")
    usage = Usage(input_tokens=2000, output_tokens=300, cached_tokens=1500)

    cost = request_cost(usage, model="gpt-4.1-mini", source=OPENAI)

    expected = (
        500 * prices["input_mtok"] + 1500 * prices["cache_read_mtok"] + 300 * prices["output_mtok"]
    ) / MILLION
    assert cost == expected
    assert cost < request_cost(Usage(2000, 300, 0), model="gpt-4.1-mini", source=OPENAI)


def test_known_model__anthropic_cache_writes_are_priced_at_the_cache_write_price() -> None:
    prices = table_prices("anthropic", "claude-haiku-4-5")
    usage = Usage(input_tokens=1000, output_tokens=50, cached_tokens=600, cache_write_tokens=300)

    cost = request_cost(usage, model="claude-haiku-4-5", source=ANTHROPIC)

    expected = (
        100 * prices["input_mtok"]
        + 600 * prices["cache_read_mtok"]
        + 300 * prices["cache_write_mtok"]
        + 50 * prices["output_mtok"]
    ) / MILLION
    assert cost == expected


def test_unreported_cached_count__priced_as_uncached_the_most_it_can_have_cost() -> None:
    unknown_cache = Usage(input_tokens=2000, output_tokens=300, cached_tokens=None)
    no_cache = Usage(input_tokens=2000, output_tokens=300, cached_tokens=0)

    assert request_cost(unknown_cache, model="gpt-4.1-mini", source=OPENAI) == request_cost(
        no_cache, model="gpt-4.1-mini", source=OPENAI
    )


@pytest.mark.parametrize(
    ("usage", "model", "source"),
    [
        (Usage(10, 5), "no-such-model-anywhere", OPENAI),  # a model the table does not know
        (Usage(10, 5), "gpt-4.1-mini", PriceSource.table("http://127.0.0.1:8000/v1")),  # vLLM
        (Usage(10, 5), "gpt-4.1-mini", PriceSource.unknown()),
        (Usage(None, 5), "gpt-4.1-mini", OPENAI),  # input not reported
        (Usage(10, None), "gpt-4.1-mini", OPENAI),  # output not reported
        (Usage(10, 5, cached_tokens=11), "gpt-4.1-mini", OPENAI),  # an inconsistent report
    ],
)
def test_unknown__price_or_counts_unknown_is_none_never_a_guess(
    usage: Usage, model: str, source: PriceSource
) -> None:
    assert request_cost(usage, model=model, source=source) is None


def test_custom_provider__its_own_prices_win_over_the_table() -> None:
    own = OwnPrices(Decimal("2"), Decimal("8"), cached_per_million=Decimal("0.5"))
    source = PriceSource.stated(own)
    usage = Usage(input_tokens=1_000_000, output_tokens=250_000, cached_tokens=400_000)

    assert (
        request_cost(usage, model="gpt-4.1-mini", source=source)
        == Decimal("0.6") * 2 + Decimal("0.4") * Decimal("0.5") + Decimal("0.25") * 8
    )


def test_custom_provider__no_cached_price_means_no_discount() -> None:
    source = PriceSource.stated(OwnPrices(Decimal("3"), Decimal("6")))

    cost = request_cost(Usage(1000, 1000, cached_tokens=900), model="local", source=source)

    assert cost == (1000 * Decimal(3) + 1000 * Decimal(6)) / MILLION


def test_custom_provider__counts_unknown_is_still_unknown() -> None:
    source = PriceSource.stated(OwnPrices(Decimal("3"), Decimal("6")))

    assert request_cost(Usage(1000, None), model="local", source=source) is None


def test_custom_provider__a_negative_price_is_refused() -> None:
    with pytest.raises(ValueError, match="input_per_million"):
        OwnPrices(Decimal("-1"), Decimal("6"))


def test_offline__costs_nothing_even_with_estimated_counts() -> None:
    usage = Usage(100, 10, 0, 0, estimated=True)

    assert request_cost(usage, model="offline-stand-in", source=PriceSource.no_cost()) == 0


def test_warm__loads_the_table_without_failing() -> None:
    warm()
    assert request_cost(Usage(1, 1, 0), model="gpt-4.1-mini", source=OPENAI) is not None

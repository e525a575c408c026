"""A replica's ``/metrics`` read as Prometheus would read it, for the tests and the benchmark.

prometheus_client's own parser does the reading, so a reader here sees exactly what a scraper
sees (escaped label values, ``_total`` and ``_bucket`` samples, comments) instead of what a
line-matching shortcut assumes; one place, so the tests and the benchmark read it alike.
"""

from __future__ import annotations

import contextlib
from typing import TypeAlias

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Labels: TypeAlias = tuple[tuple[str, str], ...]
Samples: TypeAlias = dict[tuple[str, Labels], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition: (sample name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(url: str, http: aiohttp.ClientSession | None = None) -> Samples:
    """``url``'s ``/metrics``, parsed; a non-200 answer is an error."""
    async with (
        aiohttp.ClientSession() if http is None else contextlib.nullcontext(http) as session,
        session.get(url + "/metrics") as response,
    ):
        response.raise_for_status()
        return parse(await response.text())


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` (0 when it is absent: a counter never
    incremented has no labelled sample yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def labels_of(samples: Samples, name: str) -> list[dict[str, str]]:
    """The label sets of every sample named ``name`` (an info metric's data is its labels)."""
    return [dict(labels) for (sample, labels) in samples if sample == name]

"""The ``custom_providers`` table: operators register OpenAI-compatible or Anthropic endpoints.

A row names the environment variable that holds its key (``api_key_env``), never the key, so the
database can be read by anyone who may read transcripts without leaking credentials.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Final, cast

from sqlalchemy import Table, delete, insert, select
from sqlalchemy.exc import IntegrityError

from core.errors import ConfigError
from core.storage.engine import Database
from core.storage.models import CustomProvider
from core.usage.prices import OwnPrices


@dataclass(frozen=True)
class CustomProviderSpec:
    """A ``custom_providers`` row as values. ``api_key_env`` names the variable, never the key."""

    name: str
    kind: str
    base_url: str
    api_key_env: str
    default_model: str | None = None
    prices: OwnPrices | None = None  # the provider's own prices (win over genai-prices' table)


PROVIDERS: Final = cast(Table, CustomProvider.__table__)


async def add_custom_provider(db: Database, spec: CustomProviderSpec) -> int:
    if spec.kind not in ("openai", "anthropic"):
        raise ConfigError(f"custom provider {spec.name!r}: kind must be openai or anthropic")
    prices = spec.prices
    statement = insert(PROVIDERS).values(
        name=spec.name,
        kind=spec.kind,
        base_url=spec.base_url,
        api_key_env=spec.api_key_env,
        default_model=spec.default_model,
        input_usd_per_million=None if prices is None else str(prices.input_per_million),
        output_usd_per_million=None if prices is None else str(prices.output_per_million),
        cached_usd_per_million=(
            None
            if prices is None or prices.cached_per_million is None
            else str(prices.cached_per_million)
        ),
    )
    async with db.write() as conn:
        try:
            inserted = (await conn.execute(statement)).inserted_primary_key
            assert inserted is not None
            return int(inserted[0])
        except IntegrityError as exc:
            raise ConfigError(f"custom provider {spec.name!r} already exists") from exc


async def get_custom_provider(db: Database, name: str) -> tuple[int, CustomProviderSpec] | None:
    async with db.read() as conn:
        row = (await conn.execute(select(PROVIDERS).where(PROVIDERS.c.name == name))).first()
    if row is None:
        return None
    prices = None
    if row.input_usd_per_million is not None and row.output_usd_per_million is not None:
        cached = row.cached_usd_per_million
        prices = OwnPrices(
            Decimal(row.input_usd_per_million),
            Decimal(row.output_usd_per_million),
            None if cached is None else Decimal(cached),
        )
    spec = CustomProviderSpec(
        row.name, row.kind, row.base_url, row.api_key_env, row.default_model, prices
    )
    return int(row.id), spec


async def delete_custom_provider(db: Database, name: str) -> bool:
    """Sessions that used it keep their stamp; their FK becomes null (ON DELETE SET NULL)."""
    async with db.write() as conn:
        result = await conn.execute(delete(PROVIDERS).where(PROVIDERS.c.name == name))
    return result.rowcount > 0


class CustomProviders:
    """The ``custom_providers`` rows bound to one database (what model choice reads)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def add(self, spec: CustomProviderSpec) -> int:
        return await add_custom_provider(self._db, spec)

    async def get(self, name: str) -> tuple[int, CustomProviderSpec] | None:
        return await get_custom_provider(self._db, name)

    async def delete(self, name: str) -> bool:
        return await delete_custom_provider(self._db, name)

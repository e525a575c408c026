"""Budgets in force: ``BUDGETS`` from the environment, changed at run time (``budget set`` /
``budget clear``) and stored in ``system_settings``, like retention, so every replica applies
the same limits on its next turn without a restart.

The stored value maps a limit's identity (``scope:period:unit``) to its amount as text, or to
``null`` for a limit of the environment cleared at run time. ``budget clear`` without a key
forgets every run-time change, putting the environment's ``BUDGETS`` back in force.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any, Final, cast

from sqlalchemy import Table, delete, select, update

from core.errors import ConfigError
from core.storage.dialect import db_now
from core.storage.engine import Database
from core.storage.models import SystemSetting
from core.storage.prepared import Prepared
from core.usage.budgets import PERIODS, SCOPES, Budget, parse_budgets

BUDGETS_KEY: Final = "budgets"
SETTINGS: Final = cast(Table, SystemSetting.__table__)
UNITS: Final = ("tokens", "usd")
# Read before every claim that may have a budget (``Accounting.in_force``): one prepared
# statement, on SQLite in place on the process's reader, on PostgreSQL one round trip.
_STORED: Final = Prepared(select(SETTINGS.c.value).where(SETTINGS.c.key == BUDGETS_KEY))


def identity(budget: Budget) -> str:
    return f"{budget.scope}:{budget.period}:{budget.unit}"


def parse_identity(value: str) -> tuple[str, ...]:
    """The identities ``scope:period[:unit]`` names (both units when none is given), or
    ``ConfigError`` saying why it names none."""
    parts = [part.strip().lower() for part in value.strip().split(":")]
    if len(parts) not in (2, 3) or parts[0] not in SCOPES or parts[1] not in PERIODS:
        raise ConfigError(f"{value!r} is not SCOPE:PERIOD[:UNIT] (e.g. user:day or all:month:usd)")
    if len(parts) == 3 and parts[2] not in UNITS:
        raise ConfigError(f"{value!r}: unit {parts[2]!r} is not tokens or usd")
    units = (parts[2],) if len(parts) == 3 else UNITS
    return tuple(f"{parts[0]}:{parts[1]}:{unit}" for unit in units)


class Budgets:
    """The budgets in force: the environment's, with the run-time changes applied."""

    def __init__(self, db: Database, defaults: Sequence[Budget]) -> None:
        self._db = db
        self.defaults = tuple(defaults)

    async def _stored(self) -> dict[str, Any]:
        rows = await _STORED.fetch(self._db, {})
        value = rows[0][0] if rows else None
        return dict(value) if isinstance(value, dict) else {}

    async def in_force(self) -> tuple[Budget, ...]:
        return self._apply(await self._stored())

    async def sources(self) -> list[tuple[Budget, str]]:
        """Each budget in force and where it comes from (``environment`` or ``run time``)."""
        stored = await self._stored()
        return [
            (budget, "run time" if identity(budget) in stored else "environment")
            for budget in self._apply(stored)
        ]

    def _apply(self, stored: dict[str, Any]) -> tuple[Budget, ...]:
        if not stored:  # no change at run time (read before every claim): nothing to merge
            return self.defaults
        found = {identity(budget): budget for budget in self.defaults}
        for key, amount in stored.items():
            if amount is None:
                found.pop(key, None)
                continue
            scope, period, unit = key.split(":")
            found[key] = Budget(scope, period, unit, Decimal(str(amount)))  # type: ignore[arg-type]
        return tuple(found.values())

    async def set(self, value: str) -> tuple[Budget, ...]:
        """Add or replace the limits ``value`` gives (``BUDGETS`` syntax). A malformed entry
        raises ``ConfigError`` and nothing changes."""
        given = parse_budgets(value)
        if not given:
            raise ConfigError("no budget given (e.g. user:day:200000tokens)")
        return await self._change({identity(budget): str(budget.amount) for budget in given})

    async def clear(self, value: str | None = None) -> tuple[Budget, ...]:
        """Remove the limits ``scope:period[:unit]`` names (one of the environment's too), or
        with no value forget every run-time change."""
        if value is None:
            async with self._db.write() as conn:
                await conn.execute(delete(SETTINGS).where(SETTINGS.c.key == BUDGETS_KEY))
            return self.defaults
        return await self._change(dict.fromkeys(parse_identity(value)))

    async def _change(self, changes: dict[str, str | None]) -> tuple[Budget, ...]:
        """``changes`` merged into the stored value in one write transaction that holds the
        row: two operators' changes made at once both land (a read before the write
        transaction let the second write put back what the first had replaced)."""
        async with self._db.write() as conn:
            # The row exists before it is locked, so a first change has a row to hold too.
            create = self._db.upsert(SETTINGS).values(key=BUDGETS_KEY, value={})
            await conn.execute(create.on_conflict_do_nothing(index_elements=["key"]))
            held = select(SETTINGS.c.value).where(SETTINGS.c.key == BUDGETS_KEY).with_for_update()
            value = await conn.scalar(held)
            stored = dict(value) if isinstance(value, dict) else {}
            stored.update(changes)
            await conn.execute(
                update(SETTINGS)
                .where(SETTINGS.c.key == BUDGETS_KEY)
                .values(value=stored, updated_at=db_now())
            )
        return self._apply(stored)

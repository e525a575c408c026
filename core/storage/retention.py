"""Retention policy: environment defaults, overridden by values set at run time.

Run-time values live in ``system_settings`` under one key, so every replica's sweeper reads the
same policy on its next pass without a restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, cast

from sqlalchemy import Table, select

from core.settings import Settings
from core.storage.dialect import db_now
from core.storage.engine import Database
from core.storage.models import SystemSetting

RETENTION_KEY = "agent_session_retention"
SETTINGS = cast(Table, SystemSetting.__table__)


@dataclass(frozen=True)
class RetentionPolicy:
    max_idle_days: float
    max_per_user: int

    @classmethod
    def from_settings(cls, settings: Settings) -> RetentionPolicy:
        return cls(settings.agent_session_max_idle_days, settings.agent_session_max_per_user)


async def _stored(db: Database) -> dict[str, Any]:
    async with db.read() as conn:
        value = await conn.scalar(select(SETTINGS.c.value).where(SETTINGS.c.key == RETENTION_KEY))
    return dict(value) if isinstance(value, dict) else {}


async def load_policy(db: Database, defaults: RetentionPolicy) -> RetentionPolicy:
    stored = await _stored(db)
    return RetentionPolicy(
        max_idle_days=float(stored.get("max_idle_days", defaults.max_idle_days)),
        max_per_user=int(stored.get("max_per_user", defaults.max_per_user)),
    )


async def set_policy(
    db: Database,
    defaults: RetentionPolicy,
    *,
    max_idle_days: float | None = None,
    max_per_user: int | None = None,
) -> RetentionPolicy:
    """Store the given values (others keep their current value); ``0`` turns a rule off."""
    if max_idle_days is not None and max_idle_days < 0:
        raise ValueError("max idle days must be 0 (off) or more")
    if max_per_user is not None and max_per_user < 0:
        raise ValueError("max per user must be 0 (off) or more")
    current = await load_policy(db, defaults)
    policy = RetentionPolicy(
        max_idle_days=current.max_idle_days if max_idle_days is None else float(max_idle_days),
        max_per_user=current.max_per_user if max_per_user is None else int(max_per_user),
    )
    async with db.write() as conn:
        stmt = db.upsert(SETTINGS).values(key=RETENTION_KEY, value=asdict(policy))
        await conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["key"], set_={"value": stmt.excluded.value, "updated_at": db_now()}
            )
        )
    return policy


class Retention:
    """The retention policy in force: the environment's defaults, overridden at run time."""

    def __init__(self, db: Database, defaults: RetentionPolicy) -> None:
        self._db = db
        self.defaults = defaults

    async def policy(self) -> RetentionPolicy:
        return await load_policy(self._db, self.defaults)

    async def set(
        self, *, max_idle_days: float | None = None, max_per_user: int | None = None
    ) -> RetentionPolicy:
        return await set_policy(
            self._db, self.defaults, max_idle_days=max_idle_days, max_per_user=max_per_user
        )

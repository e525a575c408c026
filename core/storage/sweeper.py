"""The sweeper: retention deletes, safe to run on every replica at once.

Each pass selects a batch of candidate ids, then deletes them with a statement that re-checks the
pass's whole condition row by row, including "no turn is active". A row that changed between the
two statements (touched, claimed, deleted by another sweeper) is simply skipped, so parallel
sweepers neither fail nor delete twice, and an active session is never deleted.

Passes, in order: expired temporary sessions; idle persisted sessions; the per-user cap over
persisted sessions (most recent kept, by ``updated_at DESC, id DESC``); snapshot content no
snapshot refers to. Surfaces add their own passes (``extra_passes``) for their own tables.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from sqlalchemy import ColumnElement, Table, and_, func, or_, select
from sqlalchemy.orm import aliased

from core import metrics
from core.storage import snapshots
from core.storage.batched import BatchHook, delete_in_batches, delete_listed_in_batches
from core.storage.dialect import ago
from core.storage.engine import Database
from core.storage.models import AgentSession
from core.storage.queries import claimable
from core.storage.retention import RetentionPolicy

SESSIONS = cast(Table, AgentSession.__table__)

# Content younger than this is never collected: a turn may be between storing the content and
# storing the snapshot row that refers to it (writers refresh content they reuse, see there).
CONTENT_GRACE_SECONDS = snapshots.CONTENT_GRACE_SECONDS

ExtraPass = Callable[[Database, int], Awaitable[int]]


@dataclass
class SweepReport:
    expired: int = 0
    idle: int = 0
    over_cap: int = 0
    snapshot_contents: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def sessions(self) -> int:
        return self.expired + self.idle + self.over_cap


def _over_cap(cap: int) -> ColumnElement[bool]:
    """At least ``cap`` persisted sessions of the same user are more recent than this one."""
    newer = aliased(SESSIONS)
    more_recent = (
        select(func.count())
        .select_from(newer)
        .where(
            newer.c.user_id == SESSIONS.c.user_id,
            newer.c.expires_at.is_(None),
            or_(
                newer.c.updated_at > SESSIONS.c.updated_at,
                and_(newer.c.updated_at == SESSIONS.c.updated_at, newer.c.id > SESSIONS.c.id),
            ),
        )
        .scalar_subquery()
    )
    return and_(
        SESSIONS.c.user_id.is_not(None), SESSIONS.c.expires_at.is_(None), more_recent >= cap
    )


async def sweep(
    db: Database,
    policy: RetentionPolicy,
    *,
    staleness_seconds: float,
    batch_size: int = 100,
    extra_passes: Sequence[tuple[str, ExtraPass]] = (),
    on_batch: BatchHook | None = None,
) -> SweepReport:
    """One pass of every rule. ``on_batch`` is called between select and delete (for tests)."""
    report = SweepReport()
    inactive = claimable(staleness_seconds)

    async def sessions_where(condition: ColumnElement[bool], name: str) -> int:
        return await delete_in_batches(
            db,
            SESSIONS,
            select(SESSIONS.c.id).where(condition).order_by(SESSIONS.c.id),
            condition,
            batch_size,
            name=name,
            on_batch=on_batch,
        )

    expired = and_(SESSIONS.c.expires_at.is_not(None), SESSIONS.c.expires_at < ago(0), inactive)
    report.expired = await sessions_where(expired, "expired")

    if policy.max_idle_days > 0:
        idle = and_(
            SESSIONS.c.expires_at.is_(None),
            SESSIONS.c.updated_at < ago(policy.max_idle_days * 86400),
            inactive,
        )
        report.idle = await sessions_where(idle, "idle")

    if policy.max_per_user > 0:
        cap = policy.max_per_user
        ranked = (
            select(
                SESSIONS.c.id,
                func.row_number()
                .over(
                    partition_by=SESSIONS.c.user_id,
                    order_by=(SESSIONS.c.updated_at.desc(), SESSIONS.c.id.desc()),
                )
                .label("rank"),
            )
            .where(SESSIONS.c.user_id.is_not(None), SESSIONS.c.expires_at.is_(None))
            .subquery()
        )
        candidates = (
            select(ranked.c.id)
            .join(SESSIONS, SESSIONS.c.id == ranked.c.id)
            .where(ranked.c.rank > cap, inactive)
            .order_by(ranked.c.id)
        )
        # Ranked once per pass (one scan), not once per batch.
        async with db.read(large=True) as conn:
            over = list((await conn.execute(candidates)).scalars())
        report.over_cap = await delete_listed_in_batches(
            db,
            SESSIONS,
            over,
            and_(_over_cap(cap), inactive),
            batch_size,
            name="over_cap",
            on_batch=on_batch,
        )

    report.snapshot_contents = await collect_snapshot_contents(db, batch_size)

    for name, extra in extra_passes:
        report.extra[name] = await extra(db, batch_size)
    for rule, deleted in (
        ("expired", report.expired),
        ("idle", report.idle),
        ("over_cap", report.over_cap),
        ("snapshot_contents", report.snapshot_contents),
        *report.extra.items(),
    ):
        metrics.SWEEPER_DELETED.labels(rule).inc(deleted)
    return report


async def collect_snapshot_contents(db: Database, batch_size: int) -> int:
    """Delete snapshot content no snapshot refers to (older than the grace period).

    The statements live with the other snapshot SQL (``core.storage.snapshots.collect_garbage``):
    unreferenced sets first, then content no set contains and no delta needs as its base.
    """
    return await snapshots.collect_garbage(db, batch_size, grace_seconds=CONTENT_GRACE_SECONDS)

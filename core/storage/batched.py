"""Deleting in batches that re-check their condition row by row: how every sweep pass deletes.

Select a batch of candidate ids, then delete them with a statement that repeats the whole
condition. A row that changed in between (touched, claimed, referenced again, or deleted by
another sweeper) is skipped, so sweepers on several replicas neither fail nor delete twice.

On SQLite a sweeper yields the write lock between batches for as long as it held it: there is
one writer at a time, and a lock that polls (``Database.write``) is not fair, so a sweeper
going straight from one batch to the next kept every acknowledgement (each writes its delivery
record) waiting for hundreds of milliseconds. PostgreSQL's writers lock rows, not the
database, so batches follow each other there.

A pass is linear in the table: each batch's candidates start after the last id the previous
batch saw (keyset pagination on the primary key), so no batch re-reads what an earlier one
already passed over; a row skipped in this pass is met again in the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import ColumnElement, Select, Table, delete
from sqlalchemy.exc import IntegrityError

from core.errors import DatabaseError
from core.storage.engine import Database

log = logging.getLogger(__name__)

BatchHook = Callable[[str, list[Any]], Awaitable[None]]


async def delete_in_batches(
    db: Database,
    table: Table,
    candidates: Select[Any],
    condition: ColumnElement[bool],
    batch_size: int,
    *,
    name: str,
    on_batch: BatchHook | None = None,
) -> int:
    """Delete ``table`` rows whose ids ``candidates`` selects and that still meet ``condition``.

    ``candidates`` selects ``table``'s ids in ascending order (it may join other tables).
    ``on_batch`` runs between the select and the delete (tests use it to change a row there).
    An integrity error (a row became referenced in between) leaves the batch for the next pass.
    """
    deleted = 0
    after: Any = None
    while True:
        batch = candidates if after is None else candidates.where(table.c.id > after)
        async with db.read(large=True) as conn:
            ids = list((await conn.execute(batch.limit(batch_size))).scalars())
        if not ids:
            return deleted
        after = max(ids)
        if on_batch is not None:
            await on_batch(name, ids)
        removed = await _delete(db, table, ids, condition, name)
        if removed is None:
            return deleted
        deleted += removed
        if len(ids) < batch_size or removed == 0:
            # A short batch is the last one; an empty delete means another sweeper is working
            # through the same rows, and it (or our next run) will finish them.
            return deleted


async def delete_listed_in_batches(
    db: Database,
    table: Table,
    ids: list[Any],
    condition: ColumnElement[bool],
    batch_size: int,
    *,
    name: str,
    on_batch: BatchHook | None = None,
) -> int:
    """``delete_in_batches`` for candidates chosen once for the whole pass (a ranking that
    would cost a scan of the table to repeat per batch); each delete still re-checks
    ``condition`` row by row."""
    deleted = 0
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        if on_batch is not None:
            await on_batch(name, batch)
        removed = await _delete(db, table, batch, condition, name)
        if removed is None:
            break
        deleted += removed
    return deleted


async def _delete(
    db: Database, table: Table, ids: list[Any], condition: ColumnElement[bool], name: str
) -> int | None:
    """Delete these rows where ``condition`` still holds; None if a row became referenced."""
    try:
        async with db.write(large=True) as conn:
            held_since = time.monotonic()
            result = await conn.execute(delete(table).where(table.c.id.in_(ids), condition))
        if db.dialect == "sqlite":
            await asyncio.sleep(time.monotonic() - held_since)
    except DatabaseError as exc:
        if isinstance(exc.__cause__, IntegrityError):
            log.info("%s: a row became referenced during the pass; batch skipped", name)
            return None
        raise
    return int(result.rowcount)

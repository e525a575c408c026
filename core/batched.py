"""Deleting in batches that re-check their condition row by row: how every sweep pass deletes.

Select a batch of candidate ids, then delete them with a statement that repeats the whole
condition. A row that changed in between (touched, claimed, referenced again, or deleted by
another sweeper) is skipped, so sweepers on several replicas neither fail nor delete twice.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import ColumnElement, Select, Table, delete
from sqlalchemy.exc import IntegrityError

from core.db import Database
from core.errors import DatabaseError

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

    ``on_batch`` runs between the select and the delete (tests use it to change a row there).
    An integrity error (a row became referenced in between) leaves the batch for the next pass.
    """
    deleted = 0
    while True:
        async with db.read() as conn:
            ids = list((await conn.execute(candidates.limit(batch_size))).scalars())
        if not ids:
            return deleted
        if on_batch is not None:
            await on_batch(name, ids)
        try:
            async with db.write() as conn:
                result = await conn.execute(delete(table).where(table.c.id.in_(ids), condition))
        except DatabaseError as exc:
            if isinstance(exc.__cause__, IntegrityError):
                log.info("%s: a row became referenced during the pass; batch skipped", name)
                return deleted
            raise
        deleted += result.rowcount
        if len(ids) < batch_size or result.rowcount == 0:
            # A short batch is the last one; an empty delete means another sweeper is working
            # through the same rows, and it (or our next run) will finish them.
            return deleted

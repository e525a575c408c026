"""Keys to the HTTP API, kept as hashes only: programs' tokens and browsers' sign-ins.

A token (``slack-agent token create``) and a sign-in cookie are random secrets handed out once;
the database keeps their SHA-256, so reading it (a backup, a replica's logs) opens nothing.
Both act as one person (a ``users`` row) and stop working at their expiry, on the database's
clock so every replica agrees; a token also when revoked, a sign-in when its person signs out.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Final, cast

from sqlalchemy import Table, delete, insert, or_, select, update

from core.storage.batched import delete_in_batches
from core.storage.dialect import db_now, hence
from core.storage.engine import Database
from core.storage.models import ApiToken, User, WebSession

TOKENS: Final = cast(Table, ApiToken.__table__)
SIGN_INS: Final = cast(Table, WebSession.__table__)
USERS: Final = cast(Table, User.__table__)
TOKEN_PREFIX: Final = "sat_"  # says what a leaked string is, for secret scanners and people


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class TokenInfo:
    id: int
    person: str  # the owner's external id (``slack:T…:U…``)
    name: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


@dataclass(frozen=True)
class Bearer:
    """Who a valid key acts as."""

    user_id: int
    person: str
    display_name: str | None


class WebAccess:
    """Tokens and sign-ins on one database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    # -- tokens ---------------------------------------------------------------------------------

    async def create_token(
        self, user_id: int, *, name: str | None, expires_days: float | None
    ) -> tuple[int, str]:
        """A new token for ``user_id``: its id and the secret, which is never readable again."""
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        values: dict[str, object] = {"token_hash": digest(secret), "user_id": user_id, "name": name}
        if expires_days is not None:
            values["expires_at"] = hence(expires_days * 86400)
        async with self._db.write() as conn:
            created = await conn.execute(insert(TOKENS).values(**values).returning(TOKENS.c.id))
            token_id = int(created.scalar_one())
        return token_id, secret

    async def tokens(self) -> list[TokenInfo]:
        async with self._db.read() as conn:
            rows = await conn.execute(
                select(TOKENS, USERS.c.external_id)
                .join(USERS, USERS.c.id == TOKENS.c.user_id)
                .order_by(TOKENS.c.id)
            )
            return [
                TokenInfo(
                    int(r.id), str(r.external_id), r.name, r.created_at, r.expires_at, r.revoked_at
                )
                for r in rows
            ]

    async def revoke_token(self, token_id: int) -> bool:
        """False when there is no such token or it was revoked already."""
        async with self._db.write() as conn:
            done = await conn.execute(
                update(TOKENS)
                .where(TOKENS.c.id == token_id, TOKENS.c.revoked_at.is_(None))
                .values(revoked_at=db_now())
            )
            return bool(done.rowcount)

    async def bearer_of_token(self, secret: str) -> Bearer | None:
        """The person a token acts as; None when it is unknown, revoked or expired."""
        return await self._bearer(
            TOKENS,
            TOKENS.c.token_hash == digest(secret),
            TOKENS.c.revoked_at.is_(None),
            or_(TOKENS.c.expires_at.is_(None), TOKENS.c.expires_at > db_now()),
        )

    # -- browsers' sign-ins ---------------------------------------------------------------------

    async def sign_in(self, user_id: int, *, lifetime_seconds: float) -> str:
        """A new sign-in for ``user_id``: the cookie's value (the secret). The person's expired
        sign-ins go at the same time, so the table holds live ones and a few stale at most."""
        secret = secrets.token_urlsafe(32)
        async with self._db.write() as conn:
            await conn.execute(
                delete(SIGN_INS).where(
                    SIGN_INS.c.user_id == user_id, SIGN_INS.c.expires_at <= db_now()
                )
            )
            await conn.execute(
                insert(SIGN_INS).values(
                    cookie_hash=digest(secret),
                    user_id=user_id,
                    expires_at=hence(lifetime_seconds),
                )
            )
        return secret

    async def bearer_of_cookie(self, secret: str) -> Bearer | None:
        """The person a sign-in cookie acts as; None when unknown, signed out or expired."""
        return await self._bearer(
            SIGN_INS, SIGN_INS.c.cookie_hash == digest(secret), SIGN_INS.c.expires_at > db_now()
        )

    async def sign_out(self, secret: str) -> None:
        async with self._db.write() as conn:
            await conn.execute(delete(SIGN_INS).where(SIGN_INS.c.cookie_hash == digest(secret)))

    async def _bearer(self, table: Table, *where: object) -> Bearer | None:
        async with self._db.read() as conn:
            row = (
                await conn.execute(
                    select(USERS.c.id, USERS.c.external_id, USERS.c.display_name)
                    .join(table, table.c.user_id == USERS.c.id)
                    .where(*where)  # type: ignore[arg-type]
                )
            ).first()
        if row is None:
            return None
        return Bearer(int(row.id), str(row.external_id), row.display_name)


async def sweep_sign_ins(db: Database, batch_size: int) -> int:
    """Sweeper pass: sign-ins past their expiry (they open nothing; the table keeps live ones)."""
    expired = SIGN_INS.c.expires_at <= db_now()
    return await delete_in_batches(
        db,
        SIGN_INS,
        select(SIGN_INS.c.id).where(expired).order_by(SIGN_INS.c.id),
        expired,
        batch_size,
        name="sign_ins",
    )

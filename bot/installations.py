"""Storage for multi-workspace installs: slack_sdk's SQLAlchemy stores in our database.

The stores take a SQLAlchemy async engine, so the engine is made here (the one module besides
``core.storage.engine`` that creates engines), keeping the surface free of SQLAlchemy. Their tables
(``slack_bots``, ``slack_installations``, ``slack_oauth_states``) belong to slack_sdk and are
created by it on start-up (``CREATE TABLE IF NOT EXISTS``), outside our Alembic history, so a
slack_sdk upgrade that changes them needs no migration of ours.
"""

from __future__ import annotations

from dataclasses import dataclass

from slack_sdk.oauth.installation_store.sqlalchemy import AsyncSQLAlchemyInstallationStore
from slack_sdk.oauth.state_store.sqlalchemy import AsyncSQLAlchemyOAuthStateStore
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from core.settings import normalize_database_url

STATE_EXPIRATION_SECONDS = 600


@dataclass
class InstallStores:
    engine: AsyncEngine
    installations: AsyncSQLAlchemyInstallationStore
    states: AsyncSQLAlchemyOAuthStateStore

    async def dispose(self) -> None:
        await self.engine.dispose()


async def open_install_stores(database_url: str, client_id: str) -> InstallStores:
    engine = create_async_engine(normalize_database_url(database_url))
    installations = AsyncSQLAlchemyInstallationStore(client_id=client_id, engine=engine)
    states = AsyncSQLAlchemyOAuthStateStore(
        expiration_seconds=STATE_EXPIRATION_SECONDS, engine=engine
    )
    await installations.create_tables()  # type: ignore[no-untyped-call]
    await states.create_tables()  # type: ignore[no-untyped-call]
    return InstallStores(engine, installations, states)

"""Storage for multi-workspace installs: slack_sdk's SQLAlchemy stores in our database.

The stores take a SQLAlchemy async engine, which the storage layer makes
(``core.storage.engine.library_engine``), so the surface itself never touches SQLAlchemy. Their
tables (``slack_bots``, ``slack_installations``, ``slack_oauth_states``) belong to slack_sdk and are
created by it on start-up (``CREATE TABLE IF NOT EXISTS``), outside our Alembic history, so a
slack_sdk upgrade that changes them needs no migration of ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slack_sdk.oauth.installation_store.sqlalchemy import AsyncSQLAlchemyInstallationStore
from slack_sdk.oauth.state_store.sqlalchemy import AsyncSQLAlchemyOAuthStateStore

from core.storage.engine import library_engine

STATE_EXPIRATION_SECONDS = 600


@dataclass
class InstallStores:
    engine: Any  # an AsyncEngine, handed to slack_sdk
    installations: AsyncSQLAlchemyInstallationStore
    states: AsyncSQLAlchemyOAuthStateStore

    async def dispose(self) -> None:
        await self.engine.dispose()


async def open_install_stores(database_url: str, client_id: str) -> InstallStores:
    engine = library_engine(database_url)
    installations = AsyncSQLAlchemyInstallationStore(client_id=client_id, engine=engine)
    states = AsyncSQLAlchemyOAuthStateStore(
        expiration_seconds=STATE_EXPIRATION_SECONDS, engine=engine
    )
    await installations.create_tables()  # type: ignore[no-untyped-call]
    await states.create_tables()  # type: ignore[no-untyped-call]
    return InstallStores(engine, installations, states)

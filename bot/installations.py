"""Storage for multi-workspace installs: slack_sdk's SQLAlchemy stores in our database.

The stores take a SQLAlchemy async engine, which the storage layer makes
(``Storage.library_engine``), so the surface itself never touches SQLAlchemy. Their tables
(``slack_bots``, ``slack_installations``, ``slack_oauth_states``) belong to slack_sdk and are
created from its table definitions on start-up, outside our Alembic history (a slack_sdk upgrade
that changes them needs no migration of ours), but under the same lock as our migrations
(``Storage.create_library_tables``): replicas starting together would race on ``CREATE TABLE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slack_sdk.oauth.installation_store.sqlalchemy import AsyncSQLAlchemyInstallationStore
from slack_sdk.oauth.state_store.sqlalchemy import AsyncSQLAlchemyOAuthStateStore

from core.runtime import Storage

STATE_EXPIRATION_SECONDS = 600


@dataclass
class InstallStores:
    engine: Any  # an AsyncEngine, handed to slack_sdk
    installations: AsyncSQLAlchemyInstallationStore
    states: AsyncSQLAlchemyOAuthStateStore

    async def dispose(self) -> None:
        await self.engine.dispose()


async def open_install_stores(storage: Storage, client_id: str) -> InstallStores:
    engine = storage.library_engine()
    installations = AsyncSQLAlchemyInstallationStore(client_id=client_id, engine=engine)
    states = AsyncSQLAlchemyOAuthStateStore(
        expiration_seconds=STATE_EXPIRATION_SECONDS, engine=engine
    )
    try:
        await storage.create_library_tables(installations.metadata, states.metadata)
    except BaseException:
        await engine.dispose()
        raise
    return InstallStores(engine, installations, states)

"""The product's runtime, built from settings in one place: what every entry point runs on.

``serve``, the terminal client, the operator's commands and the benchmark all need the same
things made the same way (the database and its stores, the model providers, the agent), so
they are made here and nowhere else; a surface then asks for its ``Conversations`` and, if it
receives messages durably, its delivery records.

Usage, budgets and traces are wired here too (``Accounting``): the ledger and the budgets in
force from the storage, the tracer from the ``OTEL_*``/``TRACE_*`` settings (off, and no
OpenTelemetry SDK imported, without an endpoint).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from core.agent.accounting import Accounting
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.conversation import Conversations
from core.settings import Settings
from core.storage import Deliveries, Storage
from core.tracing.spans import Tracer


@dataclass
class Runtime:
    settings: Settings
    storage: Storage
    providers: ProviderCache
    agent: Agent
    tracer: Tracer = field(default_factory=Tracer.off)

    @classmethod
    async def open(
        cls, settings: Settings, *, migrate: bool = True, pool_size: int = 10
    ) -> Runtime:
        """Everything, with the database brought to the newest schema first (``migrate``;
        the operator's commands that only read or set values skip it), and the model
        configuration checked (``ProviderCache.check``): a turn could not run without it."""
        storage = Storage.open(settings, pool_size=pool_size)
        try:
            if migrate:
                await storage.migrate()
            runtime = cls.on(settings, storage)
            await runtime.providers.check(storage.sessions.custom_providers)
        except BaseException:
            await storage.dispose()
            raise
        return runtime

    @classmethod
    def on(cls, settings: Settings, storage: Storage) -> Runtime:
        """The runtime on storage that is already open."""
        providers = ProviderCache(settings)
        tracer = Tracer.from_settings(settings)
        agent = Agent(
            storage.sessions,
            providers,
            AgentConfig(
                auto_compact_tokens=settings.auto_compact_tokens,
                heartbeat_seconds=settings.turn_heartbeat_seconds,
            ),
            accounting=Accounting(storage.usage, storage.budgets, tracer),
        )
        return cls(settings, storage, providers, agent, tracer)

    def conversations(self, project: str, *, surface: str | None = None) -> Conversations:
        """A surface's conversations: ``project`` names its sessions (``project_name``);
        ``surface`` its own tables, when it keeps threads and references there."""
        return Conversations(
            self.storage.sessions,
            self.agent,
            self.storage.feedback,
            project=project,
            state=None if surface is None else self.storage.surface(surface),
        )

    def deliveries(self, surface: str) -> Deliveries:
        """This process's hold on the surface's delivery records (§6.10)."""
        return self.storage.deliveries(surface)

    async def close(self) -> None:
        if self.tracer.enabled:  # flushes what is queued, within a bounded time, off the loop
            await asyncio.to_thread(self.tracer.shutdown)
        await self.providers.aclose()
        await self.storage.dispose()

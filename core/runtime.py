"""The product's runtime, built from settings in one place: what every entry point runs on.

``serve``, the terminal client, the operator's commands and the benchmark all need the same
things made the same way (the database and its stores, the model providers, the agent), so
they are made here and nowhere else; a surface then asks for its ``Conversations`` and, if it
receives messages durably, its delivery records.

Usage, budgets and traces are wired here too (``Accounting``): the ledger and the budgets in
force from the storage, the tracer from the ``OTEL_*``/``TRACE_*`` settings (off, and no
OpenTelemetry SDK imported, without an endpoint).

The MCP servers of ``MCP_CONFIG`` are read here too (a malformed file stops start-up with one
line) and started in the background by ``open``, which waits up to ``MCP_STARTUP_WAIT_SECONDS``
for their first answers: a server that does not start (or not that quickly) is a log line and its
tools are absent until it answers; start-up goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from core import metrics
from core.agent.accounting import Accounting
from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.conversation import Conversations
from core.operator import Operator, operator_external_id
from core.settings import Settings
from core.storage import Deliveries, Storage
from core.storage.tokens import Bearer
from core.sweeping import SweeperThread
from core.tools import McpTools, load_mcp_config, with_known_secrets
from core.tracing.spans import Tracer
from core.usage import prices

# How long ``open`` waits for the MCP servers' first answers before going on without them.
MCP_STARTUP_WAIT_SECONDS = 10.0


@dataclass
class Runtime:
    settings: Settings
    storage: Storage
    providers: ProviderCache
    agent: Agent
    tools: McpTools | None = None  # None: no MCP servers configured
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
            if _prices_from_the_table(settings):
                await _warm_prices()
        except BaseException:
            await storage.dispose()
            raise
        if runtime.tools is not None:
            await runtime.tools.start()  # returns at once; servers connect in the background
            # The first messages after a start should find the tools of servers that start
            # promptly; a server that takes longer (or is down) joins when it answers.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(MCP_STARTUP_WAIT_SECONDS):
                    await runtime.tools.wait_ready()
        return runtime

    @classmethod
    def on(cls, settings: Settings, storage: Storage) -> Runtime:
        """The runtime on storage that is already open (its MCP servers not started yet:
        ``open`` starts them)."""
        config = with_known_secrets(load_mcp_config(settings.mcp_config), settings.secret_values())
        tools = McpTools(config) if config.servers else None
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
            tools=tools,
            approvals=storage.approvals,
        )
        return cls(settings, storage, providers, agent, tools, tracer)

    def conversations(self, project: str, *, surface: str | None = None) -> Conversations:
        """A surface's conversations: ``project`` names its sessions (``project_name``);
        ``surface`` its own tables, when it keeps threads and references there."""
        return Conversations(
            self.storage.sessions,
            self.agent,
            self.storage.feedback,
            project=project,
            state=None if surface is None else self.storage.surface(surface),
            approvals=self.storage.approvals,
        )

    def deliveries(self, surface: str) -> Deliveries:
        """This process's hold on the surface's delivery records (§6.10)."""
        return self.storage.deliveries(surface)

    async def close(self) -> None:
        if self.tools is not None:
            await self.tools.aclose()
        if self.tracer.enabled:  # flushes what is queued, within a bounded time, off the loop
            await asyncio.to_thread(self.tracer.shutdown)
        await self.providers.aclose()
        await self.agent.accounting.close()  # ledger rows still being written or retried
        await self.storage.dispose()


async def _warm_prices() -> None:
    """Load genai-prices' table before ``open`` returns, not inside the first turn, and not
    while anything runs beside it either. The loading is about a second of CPU, and much of
    it is single calls that hold the GIL throughout: compiling its 1.6 MB data module alone
    held it for 0.4-0.6 s where no bytecode is cached (``PYTHONDONTWRITEBYTECODE``, a
    read-only install), over a second on a loaded machine. A thread of the same process does
    not keep the event loop running through such a call: loaded in the background after
    start-up, it stopped a replica that was already acknowledging messages and holding
    leases, long enough to cross a short staleness window (a turn stopping itself, its
    delivery taken over). At start-up nothing is held yet. Still a thread, so the loop's own
    callbacks run between the loading's Python steps."""
    with contextlib.suppress(Exception):  # only a head start: a failure shows at first use
        await asyncio.to_thread(prices.warm)


def _prices_from_the_table(settings: Settings) -> bool:
    """Whether turns may be priced from genai-prices' table: a builtin provider is named or
    has its key (the offline model costs nothing; a custom provider stating its prices never
    reads the table, one that does not is found at its first request)."""
    named = settings.model_provider in ("openai", "anthropic")
    return named or bool(settings.openai_api_key or settings.anthropic_api_key)


# What a surface takes from the core besides the conversation API (``core.conversation``) and the
# errors: the settings, the process's storage and delivery records, the sweeper it runs, the
# metrics it serves, and the local operator's name.
__all__ = [
    "Bearer",
    "Deliveries",
    "Operator",
    "Runtime",
    "Settings",
    "Storage",
    "SweeperThread",
    "metrics",
    "operator_external_id",
]

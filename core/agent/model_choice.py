"""Which model a turn uses, decided before the claim and stamped inside it.

MODEL_PROVIDER names a builtin provider, ``auto``, or a row of ``custom_providers``. A session
that was stamped with a custom provider whose row has since been deleted falls back to the
builtin provider on its next turn and says so once: the fallback is stamped, so the session no
longer names a deleted provider and the notice is not repeated.

Providers are built once per process and reused (``ProviderCache``): each one owns an HTTP
client and its connection pool, and is wrapped so its requests are counted (``core.metrics``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from core.agent.registry import (
    build_builtin,
    build_custom,
    custom_provider_name,
    resolve_builtin,
)
from core.errors import ConfigError
from core.metrics import ObservedProvider
from core.providers.base import ModelProvider
from core.providers.streaming import DEFAULT_TIMEOUT, HttpOptions
from core.records import ModelChoice, SessionInfo
from core.settings import Settings
from core.storage.custom_providers import CustomProviders, CustomProviderSpec
from core.usage.prices import PriceSource


@dataclass(frozen=True)
class ResolvedModel:
    choice: ModelChoice
    provider: ModelProvider
    notice: str | None = None
    prices: PriceSource = field(default_factory=PriceSource.unknown)


def builtin_prices(settings: Settings, name: str) -> PriceSource:
    """Where a builtin provider's prices come from: genai-prices' table, which recognises
    the provider by its API URL (a local or compatible server it does not know: unknown); the
    offline stand-in costs nothing."""
    if name == "openai":
        return PriceSource.table(settings.openai_base_url)
    if name == "anthropic":
        return PriceSource.table(settings.anthropic_base_url)
    return PriceSource.no_cost()


def custom_prices(spec: CustomProviderSpec) -> PriceSource:
    """A custom provider's own prices when it states them, else the table by its URL."""
    return PriceSource.stated(spec.prices) if spec.prices else PriceSource.table(spec.base_url)


@dataclass
class ProviderCache:
    settings: Settings
    http: HttpOptions | None = None
    _built: dict[tuple[str, str | None], ModelProvider] = field(default_factory=dict)

    def _http(self) -> HttpOptions:
        if self.http is not None:
            return self.http
        timeout = dataclasses.replace(DEFAULT_TIMEOUT, read=self.settings.model_timeout_seconds)
        # One streaming call per running turn, and a summariser's call beside some of them.
        return HttpOptions(timeout=timeout, max_connections=2 * self.settings.max_concurrent_turns)

    def builtin(self) -> ModelProvider:
        name = resolve_builtin(self.settings)
        key = (f"builtin:{name}", self.settings.model_name)
        if key not in self._built:
            self._built[key] = ObservedProvider(
                build_builtin(self.settings, name=name, http=self._http())
            )
        return self._built[key]

    def custom(self, spec: CustomProviderSpec) -> ModelProvider:
        key = (f"custom:{spec.name}:{spec.base_url}:{spec.api_key_env}", self.settings.model_name)
        if key not in self._built:
            self._built[key] = ObservedProvider(
                build_custom(spec, model=self.settings.model_name, http=self._http())
            )
        return self._built[key]

    async def check(self, custom: CustomProviders) -> None:
        """Refuse, with one line naming the variable, a model configuration no turn could use:
        a builtin provider without its key, a custom provider that is not registered (a typo
        in MODEL_PROVIDER) or whose key variable is unset. Called at start-up, so a bad value
        stops ``serve`` at once instead of every message ending in "gave up" minutes later.
        Building the provider is all the check needs: the providers built are the ones turns
        then reuse."""
        self.builtin()
        name = custom_provider_name(self.settings)
        if name is None:
            return
        found = await custom.get(name)
        if found is None:
            raise ConfigError(
                f"MODEL_PROVIDER: {name!r} is neither auto, openai, anthropic, offline nor a "
                "custom provider registered in the custom_providers table"
            )
        self.custom(found[1])

    async def aclose(self) -> None:
        for provider in self._built.values():
            await provider.aclose()
        self._built.clear()


async def resolve_model(
    custom: CustomProviders, cache: ProviderCache, session: SessionInfo
) -> ResolvedModel:
    """The model for the session's next turn, and what to tell the user about it, once.

    A notice is given only when the session's model changes because of a fallback: once stamped
    with the builtin provider, the session no longer names the missing one.
    """
    settings = cache.settings
    builtin = resolve_builtin(settings)
    name = custom_provider_name(settings)
    notice = None
    if session.custom_provider_deleted:
        notice = (
            f"The custom model provider {session.model_provider!r} this conversation used was "
            f"removed; continuing with the builtin {builtin!r} provider."
        )
    elif name:
        found = await custom.get(name)
        if found is not None:
            provider_id, spec = found
            provider = cache.custom(spec)
            return ResolvedModel(
                ModelChoice(spec.name, provider.default_model, provider_id, builtin),
                provider,
                prices=custom_prices(spec),
            )
        if session.model_provider != builtin:
            notice = (
                f"The configured model provider {name!r} is not registered; "
                f"using the builtin {builtin!r} provider."
            )
    provider = cache.builtin()
    choice = ModelChoice(builtin, provider.default_model, None, builtin)
    return ResolvedModel(choice, provider, notice, builtin_prices(settings, builtin))

"""Which provider a turn uses, and building it from settings or a custom-provider description.

Here, above the providers, because it reads the settings: the providers themselves know
nothing of configuration (they take keys and addresses as values), which keeps them below
``core.settings`` and ``core.usage``.

``MODEL_PROVIDER`` is ``auto``, a builtin name, or the name of a row in ``custom_providers``.
Looking that row up is the store's job, so this module takes its values as a plain
``CustomProviderSpec``; the caller decides between ``build_custom`` and ``build_builtin`` (also
the fallback when a session's custom provider was deleted).

Build a provider once and reuse it, or share one ``aiohttp.ClientSession`` through ``HttpOptions``:
a provider that makes its own client pays for a TLS context and a fresh connection pool.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from core.errors import ConfigError
from core.providers import anthropic, openai
from core.providers.anthropic import AnthropicProvider
from core.providers.base import ModelProvider
from core.providers.offline import OfflineProvider
from core.providers.openai import OpenAIProvider
from core.providers.streaming import HttpOptions
from core.settings import Settings
from core.storage.custom_providers import CustomProviderSpec

BuiltinName = Literal["openai", "anthropic", "offline"]
_BUILTINS: tuple[BuiltinName, ...] = ("openai", "anthropic", "offline")


def resolve_builtin(settings: Settings) -> BuiltinName:
    """The builtin provider: MODEL_PROVIDER if it names one, else the ``auto`` rule.

    For a custom MODEL_PROVIDER this is its fallback, what ``builtin_provider`` records.
    """
    chosen = settings.model_provider.strip().lower()
    for name in _BUILTINS:
        if chosen == name:
            return name
    if settings.openai_api_key:
        return "openai"
    if settings.anthropic_api_key:
        return "anthropic"
    return "offline"


def custom_provider_name(settings: Settings) -> str | None:
    """The custom provider MODEL_PROVIDER names, or ``None`` when it is ``auto`` or a builtin."""
    chosen = settings.model_provider.strip()
    if chosen.lower() == "auto" or chosen.lower() in _BUILTINS:
        return None
    return chosen


def build_builtin(
    settings: Settings, *, name: BuiltinName | None = None, http: HttpOptions | None = None
) -> ModelProvider:
    """The builtin provider ``name`` (default: ``resolve_builtin``), keyed from settings."""
    name = name or resolve_builtin(settings)
    if name == "offline":
        return OfflineProvider()
    if name == "openai":
        if not settings.openai_api_key:
            raise ConfigError("OPENAI_API_KEY: required when the model provider is openai")
        return OpenAIProvider(
            api_key=settings.openai_api_key,
            base_url=settings.openai_base_url,
            default_model=settings.model_name or openai.DEFAULT_MODEL,
            http=http,
        )
    if not settings.anthropic_api_key:
        raise ConfigError("ANTHROPIC_API_KEY: required when the model provider is anthropic")
    return AnthropicProvider(
        api_key=settings.anthropic_api_key,
        base_url=settings.anthropic_base_url,
        default_model=settings.model_name or anthropic.DEFAULT_MODEL,
        http=http,
    )


def build_custom(
    spec: CustomProviderSpec,
    *,
    model: str | None = None,
    environ: Mapping[str, str] | None = None,
    http: HttpOptions | None = None,
) -> ModelProvider:
    """A provider for a custom endpoint, its key read now from the variable the row names.

    ``model`` (MODEL_NAME) wins over the row's ``default_model``, which wins over the kind's
    default. The key is read at build time, not stored, so rotating it needs no database write.
    ``base_url`` is what the kind's own variable would hold: ``.../v1`` for openai, the bare
    host for anthropic.
    """
    if spec.kind not in ("openai", "anthropic"):
        raise ConfigError(
            f"custom provider {spec.name!r}: kind {spec.kind!r} is not openai or anthropic"
        )
    environ = os.environ if environ is None else environ
    api_key = environ.get(spec.api_key_env)
    if not api_key:
        raise ConfigError(
            f"{spec.api_key_env}: not set; custom provider {spec.name!r} reads its API key from it"
        )
    if spec.kind == "openai":
        return OpenAIProvider(
            api_key=api_key,
            base_url=spec.base_url,
            default_model=model or spec.default_model or openai.DEFAULT_MODEL,
            name=spec.name,
            http=http,
        )
    return AnthropicProvider(
        api_key=api_key,
        base_url=spec.base_url,
        default_model=model or spec.default_model or anthropic.DEFAULT_MODEL,
        name=spec.name,
        http=http,
    )

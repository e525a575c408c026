"""MODEL_PROVIDER resolution and building builtin and custom providers."""

from __future__ import annotations

import pytest

from core.agent.registry import build_builtin, build_custom, custom_provider_name, resolve_builtin
from core.errors import ConfigError
from core.providers import AnthropicProvider, OfflineProvider, OpenAIProvider, UserMessage
from core.providers.anthropic import DEFAULT_MODEL as ANTHROPIC_DEFAULT
from core.settings import load_settings
from core.storage.custom_providers import CustomProviderSpec
from standins import anthropic, openai
from tests.providers_fixtures import collect, text_of


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, "offline"),
        ({"OPENAI_API_KEY": "sk-o"}, "openai"),
        ({"ANTHROPIC_API_KEY": "sk-a"}, "anthropic"),
        ({"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a"}, "openai"),
        (
            {"MODEL_PROVIDER": "anthropic", "ANTHROPIC_API_KEY": "sk-a", "OPENAI_API_KEY": "x"},
            "anthropic",
        ),
        ({"MODEL_PROVIDER": "offline", "OPENAI_API_KEY": "sk-o"}, "offline"),
        ({"MODEL_PROVIDER": "OpenAI", "OPENAI_API_KEY": "sk-o"}, "openai"),
        # A custom provider's fallback is what auto would choose.
        ({"MODEL_PROVIDER": "my-vllm", "ANTHROPIC_API_KEY": "sk-a"}, "anthropic"),
    ],
)
def test_resolve_builtin__follows_spec_auto_rule(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], expected: str
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)

    assert resolve_builtin(load_settings()) == expected


def test_build_builtin__auto_without_keys_is_the_offline_stand_in() -> None:
    provider = build_builtin(load_settings())

    assert isinstance(provider, OfflineProvider)
    assert provider.name == "offline"


@pytest.mark.parametrize(
    ("provider", "variable"), [("openai", "OPENAI_API_KEY"), ("anthropic", "ANTHROPIC_API_KEY")]
)
def test_build_builtin__chosen_provider_without_its_key_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, provider: str, variable: str
) -> None:
    monkeypatch.setenv("MODEL_PROVIDER", provider)

    with pytest.raises(ConfigError, match=f"^{variable}: required"):
        build_builtin(load_settings())


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", None), ("openai", None), ("OFFLINE", None), ("my-vllm", "my-vllm")],
)
def test_custom_provider_name__only_for_names_that_are_not_builtin(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: str | None
) -> None:
    monkeypatch.setenv("MODEL_PROVIDER", value)

    assert custom_provider_name(load_settings()) == expected


async def test_build_builtin__openai_uses_base_url_key_and_model_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with openai.OpenAIStandIn() as server:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("MODEL_NAME", "gpt-local")
        server.push(openai.text_reply("hi"))
        provider = build_builtin(load_settings())
        try:
            events = await collect(provider, [UserMessage("hello")])
        finally:
            await provider.aclose()

    assert isinstance(provider, OpenAIProvider)
    assert text_of(events) == "hi"
    (request,) = server.requests
    assert request.headers["authorization"] == "Bearer sk-from-env"
    assert request.body["model"] == "gpt-local"


async def test_build_custom__reads_the_key_from_the_named_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with anthropic.AnthropicStandIn() as server:
        monkeypatch.setenv("TEAM_CLAUDE_KEY", "sk-ant-team")
        spec = CustomProviderSpec(
            name="team-claude",
            kind="anthropic",
            base_url=server.base_url,
            api_key_env="TEAM_CLAUDE_KEY",
            default_model="claude-team",
        )
        server.push(anthropic.text_reply("hi"))
        provider = build_custom(spec)
        try:
            events = await collect(provider, [UserMessage("hello")])
        finally:
            await provider.aclose()

    assert isinstance(provider, AnthropicProvider)
    assert provider.name == "team-claude"
    assert text_of(events) == "hi"
    (request,) = server.requests
    assert request.headers["x-api-key"] == "sk-ant-team"
    assert request.body["model"] == "claude-team"


async def test_build_custom__model_name_wins_then_row_default_then_kind_default() -> None:
    environ = {"K": "secret"}
    spec = CustomProviderSpec("c", "anthropic", "http://127.0.0.1:9", "K", "row-model")
    bare = CustomProviderSpec("c", "anthropic", "http://127.0.0.1:9", "K")
    providers = [
        build_custom(spec, model="chosen", environ=environ),
        build_custom(spec, environ=environ),
        build_custom(bare, environ=environ),
    ]
    for provider in providers:
        await provider.aclose()

    assert [p.default_model for p in providers] == ["chosen", "row-model", ANTHROPIC_DEFAULT]


def test_build_custom__missing_key_variable_is_named_and_the_build_refused() -> None:
    spec = CustomProviderSpec("team-gpt", "openai", "http://127.0.0.1:9/v1", "TEAM_GPT_KEY")

    with pytest.raises(ConfigError, match=r"^TEAM_GPT_KEY: not set; custom provider 'team-gpt'"):
        build_custom(spec, environ={})


def test_build_custom__unknown_kind_is_refused() -> None:
    spec = CustomProviderSpec("odd", "gemini", "http://127.0.0.1:9", "K")

    with pytest.raises(ConfigError, match="kind 'gemini' is not openai or anthropic"):
        build_custom(spec, environ={"K": "secret"})

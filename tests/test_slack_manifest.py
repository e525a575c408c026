"""``manifest.yml`` declares what the app uses, and the OAuth scopes agree with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from bot.service import BOT_SCOPES
from tests.helpers import ROOT

MANIFEST = (ROOT / "manifest.yml").read_text()
SCHEMAS = Path(__file__).parent / "data" / "slack-manifest-schema"


def _list_after(key: str) -> list[str]:
    """The ``- item`` lines of the YAML list under ``key:`` (no YAML library needed)."""
    block = MANIFEST.split(f"{key}:", 1)[1]
    items: list[str] = []
    for line in block.splitlines()[1:]:
        match = re.match(r"\s+- (\S+)$", line)
        if match is None:
            if line.strip().startswith("#"):
                continue
            break
        items.append(match[1])
    return items


def test_manifest__shortcuts_command_events_and_socket_mode() -> None:
    for callback_id in ("rewind_session", "fork_session", "compact_session"):
        assert f"callback_id: {callback_id}" in MANIFEST
    assert "command: /compact" in MANIFEST
    assert "socket_mode_enabled: true" in MANIFEST
    assert "is_enabled: true" in MANIFEST  # interactivity
    events = _list_after("bot_events")
    assert {"app_mention", "message.channels", "message.im"} <= set(events)
    assert "/slack/events" in MANIFEST  # the HTTP-mode URLs are documented


def test_manifest__bot_scopes_match_what_oauth_installs_ask_for() -> None:
    assert sorted(_list_after("bot")) == sorted(BOT_SCOPES)


def test_manifest__valid_against_slacks_published_schema() -> None:
    """A manifest without ``_metadata.major_version`` is read as version 1 (Slack's rule)."""
    manifest = yaml.safe_load(MANIFEST)
    version = manifest.get("_metadata", {}).get("major_version", 1)
    schema = json.loads((SCHEMAS / f"manifest.schema.{version}.0.0.json").read_text())
    jsonschema.validate(manifest, schema)


def test_manifest__declares_an_agent_with_the_events_its_sessions_need() -> None:
    manifest = yaml.safe_load(MANIFEST)
    agent = manifest["features"]["agent_view"]
    assert agent["agent_description"]
    assert 1 <= len(agent["suggested_prompts"]) <= 4
    assert "assistant_view" not in manifest["features"]  # Slack is retiring it
    events = set(manifest["settings"]["event_subscriptions"]["bot_events"])
    assert {
        "agent_session_stopped",
        "agent_session_title_changed",
        "app_uninstalled",
        "tokens_revoked",
    } <= events


def test_manifest__a_broken_manifest_is_refused_by_the_schema() -> None:
    """The schema check can fail: a manifest with an unknown feature does not pass it."""
    manifest = yaml.safe_load(MANIFEST)
    manifest["features"]["not_a_feature"] = {}
    schema = json.loads((SCHEMAS / "manifest.schema.1.0.0.json").read_text())
    with pytest.raises(jsonschema.ValidationError, match="not_a_feature"):
        jsonschema.validate(manifest, schema)

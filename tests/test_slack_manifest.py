"""``manifest.yml`` declares what the app uses (SPEC §10), and the OAuth scopes agree with it."""

from __future__ import annotations

import re

from bot.serve import BOT_SCOPES
from tests.helpers import ROOT

MANIFEST = (ROOT / "manifest.yml").read_text()


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

"""The lower bounds pyproject.toml states are the versions that have what the code calls.

Each entry was found by reading the library's release history (its tags and the commit that
added the API); a bound below it would let an install resolve a version on which the app
fails at run time (an ``AttributeError`` deep inside a turn) instead of at install time.
"""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.helpers import ROOT

# package -> (the oldest version with everything used, what needs it)
NEEDED = {
    # AsyncWebClient.agents_sessions_setStatus first shipped in 3.44.0 (absent from 3.43.0);
    # chat_startStream/appendStream/stopStream in 3.37.0, TaskUpdateChunk in 3.40.0.
    "slack-sdk": ((3, 44), "agents_sessions_setStatus (bot/answers.py)"),
    # The per-request client Bolt builds copies the app client's retry handlers from 1.20.1.
    "slack-bolt": ((1, 20, 1), "retry handlers on the request path (bot/slack_api.py)"),
    # ``NoDecode`` (comma-separated list settings) was added in pydantic-settings 2.7.0.
    "pydantic-settings": ((2, 7), "NoDecode (core/settings.py)"),
    # ``patch_stdout(raw=True)`` exists since prompt_toolkit 3.0.0.
    "prompt-toolkit": ((3, 0), "patch_stdout(raw=True) (terminal/lines.py)"),
}


def lower_bounds() -> dict[str, tuple[int, ...]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found: dict[str, tuple[int, ...]] = {}
    for requirement in project["dependencies"]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9.]+)", requirement)
        assert match is not None, f"{requirement!r} states no lower bound"
        found[match[1].lower()] = tuple(int(p) for p in match[2].split("."))
    return found


@pytest.mark.parametrize("package", sorted(NEEDED))
def test_lower_bound__admits_no_version_without_what_the_code_calls(package: str) -> None:
    needed, why = NEEDED[package]
    stated = lower_bounds()[package]
    assert stated >= needed, f"{package}>={'.'.join(map(str, stated))} lacks {why}"

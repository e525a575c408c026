"""docs/design.md's *Adding a surface* shows a complete surface; this runs that very block.

The block is read from the document (between its marker and the end of the fence), written to
a file and run as a program on a migrated database with the offline model: two lines sent, two
answers printed, both into one session, and the whole surface under 150 lines. A change to the
conversation door that the document does not follow fails here.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.storage.engine import create_database
from core.storage.sessions import SessionStore
from standins.processes import child_environment
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # a real process

MARKER = "<!-- the minimal surface: run by tests/test_design_surface.py -->"


def _surface() -> str:
    text = (ROOT / "docs" / "design.md").read_text()
    found = re.search(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, re.S)
    assert found is not None, "docs/design.md lost its minimal surface"
    return found.group(1)


def test_design_surface__is_short() -> None:
    assert len(_surface().splitlines()) < 150


async def test_design_surface__answers_through_the_door(database_url: str, tmp_path: Path) -> None:
    program = tmp_path / "surface.py"
    program.write_text(_surface() + "\n")
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(program), "hello there", "and again"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_environment(
            DATABASE_URL=database_url,
            MODEL_PROVIDER="offline",
            MCP_CONFIG="",
            SWEEPER_INTERVAL_SECONDS="0",
            PYTHONPATH=str(ROOT),
        ),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    sessions = re.findall(r"^\[session (\d+)\]$", result.stdout, re.M)
    assert len(sessions) == 2, result.stdout
    assert sessions[0] == sessions[1], result.stdout
    db = create_database(database_url)
    try:
        messages = await SessionStore(db).messages(int(sessions[0]))
    finally:
        await db.dispose()
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert "hello there" in str(messages[0].message)

"""The committed page (``web/static``) is what its sources build: a copy of ``web/ui`` is
installed from its lock file (``npm ci``) and built (``npm run build``: ``tsc --noEmit``, then
Vite) in a temporary folder, and every file must match the committed bundle byte for byte. So the
bundle shipped in the package can always be rebuilt from what sits beside it, and a source changed
without rebuilding (or a bundle edited by hand) fails here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UI = ROOT / "web" / "ui"
STATIC = ROOT / "web" / "static"


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.slow
def test_the_committed_bundle_is_what_the_sources_build(tmp_path: Path) -> None:
    for tool in ("node", "npm"):
        assert shutil.which(tool), f"the page's build needs {tool} (apt-get install nodejs npm)"
    copy = tmp_path / "ui"
    shutil.copytree(UI, copy, ignore=shutil.ignore_patterns("node_modules"))
    _run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], copy)
    _run(["npm", "run", "build"], copy)
    built, committed = _files(tmp_path / "static"), _files(STATIC)
    assert sorted(built) == sorted(committed), "rebuild web/static: cd web/ui && npm run build"
    for name, content in built.items():
        assert content == committed[name], f"web/static/{name} differs from what web/ui builds"


def test_the_bundle_loads_nothing_from_outside() -> None:
    """No fonts, scripts or styles from another origin: the page works with no internet."""
    index = (STATIC / "index.html").read_text()
    assert "/assets/" in index
    for name, content in _files(STATIC).items():
        text = content.decode(errors="replace")
        for outside in ("https://fonts.", "cdn.", "@import url(http", 'src="http', 'href="http'):
            assert outside not in text, f"web/static/{name} reaches outside: {outside}"

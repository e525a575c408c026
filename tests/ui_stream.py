"""The AI SDK's own parser over a chat answer, for tests: a chunk the ``ai`` package rejects fails.

The Node packages are pinned in ``tests/node/package-lock.json`` (``ai`` 6 as ``ai`` and 7 as
``ai7``) and installed on demand with ``npm ci`` into ``tests/node/node_modules`` the first time a
test asks, once per lock file: a stamp holds the lock's hash, and a file lock keeps parallel test
workers from installing twice. So ``.ci/run`` needs nothing by hand but Node itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "parse_ui_stream.mjs"
STAMP = NODE_DIR / "node_modules" / ".slack-agent-lock-sha256"


class RejectedStream(AssertionError):
    """The ``ai`` package refused the stream (or it held no message); the text says why."""


def _lock_hash() -> str:
    return hashlib.sha256((NODE_DIR / "package-lock.json").read_bytes()).hexdigest()


def ensure_node_packages() -> None:
    """``npm ci`` unless the installed packages match the lock file already."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("the UI stream check needs Node.js and npm (apt-get install nodejs npm)")
    wanted = _lock_hash()
    with open(NODE_DIR / ".install.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if STAMP.exists() and STAMP.read_text() == wanted:
            return
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE_DIR,
            check=True,
            capture_output=True,
            timeout=600,
        )
        STAMP.write_text(wanted)


def parse_ui_stream(body: bytes, *, ai_major: int = 6) -> dict[str, Any]:
    """The final UIMessage the ``ai`` package (major ``ai_major``) builds from an SSE ``body``.

    Raises ``RejectedStream`` with the package's words when it rejects a chunk, when the body holds
    no message, or when it does not end with ``data: [DONE]``.
    """
    ensure_node_packages()
    done = subprocess.run(
        ["node", str(SCRIPT), "--ai", str(ai_major)],
        input=body,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RejectedStream(done.stderr.decode(errors="replace").strip())
    message: dict[str, Any] = json.loads(done.stdout)
    return message

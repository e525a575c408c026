"""Running the product and the stand-ins as processes of their own, as the tests, the demo and
the benchmark do: a free port, an environment without the developer's settings, a stand-in
started and its URL read, a ``serve`` waited for until its health check answers.

Nothing here imports aiohttp at module level: the MCP notes server uses ``free_port`` and starts
as a process itself, often.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from asyncio.subprocess import PIPE, Process
from collections.abc import Callable

HOST = "127.0.0.1"
# The settings a developer's shell may carry that a child process of the product must not see.
PRODUCT_SETTINGS = ("SLACK_", "OPENAI_", "ANTHROPIC_", "MODEL_", "DATABASE_URL")


def free_port() -> int:
    """A port nothing listens on now (for a server that is to come up later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def child_environment(**values: str) -> dict[str, str]:
    """This process's environment without the developer's product settings, then ``values``:
    a ``serve`` or ``chat`` child sees exactly what its caller configured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PRODUCT_SETTINGS)}
    env.update(values)
    return env


async def until_healthy(
    url: str, exited: Callable[[], bool], *, within: float, every: float = 0.05
) -> str | None:
    """Poll ``{url}/healthz`` until it answers 200 (None), the process ``exited()``
    (``"exited"``) or ``within`` seconds pass (``"timed out"``)."""
    import aiohttp  # here: an MCP server started with this module's helpers never pays for it

    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if exited():
                return "exited"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(url + "/healthz") as response:
                    if response.status == 200:
                        return None
            await asyncio.sleep(every)
    return "timed out"


async def spawn(module: str, *args: str, within: float = 30.0) -> tuple[Process, str]:
    """``python -m module args`` (a stand-in run by ``run_forever``), and its URL once it
    listens."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", module, *args, stdout=PIPE)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), within)
    if not line:
        raise RuntimeError(f"the stand-in {module} did not start")
    return proc, line.decode().strip()

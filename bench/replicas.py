"""``slack-agent serve`` replicas as child processes on 127.0.0.1 ports, for the soak.

Each replica is a real process with its own event loop and database engine, killed with
SIGKILL or stopped with SIGTERM like a deploy would; a killed one can be started again on the
same port, as a supervisor would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from asyncio.subprocess import Process
from pathlib import Path

import aiohttp


def free_port() -> int:
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Replica:
    def __init__(
        self, name: str, env: dict[str, str], log: Path, *, probe: Path | None = None
    ) -> None:
        self.name = name
        # ``bench.probe`` records this folder's loop, one file per start (``--profile``).
        self.probe = probe
        self.starts = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "HOST": "127.0.0.1", "PORT": str(self.port)}
        self.log = log
        self.proc: Process | None = None

    async def start(self) -> None:
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLACK_", "OPENAI_", "ANTHROPIC_", "MODEL_", "DATABASE_URL"))
        }
        self.starts += 1
        command = ["-m", "bot", "serve"]
        if self.probe is not None:
            command = ["-m", "bench.probe", str(self.probe / f"{self.name}.{self.starts}.json")]
        with self.log.open("a") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *command,
                env={**clean, **self.env},
                stdout=out,
                stderr=out,
            )

    async def ready(self, within: float = 180.0) -> None:
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.returncode is not None:
                    raise RuntimeError(f"{self.name} exited at start; see {self.log}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(self.url + "/healthz") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become healthy; see {self.log}")

    async def owner(self) -> str:
        """The id this replica's delivery records carry (``slack_agent_replica_info``)."""
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as response:
            for line in (await response.text()).splitlines():
                if line.startswith("slack_agent_replica_info{"):
                    return line.split('owner="', 1)[1].split('"', 1)[0]
        raise RuntimeError(f"{self.name} reports no owner id")

    async def healthy(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(self.url + "/healthz") as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def signal(self, number: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(number)

    async def stop(self, within: float = 60.0) -> int | None:
        """SIGTERM and wait (SIGKILL past ``within``); the exit status."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), within)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()

"""``slack-agent serve`` replicas as child processes on 127.0.0.1 ports, for the soak.

Each replica is a real process with its own event loop and database engine, killed with
SIGKILL or stopped with SIGTERM like a deploy would; a killed one can be started again on the
same port, as a supervisor would.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from asyncio.subprocess import Process
from pathlib import Path

import aiohttp

from standins import metrics
from standins.processes import child_environment, free_port, until_healthy


class Replica:
    def __init__(
        self, name: str, env: dict[str, str], log: Path, *, probe: Path | None = None
    ) -> None:
        self.name = name
        # ``bench.soak.probe`` records this folder's loop, one file per start (``--profile``).
        self.probe = probe
        self.starts = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "HOST": "127.0.0.1", "PORT": str(self.port)}
        self.log = log
        self.proc: Process | None = None

    async def start(self) -> None:
        self.starts += 1
        command = ["-m", "bot", "serve"]
        if self.probe is not None:
            command = [
                "-m",
                "bench.soak.probe",
                str(self.probe / f"{self.name}.{self.starts}.json"),
            ]
        with self.log.open("a") as out:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                *command,
                env=child_environment(**self.env),
                stdout=out,
                stderr=out,
            )

    async def ready(self, within: float = 180.0) -> None:
        def exited() -> bool:
            return self.proc is not None and self.proc.returncode is not None

        failed = await until_healthy(self.url, exited, within=within, every=0.1)
        if failed == "exited":
            raise RuntimeError(f"{self.name} exited at start; see {self.log}")
        if failed:
            raise RuntimeError(f"{self.name} did not become healthy; see {self.log}")

    async def owner(self) -> str:
        """The id this replica's delivery records carry (``slack_agent_replica_info``)."""
        info = metrics.labels_of(await metrics.scrape(self.url), "slack_agent_replica_info")
        if not info or "owner" not in info[0]:
            raise RuntimeError(f"{self.name} reports no owner id")
        return info[0]["owner"]

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

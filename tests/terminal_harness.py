"""``slack-agent chat`` in a pseudo-terminal, driven as a person would drive it.

``ChatProcess`` spawns the real command under pexpect and feeds everything it prints to a pyte
screen (what the person sees now) and to a plain log without escape sequences (what was ever
printed). Tests wait for observable states (text on the screen or in the log) with generous
deadlines; they never sleep to synchronise. Reads happen in a thread so the stand-in servers
of the test's own event loop keep answering meanwhile.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import pexpect
import pyte

from standins.processes import child_environment
from tests.helpers import ROOT

ROWS, COLUMNS = 50, 160
LOGIN = "tester"
OPERATOR = f"cli:{LOGIN}"
_ESCAPES = re.compile(r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]|[\x07\x08]")


def chat_env(database_url: str, **extra: Any) -> dict[str, str]:
    env = child_environment(
        DATABASE_URL=database_url,
        PYTHONPATH=str(ROOT),
        TERM="xterm",
        PROMPT_TOOLKIT_NO_CPR="1",
        USER=LOGIN,
        LOGNAME=LOGIN,
        MODEL_PROVIDER="offline",
        BUSY_POLL_SECONDS="0.2",
        SESSION_POLL_SECONDS="0.3",
    )
    env.update({k.upper(): str(v) for k, v in extra.items()})
    return env


class ChatProcess:
    def __init__(self, database_url: str, *args: str, **env: Any) -> None:
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "bot", "chat", *args],
            env=chat_env(database_url, **env),
            encoding="utf-8",
            codec_errors="replace",
            dimensions=(ROWS, COLUMNS),
            timeout=5,
        )
        self.screen = pyte.Screen(COLUMNS, ROWS)
        self.stream = pyte.Stream(self.screen)
        self.log = ""
        self.raw = ""  # everything printed, escape sequences and all
        self.mark = 0  # ``expect`` looks at the log from here on

    # -- reading --------------------------------------------------------------------------------

    def _pump(self, wait: float) -> bool:
        """Read what is there (waiting up to ``wait``); False once the process has ended."""
        try:
            data = self.child.read_nonblocking(65536, wait)
        except pexpect.TIMEOUT:
            return True
        except pexpect.EOF:
            return False
        self.stream.feed(data)
        self.raw += data
        self.log += _ESCAPES.sub("", data).replace("\r", "")
        return True

    async def until(self, check: Callable[[], Any], within: float = 60.0, what: str = "") -> Any:
        deadline = time.monotonic() + within
        while True:
            found = check()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or check}:\n{self.dump()}")
            alive = await asyncio.to_thread(self._pump, 0.2)
            if not alive and not check():
                raise AssertionError(f"chat ended while waiting for {what}:\n{self.dump()}")

    async def expect(self, text: str, within: float = 60.0) -> str:
        """Wait until ``text`` is printed after the mark; the mark moves past it."""

        def seen() -> bool:
            return text in self.log[self.mark :]

        await self.until(seen, within, repr(text))
        self.mark += self.log[self.mark :].index(text) + len(text)
        return self.log

    async def prompt(self, within: float = 60.0) -> None:
        """Wait until the line editor waits for input (the cursor's line starts with ``> ``)."""

        def ready() -> bool:
            line = self.screen.display[self.screen.cursor.y]
            return (
                line.lstrip().startswith(("> ", "(waiting) > "))
                and not line[line.index(">") + 1 :].strip()
            )

        await self.until(ready, within, "the prompt")

    def cursor_line(self) -> str:
        return str(self.screen.display[self.screen.cursor.y]).rstrip()

    def dump(self) -> str:
        screen = "\n".join(line.rstrip() for line in self.screen.display)
        return f"--- screen ---\n{screen}\n--- log tail ---\n{self.log[-3000:]}"

    # -- typing ---------------------------------------------------------------------------------

    def type(self, text: str) -> None:
        self.child.send(text)

    def line(self, text: str) -> None:
        self.child.send(text + "\r")

    def ctrl_c(self) -> None:
        self.child.sendcontrol("c")

    def ctrl_d(self) -> None:
        self.child.sendcontrol("d")

    async def exit_status(self, within: float = 60.0) -> int:
        await self.until(lambda: not self.child.isalive(), within, "the exit")
        while self._pump(0.05):
            pass
        self.child.close()
        assert self.child.exitstatus is not None, self.child.signalstatus
        return int(self.child.exitstatus)

    def kill(self) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)

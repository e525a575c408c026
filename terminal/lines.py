"""Where typed lines come from: a line editor on a terminal, plain lines from a pipe.

On a terminal, prompt_toolkit edits the line (history with the arrow keys, Emacs keys) and,
while it waits, anything printed goes *above* the prompt without disturbing what is being
typed (``patch_stdout``). Ctrl-C raises ``KeyboardInterrupt``, Ctrl-D on an empty line
``EOFError``. From a pipe (scripts, the demo) each line is read as it comes and echoed after
the prompt, so the output reads like the session did; the end of input is ``EOFError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Protocol

from prompt_toolkit import PromptSession
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.patch_stdout import patch_stdout


class LineSource(Protocol):
    async def read(self, prompt: str, default: str) -> str:
        """The next line; ``default`` is put in the editor first (a line given back)."""


class EditorLines:
    def __init__(self) -> None:
        self.session: PromptSession[str] = PromptSession(history=InMemoryHistory())

    async def read(self, prompt: str, default: str) -> str:
        with patch_stdout(raw=True):
            return await self.session.prompt_async(prompt, default=default)


class PipeLines:
    """Lines from a non-terminal stdin, read by a daemon thread (a blocked read never holds
    up the exit)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in sys.stdin:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, line.rstrip("\n"))
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def read(self, prompt: str, default: str) -> str:
        getting = asyncio.ensure_future(self.queue.get())
        with on_sigint(getting.cancel):
            try:
                line = await getting
            except asyncio.CancelledError:
                if getting.cancelled():
                    raise KeyboardInterrupt from None
                raise
        if line is None:
            raise EOFError
        print(f"{prompt}{line}", flush=True)
        return line


def line_source() -> LineSource:
    return EditorLines() if sys.stdin.isatty() and sys.stdout.isatty() else PipeLines()


@contextlib.contextmanager
def on_sigint(callback: object) -> Iterator[None]:
    """Ctrl-C calls ``callback`` instead of raising, for as long as the block runs."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, callback)  # type: ignore[arg-type]
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)

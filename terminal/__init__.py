"""``slack-agent chat``: the terminal client, a second surface on the same sessions as Slack.

It reaches the database through ``core`` only, as the Slack side does, and acts as the local
operator ``cli:<login>``. Modules, one job each:

- ``chat``: the terminal's hold on a session (what it has shown) and every core call;
- ``client``: the conversation loop (idle, waiting, replying) and the slash commands;
- ``lines``: where lines come from (a line editor on a terminal, a pipe otherwise);
- ``render``: how messages, tool calls and checkpoints look;
- ``text``: every sentence it prints.
"""

from __future__ import annotations

import logging
import sys

from core.runtime import Settings
from terminal.chat import ChatSession
from terminal.client import Terminal
from terminal.lines import line_source
from terminal.render import PlainConsole

__all__ = ["run_chat"]


async def run_chat(settings: Settings, target: str | None) -> int:
    """Open the session ``target`` names (or none: a new one) and talk until the person quits.

    Errors that stop it before the first prompt (an unknown id, a bad link, no database)
    propagate as ``SlackAgentError`` for the command line to print as one line."""
    if settings.log_level.upper() != "DEBUG":  # log lines would tear through the conversation
        logging.getLogger().setLevel(logging.WARNING)
    chat = await ChatSession.open(settings, target)
    try:
        interactive = sys.stdout.isatty()
        console = PlainConsole(highlight=False, width=None if interactive else 100)
        return await Terminal(chat, line_source(), console).run()
    finally:
        await chat.close()

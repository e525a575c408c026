"""slack-agent's core: everything that is not Slack or a terminal.

What a surface (or any other entry point) uses, and where it lives:

- ``Runtime`` (``core.runtime``): the database, its stores, the model providers and the agent,
  built from ``Settings`` (``core.settings``) in one place.
- The conversation API (``core.conversation``): ``Conversations`` per surface (open or find a
  conversation by the surface's key, find one by a surface reference, stop requests, votes) and
  ``Conversation`` (``take_turn`` with a ``TurnRequest`` and its outcomes ``Answered``,
  ``Busy``, ``Stale``, ``AlreadyAnswered``; ``unseen``, ``rewind``, ``fork``, ``compact``).
- Durable delivery (``core.conversation.worker``): ``DeliveryWorker`` carries a surface's
  recorded messages to their answers through a ``DeliverySurface`` the surface implements.
- The events a turn emits (``core.agent.loop``: ``TurnStarted``, ``TextChunk``,
  ``ToolStarted``, ``ToolFinished``, ``Notice``, …) and the errors every surface maps by
  their stable codes (``core.errors``).

Underneath, not for surfaces: ``core.agent`` (the agent loop, a turn's lease and heartbeat,
compaction, model choice), ``core.sandbox`` (the bashkit shell and its state),
``core.providers`` (the model APIs), and ``core.storage`` (every SQL statement).

The names above are importable from ``core`` itself; each is loaded on first use, so
importing one part of the core does not load all of it.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "Runtime": "core.runtime",
    "Settings": "core.settings",
    "load_settings": "core.settings",
    "Conversations": "core.conversation",
    "Conversation": "core.conversation",
    "TurnRequest": "core.conversation",
    "Answered": "core.conversation",
    "Busy": "core.conversation",
    "Stale": "core.conversation",
    "AlreadyAnswered": "core.conversation",
    "Unseen": "core.conversation",
    "DeliveryWorker": "core.conversation.worker",
    "DeliverySurface": "core.conversation.surface",
    "SlackAgentError": "core.errors",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'core' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

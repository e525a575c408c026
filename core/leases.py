"""The turn's lease checked right before each side effect it sends (§6.12).

The heartbeat task stops a turn whose lease the database has not confirmed for
``TURN_SAFE_SHARE`` of the staleness window, by cancelling it. That alone is not enough: after a
stall (a process paused with SIGSTOP, a host suspended, a loop blocked by a long synchronous
call) every timer is due at once, and asyncio may run the turn's task before the heartbeat's,
so the turn could send a tool call or a model request after another replica may have claimed
the session. Every side effect (a model request, an MCP call, a shell command) therefore calls
``before_side_effect()`` first, which asks the running turn's guard (set by ``run_turn`` in the
turn's context) whether its lease is still safely its own, and raises if not.

The age is measured on ``lease_clock``: ``CLOCK_BOOTTIME`` where the platform has it (it keeps
counting while the machine is suspended, where ``CLOCK_MONOTONIC`` stops, so a laptop or a VM
that slept cannot believe its lease is younger than it is), the monotonic clock elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)

# The check of the turn running in this context (None outside a turn: nothing to check).
_guard: ContextVar[Callable[[], None] | None] = ContextVar("lease_guard", default=None)


def lease_clock() -> float:
    """Seconds on a clock that never goes back and counts time suspended where it can."""
    if _BOOTTIME is not None:
        return time.clock_gettime(_BOOTTIME)
    return time.monotonic()


def before_side_effect() -> None:
    """Raise (the guard's exception) if this context's turn may no longer act; nothing outside
    a turn."""
    check = _guard.get()
    if check is not None:
        check()


@contextmanager
def guarding(check: Callable[[], None]) -> Iterator[None]:
    """``check`` is this context's guard while the block runs (and in the tasks it starts)."""
    token = _guard.set(check)
    try:
        yield
    finally:
        try:
            _guard.reset(token)
        except ValueError:  # closed from another context (a generator finalised late)
            _guard.set(None)

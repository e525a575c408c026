"""A replica's memory under the sandbox's heaviest attempts, measured in a process of its own.

``python tests/sandbox_memory_child.py DATABASE_URL`` runs the floods, fills, bombs and the
huge variable of ``tests/test_sandbox_attacks.py`` as real turns (offline model, default
``SandboxLimits``, the given database, already migrated), one session each, each followed by
``$ echo alive``, and prints one JSON line: the peak RSS before the first attempt (after a
warm-up turn that loads every module and code path), the peak after each attempt and at the
end, and the bound the parent checks (``memory_bound``). The peak (``peak_kib``) catches the
worst moment of every turn, not the memory left at its end.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
from typing import Any

from core.agent.loop import Agent, AgentConfig
from core.agent.model_choice import ProviderCache
from core.messages import user_message
from core.sandbox.shell import BASHKIT_MAX_FS_BYTES, SandboxLimits
from core.settings import Settings
from core.storage.engine import create_database
from core.storage.sessions import SessionStore

LIMITS = SandboxLimits()
MIB = 1024 * 1024
RANDOM_APPENDS = "mkdir -p /r; for i in $(seq 1 1200); do head -c 8192 /dev/urandom >> /r/{}; done"
HUGE_VARIABLE = "x=$(printf '%010000d' 0); for i in $(seq 1 12); do x=\"$x$x\"; done; echo ${#x}"

# (name, setup commands, the attempt): the heaviest of the attack table.
ATTEMPTS: list[tuple[str, list[str], str]] = [
    ("fork-bomb", [], ":(){ :|:& };:"),
    ("flood-yes-2gb", [], "yes | head -c 2000000000"),
    ("flood-zero", [], "cat /dev/zero"),
    ("flood-loop-megabytes", [], "for i in $(seq 1 5000); do printf '%01000d\\n' 0; done"),
    ("fill-dd-200mb", [], "mkdir -p /w; dd if=/dev/zero of=/w/big bs=1M count=200"),
    (
        "fill-until-refused",
        [],
        "mkdir -p /w; for f in $(seq 1 12); do for i in 1 2 3 4 5 6 7 8 9; do "
        "head -c 1048576 /dev/zero >> /w/f$f || exit 1; done; done",
    ),
    # Incompressible bytes up to the state limit, kept: the most a snapshot stores and restores.
    (
        "fill-random-to-limit",
        [RANDOM_APPENDS.format(i) for i in "abcde"],
        RANDOM_APPENDS.format("f"),
    ),
    # Past the state limit with incompressible bytes: told, and not kept.
    (
        "fill-random-past-limit",
        [RANDOM_APPENDS.format(i) for i in "abcdef"],
        RANDOM_APPENDS.format("g"),
    ),
    (
        "files-10000",
        ["mkdir -p /w; for i in $(seq 1 9000); do echo $i > /w/f$i; done"],
        "for i in $(seq 9001 10001); do echo $i > /w/f$i || exit 1; done",
    ),
    ("env-huge-kept", [], HUGE_VARIABLE),
    ("env-huge-refused", [HUGE_VARIABLE], 'x="$x$x"; export BIG="$x"'),
]


def peak_kib() -> int:
    """This process's peak resident set so far, in KiB.

    ``VmHWM`` of ``/proc/self/status`` where there is one: Linux keeps ``ru_maxrss`` across
    ``execve``, so a child of a big test process starts with its parent's peak (measured: 620
    MB before this child had done anything). Elsewhere ``ru_maxrss`` (KiB on Linux).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def memory_bound(limits: SandboxLimits) -> int:
    """Bytes a replica may grow by, over its warmed-up peak, while running one such turn.

    - bashkit's filesystem: up to ``BASHKIT_MAX_FS_BYTES`` held while the turn runs, whatever
      the state limit (the limit decides what is kept, not what bashkit accepts);
    - shell variables: ``max_memory_bytes``, and bashkit copies a variable on assignment and
      expansion (measured: a 40 MB variable took the peak up by 4x its size), so 6x;
    - capturing and storing a state under ``max_state_bytes``: the decoded objects, their
      envelopes, the encoded rows and the driver's copy of the parameters, so 6x;
    - output: bashkit keeps at most 1 MiB per stream, the model gets ``max_output_bytes``;
      64 MiB covers them and allocator slack.

    The terms do not all peak at once, so the sum is generous; what it rules out is growth
    without bound (a flood buffered whole, a 2 GB output, a bomb that multiplies).
    """
    return (
        BASHKIT_MAX_FS_BYTES + 6 * limits.max_memory_bytes + 6 * limits.max_state_bytes + 64 * MIB
    )


async def say(agent: Agent, session_id: int, command: str) -> dict[str, Any]:
    tail = await agent.store.tail(session_id)
    result = await agent.run_turn(
        session_id,
        user_message=user_message(f"$ {command}"),
        last_message_id=tail.message_id if tail else None,
    )
    if result.error is not None or result.answer is None:
        raise SystemExit(f"turn failed: {command!r}: {result.error}")
    parts = [p for p in result.answer.message["parts"] if p["type"] == "tool-shell"]
    return dict(parts[0]["output"])


async def main(url: str) -> dict[str, Any]:
    db = create_database(url)
    store = SessionStore(db, staleness_seconds=60)
    cache = ProviderCache(Settings(model_provider="offline"))
    agent = Agent(store, cache, AgentConfig(sandbox_limits=LIMITS))
    turns = 0
    try:
        user_id = await store.get_or_create_user("slack:T1:U1")
        warm, _ = await store.get_or_create_session("slack", "T1/C1/warm", user_id=user_id)
        for command in ("echo warm > /w", "seq 1 1000 | sort -r | head -1", "rm /w"):
            await say(agent, warm.id, command)
        baseline = peak_kib()
        peaks: dict[str, int] = {}
        for name, setup, command in ATTEMPTS:
            session, _ = await store.get_or_create_session(
                "slack", f"T1/C1/{name}", user_id=user_id
            )
            for step in setup:
                await say(agent, session.id, step)
            await say(agent, session.id, command)
            alive = await say(agent, session.id, "echo alive")
            if alive["stdout"] != "alive\n":
                raise SystemExit(f"{name}: the next turn did not work: {alive}")
            if await store.is_turn_active(session.id):
                raise SystemExit(f"{name}: the session's lock was not released")
            turns += 1
            peaks[name] = peak_kib()
    finally:
        await cache.aclose()
        await db.dispose()
    return {
        "baseline_kib": baseline,
        "peak_kib": peak_kib(),
        "peaks_kib": peaks,
        "bound_kib": memory_bound(LIMITS) // 1024,
        "turns": turns,
        "expected_turns": len(ATTEMPTS),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)

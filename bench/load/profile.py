"""Where a replica's CPU goes while it runs turns: a py-spy profile of ``concurrent_turns``,
summed into the parts of a turn.

Record (py-spy samples every process of the benchmark from outside; only the replica's are
summed here)::

    uv run py-spy record --subprocesses --rate 250 --format raw -o turns.raw -- \\
        .venv/bin/slack-agent bench turns "" 500
    uv run slack-agent bench turns-profile turns.raw

Or the wave alone, without start-up and the warm-up turn: py-spy attached to the replica once
its first turn is done (the benchmark's warm-up takes a few seconds; the wave about 25 s)::

    uv run slack-agent bench turns "" 10 &
    sleep 12; uv run py-spy record --rate 250 --format raw -o wave.raw --duration 24 \\
        --pid "$(pgrep -f 'bot serve' | head -1)"
    uv run slack-agent bench turns-profile wave.raw

A sample goes to the first part whose frames it contains, in the order of ``PARTS``; the
shares are of the replica's samples, start-up included (the benchmark's own CPU figure starts
at the first mention, so read start-up imports as outside a turn). py-spy's sampling slows
the replica too: take the shares from a profile and the milliseconds from an unprofiled run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Final

REPLICA: Final = "bot serve"
IDLE: Final = ("EpollSelector.select", "Condition.wait", "_worker (concurrent/futures/thread.py")
PARTS: Final = (
    ("start-up imports (before the first mention)", ("_find_and_load",)),
    ("Slack Web API calls (slack_sdk, aiohttp)", ("AsyncBaseClient.api_call",)),
    ("the model's stream (httpx, SSE parsing)", ("SseStreamer", "_AccountedProvider.stream")),
    ("storage (core/storage, SQLAlchemy, drivers)", ("core/storage/", "sqlalchemy/")),
    ("rendering and the reply (bot/render.py, bot/reply.py)", ("bot/render.py", "bot/reply.py")),
    ("the turn's own logic (core/agent, core/conversation)", ("core/agent/", "core/conversation/")),
    ("Bolt and the HTTP server", ("slack_bolt", "aiohttp/web")),
    ("the event loop itself (asyncio)", ("asyncio/",)),
)


def summarise(path: Path) -> list[tuple[str, float]]:
    """(part, share of the replica's busy samples), largest first; idle samples left out."""
    parts: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames[0].startswith("process "):  # --subprocesses: the replica's samples only
            if len(frames) < 2 or REPLICA not in frames[1]:
                continue
            frames = frames[2:]  # the benchmark's process, then the replica's
        if not frames or any(i in frames[-1] for i in IDLE):
            continue
        body = ";".join(frames)
        part = next((name for name, keys in PARTS if any(k in body for k in keys)), "other")
        parts[part] += int(count)
    busy = sum(parts.values()) or 1
    return [(part, n / busy) for part, n in parts.most_common()]


def run_part(argv: list[str]) -> None:
    """``slack-agent bench turns-profile FILE``: the shares of a ``py-spy --raw`` profile."""
    for part, share in summarise(Path(argv[0])):
        print(f"{share * 100:5.1f}%  {part}")

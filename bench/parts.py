"""The benchmark's parts, each run on its own: ``slack-agent bench PART [ARGS…]``.

``slack-agent bench`` alone runs the whole benchmark; a part is one of its measurements (or a
tool to read one back) with the arguments docs/benchmarks.md gives, so every figure there is
reproduced by a command of the product's, never by a module run as a script. The processes the
benchmark starts itself (a replica under its counters or its probe, the floor's server) are
started with ``python -m``: they are its workers, not entry points.
"""

from __future__ import annotations

import importlib
from typing import Final

from core.errors import UsageError

# part -> (module with ``run_part(argv)``, what it measures)
PARTS: Final[dict[str, tuple[str, str]]] = {
    "turns": ("bench.load.turns", "concurrent turns against a replica: [URL [SIZES]] [--counts]"),
    "fork": ("bench.load.turns", "acknowledgements while a fork and a sweep run: [URL]"),
    "ack": ("bench.load.ack", "acknowledgements under signed events while turns run: [URL]"),
    "turns-profile": ("bench.load.profile", "the shares of a replica's py-spy profile: FILE"),
    "write-replay": (
        "bench.load.replay",
        "a turns run's SQLite write transactions on bare sqlite3: TRACE [ROUNDS]",
    ),
    "slack-calls": ("bench.load.slack_calls", "what one Slack Web API call costs"),
    "stream-client": ("bench.load.stream_client", "CPU to read a streamed answer: httpx, aiohttp"),
    "web-first-byte": (
        "bench.load.web",
        "a chat's first byte over the HTTP API beside the terminal's: [RUNS]",
    ),
    "web-pollers": ("bench.load.web", "idle pollers of the HTTP API, a replica's CPU: [N [S]]"),
    "web-cpu": ("bench.load.web", "serve's CPU per turn, the HTTP API beside Slack: [TURNS]"),
    "web-page": ("bench.load.page", "the web page's weight and first paint in Chromium: [LOADS]"),
    "budget-check": (
        "bench.costs.observability",
        "a turn's bookkeeping with three budgets and without: [URL|- [LEDGER_ROWS]]",
    ),
    "bookkeeping": ("bench.costs.bookkeeping", "a message's bookkeeping statements: [URL]"),
    "history-load": ("bench.costs.history_load", "loading a long history: [URL [PEER_URL]]"),
    "soak-profile": ("bench.soak.profile", "a soak's profile summarised again: DIR"),
}


_WEB: Final = (
    "web-first-byte",
    "web-pollers",
    "web-cpu",
)  # two modes of one module, like turns/fork

# parts that cannot run without an argument (a file or directory to read)
NEEDS_ONE: Final = frozenset({"turns-profile", "soak-profile", "write-replay"})


def run(part: str, argv: list[str]) -> None:
    if part in NEEDS_ONE and not argv:
        raise UsageError(f"bench {part}: {PARTS[part][1]}")
    module = importlib.import_module(PARTS[part][0])
    # "fork" is a mode of the turns module: its first argument says which.
    module.run_part([part, *argv] if part in ("turns", "fork", *_WEB) else argv)

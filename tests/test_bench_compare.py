"""``bench --compare`` (bench.peers.compare): our side of the workload on both databases, over small
sizes, and a clear skip when the optional peers are not installed.

The peers themselves are an optional extra that CI does not install, so only our side runs
here; no timing is asserted.
"""

from __future__ import annotations

import pytest

from bench.peers import compare
from bench.peers.compare import CompareSizes, format_compare, run_compare
from bench.peers.conversation import Item, Ours, ours
from core.storage.engine import create_database
from core.storage.sessions import SessionStore

# Real processes or long runs: outside the developer's quick subset (README, *The tests*).
pytestmark = pytest.mark.slow

TINY = CompareSizes(
    sizes=(20, 40), rounds={20: 2, 40: 1}, load_every=10, writers=6, think_seconds=0
)


async def test_compare__our_side_keeps_one_writer_at_a_time(
    backend: str, database_url: str
) -> None:
    ours = [c for c in compare.contenders(include_peers=False) if c.database == backend]
    server = database_url if backend == "postgresql" else None

    result = await run_compare(server, sizes=TINY, chosen=ours)

    key = f"slack-agent [{backend}]"
    assert set(result["contenders"]) == {key}
    for n in ("20", "40"):
        row = result["contenders"][key][n]
        assert row["append"]["n"] == 40  # 2 rounds of 20, 1 round of 40
        assert row["load"]["n"] > 0
        assert row["bytes_per_message"] >= 0  # a few rows may fit in pages already there
    writers = result["writers"][key]
    assert writers["one_writer_at_a_time"], writers
    assert writers["messages_kept"] == 12
    assert writers["most_at_once"] == 1
    assert "one writer at a time" in format_compare(result)


async def test_compare__without_the_peers_skips_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compare.peers, "missing", lambda: ["openai-agents"])

    result = await run_compare(None, sizes=TINY)

    assert "openai-agents" in result["skipped"]
    assert "uv sync --extra compare" in result["skipped"]
    assert format_compare(result) == result["skipped"]


async def test_compare__ours_turns_take_any_order_of_messages_and_release_at_the_end(
    backend: str, database_url: str
) -> None:
    """A question opens a turn and its answer closes it; two questions in a row, an answer
    with no question, and a question left unanswered at the end still store every message
    in order and leave no turn holding the session's lock."""
    roles = ["user", "user", "assistant", "assistant", "user"]
    async with ours(database_url, "any-order") as conversation:
        for i, role in enumerate(roles):
            await conversation.append(Item(role, f"{role} {i}"))
        assert await conversation.load() == [f"{role} {i}" for i, role in enumerate(roles)]
        assert isinstance(conversation, Ours)
        store, session_id = conversation.store, conversation.session_id
        assert await store.is_turn_active(session_id)  # the last question's turn, still open
    db = create_database(database_url)
    try:
        assert not await SessionStore(db, staleness_seconds=60).is_turn_active(session_id)
    finally:
        await db.dispose()

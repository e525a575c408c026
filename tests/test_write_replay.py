"""``slack-agent bench write-replay`` (``bench.load.replay``): a traced run's SQLite write
transactions read back in commit order, each thread's apart, and run again on a bare
connection with the product's settings."""

from __future__ import annotations

from pathlib import Path

from bench.load.replay import _connect, _migrated, replay, transactions

INSERT = "INSERT INTO system_settings (key, value) VALUES (?, ?)"


def test_transactions__each_threads_statements_in_commit_order(tmp_path: Path) -> None:
    """A ``Prepared`` line and SQLite's echo of it are one statement; a line equal to the one
    before it is a trigger's, left to SQLite; any other is an ordinary statement with its
    values written in. Two threads' transactions interleave and are told apart."""
    trace = tmp_path / "trace.txt"
    lines = [
        ("a", "'BEGIN IMMEDIATE'"),
        ("b", "'BEGIN IMMEDIATE'"),
        ("Pa", repr((INSERT, ["k1", '"v"']))),
        ("a", repr("INSERT INTO system_settings (key, value) VALUES ('k1', '\"v\"')")),
        ("b", repr("DELETE FROM system_settings WHERE key = 'gone'")),
        ("b", repr("DELETE FROM system_settings WHERE key = 'gone'")),  # a trigger's echo
        ("b", "'COMMIT'"),
        ("a", "'ROLLBACK'"),
    ]
    trace.write_text("".join(f"{tag}\t{body}\n" for tag, body in lines))
    assert transactions(trace) == [
        ("b", [("DELETE FROM system_settings WHERE key = 'gone'", ())], "COMMIT"),
        ("a", [(INSERT, ("k1", '"v"'))], "ROLLBACK"),
    ]


def test_replay__runs_them_on_the_products_schema_and_settings(tmp_path: Path) -> None:
    """Every transaction runs again on a copy of a migrated file, by kind, with the WAL's
    growth; the connection is the product's (WAL, foreign keys on, ``synchronous=NORMAL``)."""
    schema = tmp_path / "schema.db"
    _migrated(schema)
    conn = _connect(schema, checkpoints=True)
    settings = [
        conn.execute(f"PRAGMA {name}").fetchone()[0]
        for name in ("journal_mode", "foreign_keys", "synchronous")
    ]
    conn.close()
    assert settings == ["wal", 1, 1]
    txs = [("a", [(INSERT, (f"k{i}", '"v"'))], "COMMIT") for i in range(3)]
    by_kind = replay(txs, schema, tmp_path / "replay.db", checkpoints=False)
    assert list(by_kind) == ["INSERT INTO system_settings"]
    assert len(by_kind["INSERT INTO system_settings"]) == 3
    assert all(grown > 0 for *_, grown in by_kind["INSERT INTO system_settings"])
    replayed = _connect(tmp_path / "replay.db", checkpoints=True)
    assert (
        replayed.execute("SELECT count(*) FROM system_settings WHERE key LIKE 'k%'").fetchone()[0]
        == 3
    )

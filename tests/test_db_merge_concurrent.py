"""Two `db merge`s of one large database into one target at once both succeed: the query clock
bounds each statement's wait for its next row (and each write batch), not a whole bulk merge, and a
merge waits for the other's write lock (temp-file SQLite, two processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from autosymm.db import open as db_open
from autosymm.db.store import QueryTimeoutError, TuningDB
from autosymm.db.merge import merge_files

from _db_rows import big_file, run_processes

N_ROWS = 12_000
#: A clock far shorter than reading, validating and writing N_ROWS takes here (seconds): the
#: merges pass only if the clock is per statement and re-armed on progress, whatever the size.
CLOCK_S = 0.3


def _merge(folder: str, worker: int) -> None:
    folder = Path(folder)
    start = time.monotonic()
    counts = merge_files([folder / "source.sqlite"], folder / "target.sqlite")
    (folder / f"merge{worker}.json").write_text(json.dumps({"counts": [list(c) for c in counts],
                                                           "seconds": time.monotonic() - start}))


def test_two_concurrent_merges_of_a_large_db_both_succeed(tmp_path, monkeypatch):
    monkeypatch.setattr(db_open, "QUERY_LIMIT_S", CLOCK_S)  # the forked merges inherit it
    big_file(tmp_path / "source.sqlite", N_ROWS)
    assert run_processes(_merge, tmp_path, 2) == [0, 0]
    done = [json.loads((tmp_path / f"merge{w}.json").read_text()) for w in range(2)]
    assert sorted(tuple(d["counts"][0]) for d in done) == [(0, 0, N_ROWS, 0), (N_ROWS, 0, 0, 0)]
    assert min(d["seconds"] for d in done) > 2 * CLOCK_S  # each merge outlasted the clock
    with TuningDB(tmp_path / "target.sqlite", readonly=True) as tdb:
        assert len(tdb) == N_ROWS and tdb.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_the_clock_still_stops_a_statement_that_makes_no_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(db_open, "QUERY_LIMIT_S", CLOCK_S)
    path = big_file(tmp_path / "source.sqlite", 10)
    with TuningDB(path, readonly=True) as tdb:
        start = time.monotonic()
        with pytest.raises(QueryTimeoutError, match=f"reading {path} took over {CLOCK_S:g} s"):
            with tdb._guarded():
                tdb.db.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                               "SELECT COUNT(*) FROM n").fetchone()
        assert time.monotonic() - start < 5.0

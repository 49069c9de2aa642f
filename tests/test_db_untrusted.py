"""A tuning database is untrusted data: files built in the test to attack or confuse a reader (a
spinning view, a trigger, random bytes, a future schema, a foreign or empty file, a lock held by
another connection) never hang, run, or get misread; each is refused or skipped naming the file."""

from __future__ import annotations

import contextlib
import re
import sqlite3
import tempfile
import time
import warnings

import pytest

from autosymm.db import store as dbmod
from autosymm.db.store import (SCHEMA_VERSION, BadRowWarning, CorruptDatabaseError, DatabaseLockedError,
                               DatabaseVersionError, MergeCounts, QueryTimeoutError, TuningDB, verdict)
from autosymm.db.merge import merge_files
from autosymm.db.open import db_error, harden
from autosymm.db.read import open_sources

from _db_rows import file_sha, make_row, moe_row, plant, sql, winner_rows
from _gloo import run_gloo

SPIN = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)"


def good_file(tmp_path, name: str = "good.sqlite", rows=None):
    path = tmp_path / name
    with TuningDB(path) as tdb:
        tdb.record_many(rows or [make_row(), make_row(backend="nccl", median_us=20.0, config=None)])
    return path


def raw(path, script: str) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(script)
    conn.close()


def spinning_view_file(tmp_path):
    """An autosymm file whose ``winners`` view never ends (and would name nccl the winner)."""
    path = good_file(tmp_path, "spin.sqlite")
    raw(path, f"DROP VIEW winners; CREATE VIEW winners AS {SPIN} SELECT results.*, i AS place FROM results, n;")
    return path


def hostile_file(tmp_path, kind: str):
    """A file that is not a usable tuning database, of ``kind``."""
    path = tmp_path / f"{kind}.sqlite"
    if kind == "random":
        path.write_bytes(bytes(range(256)) * 64)
    elif kind == "empty":
        path.touch()
    elif kind == "future":
        good_file(tmp_path, path.name)
        raw(path, f"UPDATE meta SET value = '{SCHEMA_VERSION + 1}' WHERE key = 'schema_version'")
    elif kind == "foreign":
        raw(path, "CREATE TABLE accounts (id INTEGER, owner TEXT)")
    elif kind == "trigger":
        good_file(tmp_path, path.name)
        raw(path, f"CREATE TRIGGER grow AFTER INSERT ON results BEGIN "
                  f"INSERT INTO meta SELECT 'k' || i, 'v' FROM ({SPIN} SELECT i FROM n); END;")
    elif kind == "results_view":
        raw(path, f"CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT); "
                  f"INSERT INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}'); "
                  f"CREATE VIEW results AS {SPIN} SELECT i AS hardware FROM n;")
    return path


#: What each hostile file is refused for (in the verdict, the errors and the warnings).
WHY = {"random": "not a readable SQLite database", "empty": "is empty", "future": f"schema version {SCHEMA_VERSION + 1}",
       "foreign": "not an autosymm tuning database", "trigger": "trigger", "results_view": "results (view) must be a table"}
ERROR = {"random": CorruptDatabaseError, "empty": CorruptDatabaseError, "future": DatabaseVersionError,
         "foreign": CorruptDatabaseError, "trigger": CorruptDatabaseError, "results_view": CorruptDatabaseError}


@contextlib.contextmanager
def locked(path):
    """``path`` held by another connection's exclusive transaction (no reader, no writer gets in)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


# ------------------------------------------------------------------------------ the file's own code never runs


def test_a_spinning_winners_view_is_never_read(tmp_path):
    path = spinning_view_file(tmp_path)
    start = time.monotonic()
    with TuningDB(path, readonly=True) as tdb:
        assert [r.backend for r in winner_rows(tdb)] == ["triton_one_shot"]  # from the results table
        assert tdb.db.execute("PRAGMA trusted_schema").fetchone()[0] == 0
    assert time.monotonic() - start < 5.0


def test_a_query_that_spins_is_stopped_by_the_clock(tmp_path):
    path = spinning_view_file(tmp_path)
    conn = sqlite3.connect(path)
    harden(conn, limit_s=0.3).arm()
    start = time.monotonic()
    with pytest.raises(sqlite3.OperationalError) as caught:
        conn.execute("SELECT COUNT(*) FROM winners").fetchone()
    assert time.monotonic() - start < 3.0
    error = db_error(caught.value, str(path), wait_s=3.0, limit_s=0.3)
    assert isinstance(error, QueryTimeoutError) and str(path) in str(error) and "0.3 s" in str(error)


@pytest.mark.parametrize("kind", sorted(WHY))
def test_a_hostile_file_is_refused_naming_it_and_why(tmp_path, kind):
    path = hostile_file(tmp_path, kind)
    before = file_sha(path)
    for readonly in (True,) if kind == "empty" else (True, False):  # a writer makes an empty file a new DB
        with pytest.raises(ERROR[kind], match=re.escape(str(path)) + ".*" + re.escape(WHY[kind])):
            TuningDB(path, readonly=readonly)
    why = verdict(path)
    assert why is not None and str(path) in why and WHY[kind] in why
    assert file_sha(path) == before  # nothing ran, nothing was written


def test_the_verdict_of_usable_and_missing_files(tmp_path):
    assert verdict(good_file(tmp_path)) is None
    missing = tmp_path / "missing.sqlite"
    assert verdict(missing) == f"tuning database {missing} does not exist"


@pytest.mark.parametrize("kind", ["random", "empty", "future", "foreign", "trigger"])
def test_the_dispatcher_skips_a_hostile_file_with_a_warning_naming_it(tmp_path, kind):
    good, bad = good_file(tmp_path), hostile_file(tmp_path, kind)
    with pytest.warns(UserWarning, match=rf"ignoring tuning database {re.escape(str(bad))}: .*{re.escape(WHY[kind])}"):
        sources = open_sources(bad, [good])
    assert [s.label for s in sources] == [str(good)]


def test_a_trigger_in_a_merge_target_is_refused_before_it_can_run(tmp_path):
    source, target = good_file(tmp_path), hostile_file(tmp_path, "trigger")
    before = file_sha(target)
    with pytest.raises(CorruptDatabaseError, match="trigger"):
        merge_files([source], target)
    assert file_sha(target) == before


# ------------------------------------------------------------------------------ locks


def test_a_locked_file_is_named_within_a_few_seconds(tmp_path):
    path = good_file(tmp_path)
    with locked(path):
        start = time.monotonic()
        with pytest.raises(DatabaseLockedError, match=re.escape(f"{path} is locked by another process (waited {dbmod.LOCK_WAIT_S:g} s)")):
            TuningDB(path, readonly=True)
        assert time.monotonic() - start < dbmod.LOCK_WAIT_S + 3.0
        assert "is locked" in verdict(path)
    assert len(TuningDB(path, readonly=True)) == 2  # once released, read as usual


def test_a_locked_file_is_raised_by_the_dispatcher_not_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(dbmod, "LOCK_WAIT_S", 0.2)
    path = good_file(tmp_path)
    with locked(path), pytest.raises(DatabaseLockedError, match=re.escape(str(path))):
        open_sources(path, [])


def test_a_merge_into_a_locked_target_says_so(tmp_path):
    source, target = good_file(tmp_path), good_file(tmp_path, "target.sqlite", [moe_row()])
    with locked(target), pytest.raises(DatabaseLockedError, match=re.escape(str(target))):
        merge_files([source], target, timeout_s=0.2)
    assert TuningDB(target).rows() == [moe_row()]


def _first_call_with_a_locked_db(rank, world_size):
    import torch

    import autosymm

    x = torch.full((1000,), float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autosymm.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, 3.0))
    said = [str(w.message) for w in caught if "every rank uses NCCL" in str(w.message)]
    assert len(said) == (1 if rank == 0 else 0)
    return autosymm.explain(x).reason, said


def test_a_db_locked_on_one_rank_puts_every_rank_on_nccl_and_rank_0_names_it(tmp_path):
    mine, theirs = good_file(tmp_path, "rank0.sqlite"), good_file(tmp_path, "rank1.sqlite")
    env = {0: {"AUTOSYMM_DB": str(mine)}, 1: {"AUTOSYMM_DB": str(theirs)}}
    start = time.monotonic()
    with locked(theirs):
        out = run_gloo(_first_call_with_a_locked_db, 2, env=env, deadline_s=120.0)
    assert out[0][0] == out[1][0]  # every rank says the same
    (warned,) = out[0][1]
    assert f"rank 1: DatabaseLockedError: {theirs} is locked by another process" in warned
    assert time.monotonic() - start < 100.0


# ------------------------------------------------------------------------------ merge and export


def test_merge_skips_rows_of_unknown_backends_and_foreign_configs(tmp_path):
    source, target = tmp_path / "source.sqlite", good_file(tmp_path, "target.sqlite", [moe_row()])
    with TuningDB(source) as tdb:
        plant(tdb, [make_row(backend="nccl", median_us=20.0, config=None),  # the one good row
                    make_row(backend="no_such_backend"),
                    make_row(backend="x'); DROP TABLE results; --"),
                    make_row(backend="nccl", op="dp_to_ep", shape="d7168_e256_k8", config=None),
                    make_row(backend="triton_two_shot"),  # holds a one_shot config
                    moe_row(config=None)])  # a Triton kernel without a launch config
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert merge_files([source], target) == [MergeCounts(inserted=1, replaced=0, kept=0, skipped=5)]
    said = [str(w.message) for w in caught if issubclass(w.category, BadRowWarning)]
    assert len(said) == 5 and all(str(source) in text for text in said)
    assert any("unknown backend 'no_such_backend'" in text for text in said)
    assert any("does not serve op 'dp_to_ep'" in text for text in said)
    assert any("runs algorithm 'two_shot', the config holds 'one_shot'" in text for text in said)
    assert any("needs a launch config" in text for text in said)
    with TuningDB(target, readonly=True) as merged:
        assert {(r.op, r.backend) for r in merged.rows()} == {("dp_to_ep", "triton_moe"), ("all_reduce", "nccl")}


def test_export_writes_through_an_exclusive_temp_file(tmp_path, monkeypatch):
    with TuningDB() as tdb:
        tdb.record_many([make_row()])
        out = tmp_path / "out.sqlite"
        victim = tmp_path / "victim"
        victim.write_text("keep me")
        import os

        planted = tmp_path / f".{out.name}.{os.getpid()}.tmp"  # the name a race would plant a link at
        planted.symlink_to(victim)
        made = []
        real_mkstemp = tempfile.mkstemp

        def spy(*args, **kwargs):
            made.append(real_mkstemp(*args, **kwargs))
            return made[-1]

        monkeypatch.setattr(tempfile, "mkstemp", spy)
        assert tdb.export(out) == 1
    assert len(made) == 1 and made[0][1].startswith(str(tmp_path / f".{out.name}."))
    assert victim.read_text() == "keep me" and planted.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, victim.name, planted.name])
    assert TuningDB(out, readonly=True).rows() == [make_row()]


def test_export_of_nothing_is_refused_and_writes_nothing(tmp_path):
    with TuningDB() as tdb:
        tdb.record_many([make_row()])
        tdb.set_meta("coverage", "world size 2")
        out = tmp_path / "out.sqlite"
        with pytest.raises(ValueError, match=r"nothing to export: :memory: has no valid row with world_size=4 "
                                             r"\(it holds nvidia-h200-nvlink world size 2\)"):
            tdb.export(out, world_size=4)
        sql(tdb, "UPDATE results SET median_us = -1")
        with pytest.warns(BadRowWarning), pytest.raises(ValueError, match="it holds no valid row"):
            tdb.export(out)
    assert list(tmp_path.iterdir()) == []

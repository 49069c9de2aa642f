"""autosymm.db.store's schema: created through sqlite-utils, compatible with released files, versions,
migrations, refused files, read-only opening and hot journals (temp-file SQLite, no GPU)."""

from __future__ import annotations

import os
import sqlite3

import pytest
import sqlite_utils

from autosymm.db import open as db_open
from autosymm.db.store import (PK_COLUMNS, SCHEMA_VERSION, CorruptDatabaseError, DatabaseVersionError, Key,
                               ReadOnlyDatabaseError, TuningDB, version_mismatch)

from _db_rows import HW, build_v0, file_sha, key_rows, make_row, run_processes, sql, winner_rows

#: The schema of the released version 1, as its RESULTS_DDL / WINNERS_DDL wrote it: files this
#: code writes must read the same to it (columns, types, constraints, key, view).
RELEASED_V1 = """CREATE TABLE results (
  hardware TEXT NOT NULL, gpu TEXT NOT NULL DEFAULT '', world_size INTEGER NOT NULL,
  op TEXT NOT NULL, dtype TEXT NOT NULL, bucket INTEGER NOT NULL, shape TEXT NOT NULL DEFAULT '',
  mode TEXT NOT NULL, backend TEXT NOT NULL, config TEXT NOT NULL DEFAULT '{}',
  median_us REAL NOT NULL, p10_us REAL, p90_us REAL, nccl_us REAL, speedup REAL, trials INTEGER,
  autosymm_version TEXT, torch_version TEXT, triton_version TEXT, cuda_version TEXT,
  driver_version TEXT, created TEXT NOT NULL,
  PRIMARY KEY (hardware, world_size, op, dtype, bucket, shape, mode, backend));
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
CREATE VIEW winners AS SELECT * FROM (
  SELECT results.*, ROW_NUMBER() OVER (PARTITION BY hardware, world_size, op, dtype, bucket, shape, mode
                                       ORDER BY median_us, backend) AS place
  FROM results) WHERE place = 1;
INSERT INTO meta VALUES ('schema_version', '1');"""
#: Version 2 = version 1 plus a nullable ``comm_env`` column at the end of results.
RELEASED_V2 = RELEASED_V1.replace("INSERT INTO meta VALUES ('schema_version', '1');", """
ALTER TABLE results ADD COLUMN comm_env TEXT;
INSERT INTO meta VALUES ('schema_version', '2');""")
#: Version 3 = version 2 plus a nullable ``nccl_version`` column at the end of results.
RELEASED_V3 = RELEASED_V2.replace("INSERT INTO meta VALUES ('schema_version', '2');", """
ALTER TABLE results ADD COLUMN nccl_version TEXT;
INSERT INTO meta VALUES ('schema_version', '3');""")
RELEASED_V4 = RELEASED_V3.replace("INSERT INTO meta VALUES ('schema_version', '3');", """
ALTER TABLE results ADD COLUMN stack TEXT;
ALTER TABLE results ADD COLUMN stack_us REAL;
ALTER TABLE results ADD COLUMN stack_note TEXT;
INSERT INTO meta VALUES ('schema_version', '4');""")


def shape_of(conn: sqlite3.Connection) -> dict:
    """What a reader sees of a file's schema: each table's and view's columns with their types,
    NOT NULL, defaults and key positions."""
    names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
                                        "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    return {name: conn.execute(f"PRAGMA table_info({name})").fetchall() for name in names}


# ------------------------------------------------------------------------------ schema


def test_schema_is_made_with_sqlite_utils():
    with TuningDB() as tdb:
        assert tdb.db["results"].pks == list(PK_COLUMNS)
        assert tdb.db["meta"].pks == ["key"]
        assert tdb.db.view_names() == ["winners"]
        assert set(tdb.db.table_names()) == {"results", "meta"}


def test_new_files_have_the_released_schema(tmp_path):
    path = tmp_path / "new.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
    released = sqlite3.connect(":memory:")
    released.executescript(RELEASED_V4)
    with sqlite3.connect(path) as conn:
        assert shape_of(conn) == shape_of(released)
        # what the released code ran against its files runs against this one
        old_read = "SELECT backend, median_us FROM winners WHERE hardware = ? AND bucket = ? ORDER BY backend"
        assert conn.execute(old_read, [HW, 1 << 20]).fetchall() == [("triton_one_shot", 10.0)]


def test_released_files_read_and_write(tmp_path):
    path = tmp_path / "released.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(RELEASED_V1)
    with TuningDB(path) as tdb:
        tdb.record_many([make_row(), make_row(backend="nccl", median_us=20.0, config=None)])
        assert [r.backend for r in winner_rows(tdb)] == ["triton_one_shot"]
    with TuningDB(path, readonly=True) as tdb:
        assert tdb.rows() == [make_row(), make_row(backend="nccl", median_us=20.0, config=None)]


def test_version_1_files_migrate_to_comm_env(tmp_path):
    path = tmp_path / "v1.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(RELEASED_V1)
        conn.execute("INSERT INTO results (hardware, gpu, world_size, op, dtype, bucket, mode, backend, config, "
                     "median_us, created) VALUES (?, 'NVIDIA H200', 2, 'all_reduce', 'bf16', 4096, 'graph', 'nccl', "
                     "'{}', 11.0, '2026-11-30T00:00:00+00:00')", [HW])
    conn.close()
    before = file_sha(path)
    with TuningDB(path, readonly=True) as tdb:  # a shipped file: migrated in memory, never written
        assert tdb.schema_version == SCHEMA_VERSION == 4
        (old,) = tdb.rows()
        assert old.comm_env is None and old.median_us == 11.0
    assert file_sha(path) == before
    with TuningDB(path) as tdb:  # a user's file: migrated in place, then takes the new column
        tdb.record_many([make_row(comm_env="TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1")])
    released = sqlite3.connect(":memory:")
    released.executescript(RELEASED_V4)
    with sqlite3.connect(path) as conn:
        assert shape_of(conn) == shape_of(released)
    with TuningDB(path, readonly=True) as tdb:
        assert {r.backend: r.comm_env for r in tdb.rows()} == {
            "nccl": None, "triton_one_shot": "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1"}
        assert "comm_env" in {c for c, *_ in tdb.db.execute("SELECT * FROM winners").description}


def test_provenance_fills_the_comm_env_column(monkeypatch):
    from autosymm import hardware
    from autosymm.db.schema import PROVENANCE_COLUMNS

    # values as seen, and "unset" (only the "off" values here: this suite never turns multicast on)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    prov = hardware.provenance(hardware.cpu_fingerprint())
    assert prov["comm_env"] == "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=unset"
    assert set(PROVENANCE_COLUMNS) <= set(prov)  # the tuner copies these into every row
    row = make_row(**{k: prov[k] for k in PROVENANCE_COLUMNS})
    with TuningDB() as tdb:
        tdb.record_many([row])
        assert tdb.rows()[0].comm_env == prov["comm_env"]


def test_migrates_v0_in_place(tmp_path):
    path = tmp_path / "old.sqlite"
    build_v0(path)
    with TuningDB(path) as tdb:
        assert tdb.schema_version == SCHEMA_VERSION
        (row,) = tdb.rows()
        assert (row.backend, row.median_us, row.p10_us, row.trials) == ("nccl", 8.0, None, None)
        assert [r.backend for r in winner_rows(tdb)] == ["nccl"]
        tdb.record_many([make_row()])
    with TuningDB(path) as again:  # reopening does not migrate twice
        assert again.schema_version == SCHEMA_VERSION and len(again) == 2


def test_migrates_v0_read_only_in_memory(tmp_path):
    path = tmp_path / "old.sqlite"
    build_v0(path)
    before = file_sha(path)
    with TuningDB(path, readonly=True) as tdb:
        assert tdb.schema_version == SCHEMA_VERSION
        assert key_rows(tdb, Key(HW, 2, "all_reduce", "bf16", 4096))[0].backend == "nccl"
        with pytest.raises(ReadOnlyDatabaseError):
            tdb.record_many([make_row()])
    assert file_sha(path) == before
    assert "meta" not in sqlite_utils.Database(path).table_names()


@pytest.mark.parametrize("readonly", [False, True])
def test_newer_schema_is_refused(tmp_path, readonly):
    path = tmp_path / "new.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
        sql(tdb, "UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(SCHEMA_VERSION + 1)])
    before = file_sha(path)
    with pytest.raises(DatabaseVersionError, match=f"version {SCHEMA_VERSION + 1}.*version {SCHEMA_VERSION}"):
        TuningDB(path, readonly=readonly)
    assert issubclass(DatabaseVersionError, ValueError)
    assert file_sha(path) == before


@pytest.mark.parametrize("readonly", [False, True])
def test_non_sqlite_file_is_refused(tmp_path, readonly):
    path = tmp_path / "junk.sqlite"
    path.write_bytes(b"this is not a database\n" * 100)
    with pytest.raises(CorruptDatabaseError, match="junk.sqlite"):
        TuningDB(path, readonly=readonly)
    assert path.read_bytes() == b"this is not a database\n" * 100


@pytest.mark.parametrize("ddl", [
    "CREATE TABLE other (x INTEGER)",  # someone else's database
    "CREATE TABLE results (x INTEGER)",  # a 'results' table that is not ours
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",  # no schema_version
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT); INSERT INTO meta VALUES ('schema_version', '1')",
])
def test_foreign_or_incomplete_database_is_refused(tmp_path, ddl):
    path = tmp_path / "foreign.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(ddl)
    conn.close()
    with pytest.raises(CorruptDatabaseError):
        TuningDB(path)


def test_read_only_database_is_never_written(tmp_path):
    path = tmp_path / "shipped.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
    before = file_sha(path)
    with TuningDB(path, readonly=True) as tdb:
        assert tdb.rows() == [make_row()]
        for write in (lambda: tdb.record_many([make_row(median_us=1.0)]), lambda: tdb.set_meta("a", "b")):
            with pytest.raises(ReadOnlyDatabaseError):
                write()
        with pytest.raises(sqlite3.OperationalError, match="readonly"):  # SQLite itself refuses too
            tdb.db.execute("DELETE FROM results")
    assert file_sha(path) == before
    with pytest.raises(FileNotFoundError):
        TuningDB(tmp_path / "missing.sqlite", readonly=True)
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(CorruptDatabaseError):
        TuningDB(empty, readonly=True)


def test_creates_parent_folders(tmp_path):
    path = tmp_path / "a" / "b" / "tuning.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
    assert path.is_file() and len(TuningDB(path, readonly=True)) == 1


# ------------------------------------------------------------------------------ hot journals


N_UNCOMMITTED = 3000


def _killed_writer(path: str, worker: int) -> None:
    """Begin a write, write past a tiny page cache (SQLite spills pages into the file and the
    journal becomes hot), then die before COMMIT."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.execute("PRAGMA cache_size=2")
    conn.execute("BEGIN IMMEDIATE")
    for bucket in range(1, N_UNCOMMITTED + 1):
        conn.execute("INSERT INTO results (hardware, world_size, op, dtype, bucket, mode, backend, median_us, "
                     "created) VALUES (?, 2, 'all_reduce', 'bf16', ?, 'eager', 'uncommitted', 1.0, 'x')",
                     [HW, bucket])
    os._exit(0)


def hot_journal_file(tmp_path):
    path = tmp_path / "killed.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
    assert run_processes(_killed_writer, path, 1) == [0]
    journal = tmp_path / "killed.sqlite-journal"
    assert journal.stat().st_size > 0
    with pytest.raises(sqlite3.OperationalError):  # SQLite will not read it read-only as it is
        sqlite3.connect(path.as_uri() + "?mode=ro", uri=True).execute("SELECT * FROM results").fetchall()
    return path, journal


def test_read_only_open_rolls_a_hot_journal_back(tmp_path):
    path, journal = hot_journal_file(tmp_path)
    with TuningDB(path, readonly=True) as tdb:
        assert tdb.rows() == [make_row()]  # the unfinished write is gone
        assert tdb.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert not journal.exists()


def test_hot_journal_without_write_access_is_explained(tmp_path, monkeypatch):
    path, journal = hot_journal_file(tmp_path)
    before = (file_sha(path), file_sha(journal))
    monkeypatch.setattr(db_open.os, "access", lambda *args, **kwargs: False)
    with pytest.raises(CorruptDatabaseError, match="killed.sqlite-journal.*write access"):
        TuningDB(path, readonly=True)
    assert (file_sha(path), file_sha(journal)) == before


# ------------------------------------------------------------------------------ versions of the libraries


def test_version_mismatch():
    row = make_row(torch_version="2.11.0", triton_version="3.6.0")
    assert version_mismatch(row, "2.13.0", "3.9.0") == \
        "measured with torch 2.11.0, triton 3.6.0 (running torch 2.13.0, triton 3.9.0)"
    assert version_mismatch(row, "2.11.0", "3.6.0") is None
    assert version_mismatch(row, "2.11.0", "3.7.0") == \
        "measured with torch 2.11.0, triton 3.6.0 (running torch 2.11.0, triton 3.7.0)"
    assert version_mismatch(row, None, "3.7.0") == "measured with triton 3.6.0 (running triton 3.7.0)"
    assert version_mismatch(make_row(torch_version=None, triton_version=""), "2.13.0", "3.9.0") is None  # unknown


def test_a_config_of_another_op_is_refused():
    from autosymm.configs import AllReduceConfig, MoEConfig

    with pytest.raises(ValueError, match="config type MoEConfig does not belong to op 'all_reduce'"):
        make_row(op="all_reduce", config=MoEConfig(1024, 4))
    with pytest.raises(ValueError, match="config type AllReduceConfig does not belong to op .dp_to_ep."):
        make_row(op="dp_to_ep", shape="d64_e8_k2", config=AllReduceConfig("one_shot", 1024, 4, 8))
    assert make_row(op="dp_to_ep", shape="d64_e8_k2", config=MoEConfig(1024, 4)).config_obj == MoEConfig(1024, 4)

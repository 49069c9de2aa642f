"""autosymm.db.store: bad rows (written by a bug or an outside tool) are skipped by every read with one
warning each, and lookups, digests, exports and merges answer from the good rows (temp-file SQLite)."""

from __future__ import annotations

import math
import warnings

import pytest
import sqlite_utils

from autosymm.configs import AllReduceConfig
from autosymm.db.store import (PK_COLUMNS, BadRowWarning, CorruptDatabaseError, DatabaseVersionError, Key,
                               MergeCounts, Row, TuningDB)
from autosymm.db.merge import merge_files
from autosymm.db.schema import RESULTS_COLUMNS

from _db_rows import HW, file_sha, key_buckets, key_rows, make_row, sql, winner_rows

GOOD = [make_row(backend="nccl", median_us=20.0, config=None),
        make_row(backend="triton_two_shot", median_us=30.0, config=AllReduceConfig("two_shot", 2048, 8, 8)),
        make_row(backend="nccl", bucket=4096, median_us=3.0, config=None)]
KEY = GOOD[0].key
AR = '{"algorithm": "one_shot", "block_size": %s, "num_blocks": %s, "num_warps": %s, "type": "AllReduceConfig"}'
BAD_VALUES = {  # what a raw UPDATE puts in the bad row
    "unknown config type": ("config", '{"type": "Pickle", "x": 1}'),
    "negative block size": ("config", AR % (-1024, 1, 4)),
    "2**40 block size": ("config", AR % (1 << 40, 1, 4)),
    "bool for an int": ("config", AR % (1024, 1, "true")),
    "float for an int": ("config", AR % (1024, 2.0, 4)),
    "config field missing": ("config", '{"type": "MoEConfig", "num_warps": 4}'),
    "config not JSON": ("config", "garbage {"),
    "config not an object": ("config", "[1, 2]"),
    "negative median": ("median_us", -1.0),
    "infinite median": ("median_us", math.inf),
    "text median": ("median_us", "fast"),
    "negative nccl time": ("nccl_us", -3.0),
    "text world size": ("world_size", "two"),
    "bucket 0": ("bucket", 0),
    "float trials": ("trials", 2.5),
}


def corrupted_file(tmp_path, column: str, value, name: str = "t.sqlite"):
    """A file holding GOOD and a triton_one_shot row (the fastest of KEY) whose ``column`` raw SQL then sets
    to ``value``; and the digest of GOOD alone."""
    path = tmp_path / name
    with TuningDB(path) as tdb:
        tdb.record_many(GOOD)
        clean_digest = tdb.digest()
        tdb.record_many([make_row(backend="triton_one_shot", median_us=5.0)])
        sql(tdb, f"UPDATE results SET {column} = ? WHERE backend = 'triton_one_shot'", [value])
        assert len(tdb) == len(GOOD) + 1
    return path, clean_digest


def bad_row_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, BadRowWarning)]


@pytest.mark.parametrize("column, value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_a_bad_row_is_skipped_by_every_read_with_one_warning(tmp_path, column, value):
    path, clean_digest = corrupted_file(tmp_path, column, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for reader in range(2):  # a second reader of the file in this process: no new warning
            with TuningDB(path, readonly=True) as tdb:
                assert set(tdb.rows()) == set(GOOD)
                assert [r.backend for r in key_rows(tdb, KEY)] == ["nccl", "triton_two_shot"]
                assert key_rows(tdb, KEY)[0] == GOOD[0]
                assert winner_rows(tdb) == [GOOD[2], GOOD[0]]  # the bad row may top KEY in the view
                assert winner_rows(tdb, backend="nccl") == [GOOD[2], GOOD[0]]
                assert key_buckets(tdb, KEY) == [4096, 1 << 20]
                assert {r.hardware for r in tdb.rows()} == {HW}
                assert tdb.digest() == clean_digest  # as if the bad row were not there
                assert tdb.export(tmp_path / f"export{reader}.sqlite") == len(GOOD)
                assert set(TuningDB(tmp_path / f"export{reader}.sqlite").rows()) == set(GOOD)
    (message,) = bad_row_warnings(caught)
    assert str(path) in message and "backend='triton_one_shot'" in message and f"Row.{column}" in message


def test_unreadable_row_is_skipped_with_a_clear_warning():
    with TuningDB() as db:
        db.record_many([make_row()])
        sql(db, "UPDATE results SET config = 'garbage'")
        with pytest.warns(BadRowWarning, match=r":memory:.*triton_one_shot.*Row\.config.*not JSON"):
            assert db.rows() == []
        assert key_rows(db, make_row().key) == [] and key_buckets(db, make_row().key) == []


def test_null_median_of_a_loose_table_is_skipped(tmp_path):
    path = tmp_path / "loose.sqlite"
    loose = sqlite_utils.Database(path)  # an outside tool's table: no NOT NULL constraints
    loose["results"].create(RESULTS_COLUMNS, pk=PK_COLUMNS)
    loose["meta"].insert({"key": "schema_version", "value": "1"}, pk="key")
    loose.close()
    with TuningDB(path) as tdb:
        tdb.record_many([GOOD[0]])
        sql(tdb, "INSERT INTO results (hardware, world_size, op, dtype, bucket, shape, mode, backend, config, "
                 "median_us, created) VALUES (?, 2, 'all_reduce', 'bf16', ?, '', 'eager', 'bad', '{}', NULL, 'x')",
            [HW, 1 << 20])
        with pytest.warns(BadRowWarning, match=r"Row\.median_us is missing \(NULL\)"):
            assert key_rows(tdb, KEY) == [GOOD[0]]


def test_a_bucket_whose_rows_are_all_bad_is_not_offered(tmp_path):
    path, _ = corrupted_file(tmp_path, "bucket", 1 << 22)
    with TuningDB(path) as tdb:
        sql(tdb, "UPDATE results SET config = 'garbage' WHERE bucket = ?", [1 << 22])
        with pytest.warns(BadRowWarning):
            assert key_buckets(tdb, KEY) == [4096, 1 << 20]
        assert key_rows(tdb, Key(HW, 2, "all_reduce", "bf16", 1 << 22)) == []


def test_row_from_dict_validates_and_ignores_extra_columns():
    data = {**make_row().to_dict(), "place": 1, "energy_mj": 2.5}
    assert Row.from_dict(data) == make_row()
    assert Row.from_dict(data).config_obj == AllReduceConfig("one_shot", 2048, 32, 8)
    for change in (dict(config=AR % (1024, 1, 3)), dict(config=b"{}"), dict(median_us=None), dict(median_us="1"),
                   dict(world_size=True), dict(bucket=2.0), dict(p10_us=math.nan), dict(speedup=0.0),
                   dict(trials=-1), dict(created=""), dict(hardware=7)):
        with pytest.raises(ValueError, match=f"Row.{next(iter(change))}"):
            Row.from_dict({**data, **change})
    with pytest.raises(ValueError, match="Row.median_us is missing"):  # not a TypeError
        Row.from_dict({k: v for k, v in data.items() if k != "median_us"})
    assert Row.from_dict({**data, "gpu": None, "p10_us": None}) == make_row(gpu="", p10_us=None)  # NULL: default


# ------------------------------------------------------------------------------ merging


def test_merge_skips_bad_source_rows_and_counts_them(tmp_path):
    source, _ = corrupted_file(tmp_path, "config", "garbage", name="source.sqlite")
    target = tmp_path / "target.sqlite"
    with TuningDB(target) as into:
        into.record_many([make_row(backend="nccl", median_us=25.0, config=None)])  # slower than the source's
    with pytest.warns(BadRowWarning, match="source.sqlite"):
        assert merge_files([source], target) == [MergeCounts(inserted=2, replaced=1, kept=0, skipped=1)]
    assert set(TuningDB(target).rows()) == set(GOOD)


def test_merge_replaces_a_bad_target_row(tmp_path):
    source, target = tmp_path / "source.sqlite", tmp_path / "target.sqlite"
    with TuningDB(source) as tdb:
        tdb.record_many(GOOD)
    with TuningDB(target) as into:
        into.record_many([make_row(backend="nccl", median_us=1.0, config=None)])
        sql(into, "UPDATE results SET median_us = -1.0")
    with pytest.warns(BadRowWarning, match="median_us=-1.0"):
        assert merge_files([source], target) == [MergeCounts(inserted=2, replaced=1, kept=0, skipped=0)]
    assert set(TuningDB(target).rows()) == set(GOOD)


def test_merge_files(tmp_path):
    first, second, target = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "new" / "merged.sqlite"
    with TuningDB(first) as a, TuningDB(second) as b:
        a.record_many(GOOD[:2])
        b.record_many([GOOD[2], make_row(backend="nccl", median_us=15.0, config=None)])
    assert merge_files([first, second], target) == [MergeCounts(2, 0, 0, 0), MergeCounts(1, 1, 0, 0)]
    assert {r.median_us for r in TuningDB(target, readonly=True).rows(backend="nccl")} == {3.0, 15.0}


def broken_source(tmp_path, kind: str):
    path = tmp_path / f"{kind}.sqlite"
    if kind == "junk":
        path.write_bytes(b"not a database\n" * 100)
    elif kind == "newer":
        with TuningDB(path) as tdb:
            tdb.record_many([make_row()])
            sql(tdb, "UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    return path


@pytest.mark.parametrize("kind, error", [("junk", CorruptDatabaseError), ("newer", DatabaseVersionError),
                                         ("missing", FileNotFoundError)])
def test_a_failed_merge_leaves_the_target_as_it_was(tmp_path, kind, error):
    good, bad = tmp_path / "good.sqlite", broken_source(tmp_path, kind)
    with TuningDB(good) as tdb:
        tdb.record_many(GOOD)
    absent = tmp_path / "absent.sqlite"
    with pytest.raises(error):
        merge_files([good, bad], absent)
    assert not absent.exists()  # no new, empty target left behind
    existing, mine = tmp_path / "existing.sqlite", make_row(op="dp_to_ep", bucket=8, shape="d7168_e256_k8",
                                                                    backend="nccl_all_to_all", config=None)
    with TuningDB(existing) as tdb:
        tdb.record_many([mine])
    before = file_sha(existing)
    with pytest.raises(error):
        merge_files([good, bad], existing)
    assert file_sha(existing) == before and TuningDB(existing).rows() == [mine]


def test_a_merge_that_fails_while_writing_removes_the_new_target(tmp_path, monkeypatch):
    source = tmp_path / "source.sqlite"
    with TuningDB(source) as tdb:
        tdb.record_many(GOOD)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(TuningDB, "_merge_rows", fail)
    with pytest.raises(OSError, match="disk full"):
        merge_files([source], tmp_path / "target.sqlite")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source.sqlite"]

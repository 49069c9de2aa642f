"""autosymm.db.store: the tuning database (in-memory and temp-file SQLite, no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlite_utils
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autosymm.db import store as dbmod
from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db.store import SCHEMA_VERSION, Key, MergeCounts, Row, TuningDB
from autosymm.db.schema import MAX_TENSOR_BYTES
from autosymm.problem import DTYPES
from autosymm.db.merge import merge_files

from _db_rows import HW, build_v0, key_buckets, key_rows, make_row, moe_row, run_processes, sql, winner_rows


@pytest.fixture
def db():
    with TuningDB(":memory:") as fresh:
        yield fresh


# ------------------------------------------------------------------------------ rows


def test_round_trip_all_reduce_row(db):
    row = make_row()
    db.record_many([row])
    assert db.rows() == [row]
    assert db.rows()[0].config_obj == AllReduceConfig("one_shot", 2048, 32, 8)
    assert row.speedup == 2.0  # nccl_us / median_us


def test_round_trip_moe_row(db):
    row = moe_row(mode="graph")
    db.record_many([row])
    (back,) = db.rows()
    assert back == row
    assert back.key == Key(HW, 2, "dp_to_ep", "bf16", 256, "d7168_e256_k8", "graph")
    assert back.config_obj == MoEConfig(1024, 4, 2, 132)


def test_config_less_backend_and_missing_measurements(db):
    row = Row(hardware=HW, world_size=8, op="all_reduce", dtype="fp32", bucket=4096, backend="nccl",
              median_us=7.5, config=None)
    db.record_many([row])
    (back,) = db.rows()
    assert back.config == "{}" and back.config_obj is None
    assert back.nccl_us is None and back.speedup is None and back.trials is None
    assert back.created.endswith("+00:00")  # UTC


@pytest.mark.parametrize("change", [
    dict(median_us=0.0), dict(median_us=-1.0), dict(median_us=float("inf")), dict(median_us=float("nan")),
    dict(bucket=0), dict(world_size=0), dict(world_size=2.5), dict(hardware=""), dict(mode=""),
    dict(backend=None), dict(config="[1, 2]"), dict(config="not json"), dict(shape=None),
])
def test_row_rejects_bad_values(change):
    with pytest.raises((TypeError, ValueError)):
        make_row(**change)


def test_record_rejects_unreadable_config_and_writes_nothing(db):
    with pytest.raises(ValueError, match="NoSuchConfig"):  # a config this autosymm cannot read back
        db.record_many([make_row(), make_row(backend="other", config='{"type": "NoSuchConfig"}')])
    assert db.rows() == []


def test_upsert_replaces_same_key_and_backend(db):
    db.record_many([make_row(median_us=10.0)])
    db.record_many([make_row(median_us=30.0, config=AllReduceConfig("one_shot", 1024, 8, 4))])
    (row,) = db.rows()
    assert row.median_us == 30.0 and row.config_obj.num_blocks == 8
    assert len(db) == 1


# ------------------------------------------------------------------------------ lookups


def test_a_keys_rows_fastest_first(db):
    db.record_many([make_row(backend="nccl", median_us=20.0, config=None),
                    make_row(backend="triton_one_shot", median_us=10.0),
                    make_row(backend="torch_two_shot", median_us=15.0, config=None),
                    make_row(backend="nccl", bucket=1 << 21, median_us=1.0, config=None)])
    key = Key(HW, 2, "all_reduce", "bf16", 1 << 20)
    assert [r.backend for r in key_rows(db, key)] == ["triton_one_shot", "torch_two_shot", "nccl"]
    assert key_rows(db, key._replace(mode="graph")) == []
    assert key_rows(db, key._replace(hardware="other")) == []


def test_a_keys_ties_break_by_backend_name(db):
    push = AllReduceConfig("one_shot_push", 2048, 32, 8)
    db.record_many([make_row(backend="triton_one_shot_push", median_us=5.0, config=push),
                    make_row(backend="nccl", median_us=5.0, config=None)])
    assert [r.backend for r in key_rows(db, make_row().key)] == ["nccl", "triton_one_shot_push"]


def test_key_for_problem():
    from autosymm.problem import MoEShape, Problem

    key = Key.for_problem(HW, Problem.moe("dp_to_ep", MoEShape(7168, 256, 8), 200), mode="graph")
    assert key == Key(HW, 2, "dp_to_ep", "bf16", 200, "d7168_e256_k8", "graph")
    assert Key.for_problem(HW, Problem.all_reduce(5000)).bucket == 5000  # the exact size (autosymm.problem)


def test_rows_filters(db):
    db.record_many([make_row(), make_row(dtype="fp16"), moe_row(), make_row(world_size=4)])
    assert len(db.rows()) == 4
    assert {r.dtype for r in db.rows(op="all_reduce", world_size=2)} == {"bf16", "fp16"}
    assert len(db.rows(op=["dp_to_ep", "ep_to_dp"])) == 1
    assert len(db.rows(world_size=(2, 4), dtype=None)) == 4  # None: not filtered
    assert db.rows(op=[]) == []
    assert len(db.rows(gpu="NVIDIA H200", backend="triton_one_shot")) == 3
    with pytest.raises(ValueError, match="median_us"):
        db.rows(median_us=1.0)


def test_buckets_sorted_and_scoped(db):
    db.record_many([make_row(bucket=b) for b in (1 << 22, 4096, 1 << 16)]
                   + [make_row(bucket=1 << 10, dtype="fp16"), moe_row(bucket=64), moe_row(bucket=8)])
    assert key_buckets(db, make_row().key) == [4096, 1 << 16, 1 << 22]
    assert key_buckets(db, moe_row().key) == [8, 64]
    assert key_buckets(db, make_row(mode="graph").key) == []


def test_winners_view_and_function(db):
    db.record_many([make_row(backend="nccl", median_us=20.0, config=None), make_row(median_us=10.0),
                    make_row(backend="nccl", bucket=4096, median_us=3.0, config=None)])
    assert [(r.bucket, r.backend) for r in winner_rows(db)] == [(4096, "nccl"), (1 << 20, "triton_one_shot")]
    sql = "SELECT backend FROM winners WHERE bucket = ?"
    assert [r["backend"] for r in db.db.query(sql, [1 << 20])] == ["triton_one_shot"]  # the file's view agrees


def test_unknown_extra_columns_are_ignored(db):
    db.record_many([make_row()])
    sql(db, "ALTER TABLE results ADD COLUMN energy_mj REAL")
    sql(db, "UPDATE results SET energy_mj = 1.5")
    assert db.rows() == [make_row()]
    db.record_many([make_row(median_us=9.0)])  # the upsert leaves the unknown column alone
    assert db.rows()[0].median_us == 9.0


def test_meta(db):
    assert db.schema_version == SCHEMA_VERSION
    db.set_meta("source", "h200 node 3")
    assert db.meta() == {"schema_version": str(SCHEMA_VERSION), "source": "h200 node 3"}
    with pytest.raises(ValueError):
        db.set_meta("schema_version", "7")


def test_wraps_an_open_sqlite_utils_database():
    raw = sqlite_utils.Database(memory=True)
    tdb = TuningDB(raw)
    tdb.record_many([make_row()])
    assert "results" in raw.table_names() and raw["results"].count == 1


def test_writes_join_a_callers_open_transaction():
    raw = sqlite_utils.Database(memory=True)
    tdb = TuningDB(raw)
    raw.conn.execute("BEGIN")
    tdb.record_many([make_row()])
    assert len(tdb) == 1
    raw.conn.execute("ROLLBACK")  # the caller's rollback takes the row with it
    assert len(tdb) == 0


def test_values_are_data_not_sql(db):
    sneaky = "x'); DROP TABLE results; --"
    db.record_many([make_row(hardware=sneaky, gpu='b" OR 1=1 --')])
    assert [r.hardware for r in db.rows()] == [sneaky] and db.rows(gpu='b" OR 1=1 --')[0].hardware == sneaky
    assert db.rows(gpu="%") == [] and db.rows(hardware="%") == []


def test_schema_is_documented():
    """Every column, table and view is in the store's design notes (docs/DISPATCH.md, the
    section the module's docstring points to)."""
    from pathlib import Path

    assert "docs/DISPATCH.md" in dbmod.__doc__
    notes = (Path(__file__).resolve().parent.parent / "docs" / "DISPATCH.md").read_text()
    section = notes[notes.index("`autosymm/db/store.py`"):]
    for column in dbmod.ROW_FIELDS + ("meta", "winners", "schema_version"):
        assert column in section, column


# ------------------------------------------------------------------------------ merge, export, digest


def test_merge_keeps_the_faster_row_and_never_loses_others(tmp_path):
    target, other_path = tmp_path / "target.sqlite", tmp_path / "other.sqlite"
    with TuningDB(target) as db:
        db.record_many([make_row(backend="nccl", median_us=10.0, config=None),
                        make_row(backend="torch_one_shot", median_us=10.0, config=None),
                        make_row(backend="torch_two_shot", median_us=50.0, config=None)])
    with TuningDB(other_path) as other:
        other.record_many([make_row(backend="nccl", median_us=5.0, config=None),  # better: replaces
                           make_row(backend="torch_one_shot", median_us=20.0, config=None),  # worse: kept
                           moe_row()])  # new key: inserted
    assert merge_files([other_path], target) == [MergeCounts(inserted=1, replaced=1, kept=1, skipped=0)]
    with TuningDB(target, readonly=True) as db:
        assert {r.backend: r.median_us for r in db.rows(op="all_reduce")} == \
            {"nccl": 5.0, "torch_one_shot": 10.0, "torch_two_shot": 50.0}
        assert db.rows(op="dp_to_ep") == [moe_row()]
    assert merge_files([other_path], target) == [(0, 0, 3, 0)]  # again: nothing changes


def test_export_subset(db, tmp_path):
    db.record_many([make_row(), make_row(hardware="other-hw"), moe_row()])
    db.set_meta("note", "from node 7")
    out = tmp_path / "shipped" / f"{HW}-x2.sqlite"
    assert db.export(out, hardware=HW) == 2
    with TuningDB(out, readonly=True) as shipped:
        assert shipped.rows() == db.rows(hardware=HW)
        assert shipped.meta()["note"] == "from node 7"
        assert shipped.db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # readable from a ro dir
    with pytest.raises(FileExistsError):
        db.export(out)
    assert db.export(out, overwrite=True, op="dp_to_ep") == 1
    assert len(TuningDB(out, readonly=True)) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temp files left
    with pytest.raises(ValueError):
        db.export(tmp_path / "never.sqlite", nope=1)
    assert not (tmp_path / "never.sqlite").exists()


def test_export_onto_itself_is_refused(tmp_path):
    path = tmp_path / "t.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
        with pytest.raises(ValueError):
            tdb.export(path, overwrite=True)


def test_digest_is_order_file_and_provenance_independent(db, tmp_path):
    rows = [make_row(bucket=1 << k, median_us=float(k)) for k in range(12, 20)] + [moe_row()]
    db.record_many(rows)
    with TuningDB(tmp_path / "d.sqlite") as other:
        other.record_many(reversed([r.__class__(**{**r.to_dict(), "created": "2030-01-01T00:00:00+00:00",
                                                   "torch_version": "9.9"}) for r in rows]))
        assert other.digest() == db.digest()
        assert other.digest(op="dp_to_ep") == db.digest(op="dp_to_ep") != db.digest()
        other.record_many([make_row(bucket=1 << 12, median_us=12.5)])  # a value changes: the digest too
        assert other.digest() != db.digest()
        other.record_many([make_row(bucket=1 << 12, median_us=12.0, config=AllReduceConfig("one_shot", 1024, 8, 4))])
        assert other.digest() != db.digest()  # same time, other config
    assert TuningDB().digest() == TuningDB().digest()


# ------------------------------------------------------------------------------ concurrency


N_OWN, N_SHARED = 60, 20


def _writer(path: str, worker: int) -> None:
    tdb = TuningDB(path)  # every worker also races to create the schema of the fresh file
    own = [make_row(hardware=f"w{worker}", bucket=1 << (k % 30) if k < 30 else 4096 + k, median_us=1.0 + k)
           for k in range(N_OWN)]
    for start in range(0, N_OWN - 10, 10):
        tdb.record_many(own[start:start + 10])
    for row in own[N_OWN - 10:]:
        tdb.record_many([row])
    for k in range(N_SHARED):  # every worker writes these keys: the last writer wins, none is lost
        tdb.record_many([make_row(hardware="shared", bucket=1 << (k + 12), median_us=1.0 + worker)])
    tdb.close()


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.sqlite"
    assert run_processes(_writer, path, 4) == [0, 0, 0, 0]
    with TuningDB(path, readonly=True) as tdb:
        assert tdb.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert len(tdb) == 4 * N_OWN + N_SHARED
        for w in range(4):
            assert len(tdb.rows(hardware=f"w{w}")) == N_OWN
        assert {r.median_us for r in tdb.rows(hardware="shared")} <= {1.0, 2.0, 3.0, 4.0}


def _opener(path: str, worker: int) -> None:
    with TuningDB(path) as tdb:
        tdb.record_many([make_row(hardware=f"w{worker}")])


def test_concurrent_openers_migrate_an_old_file_once(tmp_path):
    path = tmp_path / "old.sqlite"
    build_v0(path)
    assert run_processes(_opener, path, 4) == [0, 0, 0, 0]
    with TuningDB(path, readonly=True) as tdb:
        assert tdb.schema_version == SCHEMA_VERSION and len(tdb) == 5
        assert tdb.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


# ------------------------------------------------------------------------------ locating


def test_user_db_path(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "mine.sqlite"))
    assert dbmod.user_db_path() == tmp_path / "mine.sqlite"
    monkeypatch.delenv("AUTOSYMM_DB")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert dbmod.user_db_path() == tmp_path / "cache" / "autosymm" / "tuning.sqlite"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert dbmod.user_db_path() == Path.home() / ".cache" / "autosymm" / "tuning.sqlite"


def test_shipped_databases(monkeypatch, tmp_path):
    assert dbmod.shipped_db_dir() is not None and dbmod.shipped_db_dir().name == "tuning_db"
    monkeypatch.setattr(dbmod, "shipped_db_dir", lambda: tmp_path)
    (tmp_path / "b-hw-x2.sqlite").touch()
    (tmp_path / "a-hw-x8.sqlite").touch()
    (tmp_path / "README.md").touch()
    assert [p.name for p in dbmod.shipped_db_paths()] == ["a-hw-x8.sqlite", "b-hw-x2.sqlite"]
    assert dbmod.shipped_db_for("a-hw-x8") == tmp_path / "a-hw-x8.sqlite"
    assert dbmod.shipped_db_for("c-hw-x2") is None
    for bad in ("../etc/passwd", "a/b", "", ".hidden"):
        with pytest.raises(ValueError):
            dbmod.shipped_db_for(bad)


# ------------------------------------------------------------------------------ properties

_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
_time = st.floats(min_value=1e-3, max_value=1e7, allow_nan=False, allow_infinity=False)
_algorithms = st.sampled_from(["one_shot", "two_shot", "multimem"])
_all_reduce = st.one_of(
    st.tuples(st.just("all_reduce"), st.sampled_from(["nccl", "nccl_symm"]), st.none()),
    _algorithms.flatmap(lambda algorithm: st.tuples(
        st.just("all_reduce"), st.just(f"triton_{algorithm}"),
        st.builds(AllReduceConfig, st.just(algorithm), st.sampled_from([1024, 4096]), st.integers(1, 256),
                  st.sampled_from([4, 8, 32])))))
_moe = st.tuples(st.sampled_from(["dp_to_ep", "ep_to_dp"]), st.just("triton_moe"), st.builds(
    MoEConfig, st.sampled_from([1024, 2048]), st.sampled_from([1, 4, 16]), st.integers(1, 64), st.integers(0, 4096)))
_moe_shapes = st.sampled_from(["d7168_e256_k8", "d2048_e128_k8", "d1_e1_k1"])


def _row(op_backend_config, moe_shape, bucket, **fields):
    """A valid row: a backend serving the op with a config of its algorithm, the op's kind of
    shape, a bucket inside the bound (tokens of MoE rows scaled down to fit)."""
    op, backend, config = op_backend_config
    shape = moe_shape if op != "all_reduce" else ""
    if shape:
        bucket = max(1, bucket // (int(shape.split("_")[0][1:]) * DTYPES[fields["dtype"]].itemsize))
    return Row(op=op, backend=backend, config=config, shape=shape, bucket=bucket, **fields)


_rows = st.builds(
    _row, _all_reduce | _moe, _moe_shapes, st.integers(1, MAX_TENSOR_BYTES), hardware=_text,
    gpu=st.text(max_size=8), world_size=st.integers(1, 8), dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
    mode=st.sampled_from(["eager", "graph"]), median_us=_time, p10_us=st.none() | _time, p90_us=st.none() | _time,
    nccl_us=st.none() | _time, trials=st.none() | st.integers(0, 10**6), torch_version=st.none() | _text,
    nccl_version=st.none() | st.sampled_from(["2.28.9", "2.29.7", "2.27"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_rows, max_size=8, unique_by=lambda r: r.pk))
def test_property_round_trip(rows):
    with TuningDB() as tdb:
        tdb.record_many(rows)
        back = tdb.rows()
        assert sorted(back, key=lambda r: r.pk) == sorted(rows, key=lambda r: r.pk)
        with TuningDB() as reordered:
            reordered.record_many(reversed(rows))
            assert reordered.digest() == tdb.digest()
        for row in rows:  # a key's rows as the dispatcher reads them: fastest first, ties by backend
            same_key = sorted((r for r in rows if r.key == row.key), key=lambda r: (r.median_us, r.backend))
            assert key_rows(tdb, row.key) == same_key

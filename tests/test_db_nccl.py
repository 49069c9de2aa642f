"""Rows know which NCCL they beat: every row records ``nccl_version`` (schema 3; older files read it
as NULL), and under a running NCCL of another major.minor one rule (autosymm.db.schema.nccl_trust)
says which rows stay trusted, used by the dispatcher and so by `autosymm explain`, and logged
once per group (temp-file SQLite; CliRunner)."""

from __future__ import annotations

import logging
import sqlite3

import pytest
import torch
from click.testing import CliRunner

from autosymm.runtime import dispatch
from autosymm import hardware
from autosymm.backends import Capabilities
from autosymm.cli.main import main
from autosymm.db.store import BadRowWarning, TuningDB
from autosymm.db.read import DBSource, open_sources
from autosymm.db.schema import NCCL_TRUST_MARGIN, PROVENANCE_COLUMNS, nccl_trust
from autosymm.problem import Problem

from _db_rows import HW, file_sha, make_row, moe_row, sql
from test_db_schema import RELEASED_V2

CAPS = Capabilities(world_size=2, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, has_multicast=False,
                    intra_node=True, torch_symm_ops=True, compute_capability=(9, 0))
MEASURED = "2.28.9"


def rows_beating_nccl_by(speedup: float) -> list:
    """A Triton row at 1 MiB that beat its NCCL 2.28.9 by ``speedup``, and NCCL's own row."""
    return [make_row(median_us=20.0 / speedup, nccl_us=20.0, nccl_version=MEASURED),
            make_row(backend="nccl", config=None, median_us=20.0, nccl_us=20.0, nccl_version=MEASURED)]


def decide_under(monkeypatch, running: str, rows):
    monkeypatch.setattr(dispatch, "nccl_version", lambda: running)
    with TuningDB() as tdb:
        tdb.record_many(rows)
        return dispatch.decide(Problem.all_reduce(1 << 20), "eager", CAPS, [DBSource(tdb)], HW)


# ------------------------------------------------------------------------------ recording


@pytest.mark.parametrize("answer, text", [((2, 28, 9), "2.28.9"), ((2, 29, 7, "x"), "2.29.7"), (22809, "2.28.9"),
                                          (2708, "2.7.8"), (None, ""), ("2.28.9", "")])
def test_the_running_nccl_as_torch_reports_it(monkeypatch, answer, text):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: answer)
    hardware.nccl_version.cache_clear()
    try:
        assert hardware.nccl_version() == text
    finally:
        hardware.nccl_version.cache_clear()


def test_a_cpu_build_has_no_running_nccl(monkeypatch):
    def no_nccl():
        raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")

    monkeypatch.setattr(torch.cuda.nccl, "version", no_nccl)
    hardware.nccl_version.cache_clear()
    try:
        assert hardware.nccl_version() == ""
        assert hardware.provenance(hardware.cpu_fingerprint())["nccl_version"] == ""
    finally:
        hardware.nccl_version.cache_clear()
    row = make_row(nccl_version="")  # what the tuner writes then: not recorded
    assert row.nccl_version is None and nccl_trust(row, "2.29.7") == (True, "")


def test_the_tuner_records_the_nccl_of_its_run(monkeypatch):
    monkeypatch.setattr(hardware, "nccl_version", lambda: MEASURED)
    prov = hardware.provenance(hardware.cpu_fingerprint())
    assert "nccl_version" in PROVENANCE_COLUMNS and prov["nccl_version"] == MEASURED
    with TuningDB() as tdb:
        tdb.record_many([make_row(**{c: prov[c] for c in PROVENANCE_COLUMNS})])
        assert tdb.rows()[0].nccl_version == MEASURED


def test_version_2_files_read_with_the_nccl_unknown_and_migrate(tmp_path):
    path = tmp_path / "v2.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript(RELEASED_V2)
        conn.execute("INSERT INTO results (hardware, gpu, world_size, op, dtype, bucket, mode, backend, config, "
                     "median_us, nccl_us, created) VALUES (?, 'NVIDIA H200', 2, 'all_reduce', 'bf16', 4096, 'eager', "
                     "'triton_one_shot', ?, 5.0, 6.0, '2026-11-30T00:00:00+00:00')",
                     [HW, make_row().config])
    conn.close()
    before = file_sha(path)
    with TuningDB(path, readonly=True) as tdb:  # shipped: migrated in memory only
        (old,) = tdb.rows()
        assert old.nccl_version is None and nccl_trust(old, "2.29.7") == (True, "")  # unknown: no check
    assert file_sha(path) == before
    with TuningDB(path) as tdb:
        tdb.record_many([make_row(nccl_version="2.29.7")])
        assert {r.bucket: r.nccl_version for r in tdb.rows()} == {4096: None, 1 << 20: "2.29.7"}


def test_a_malformed_nccl_version_is_a_bad_row():
    with pytest.raises(ValueError, match="Row.nccl_version='2.28.9; DROP'"):
        make_row(nccl_version="2.28.9; DROP")
    with TuningDB() as tdb:
        tdb.record_many([make_row()])
        sql(tdb, "UPDATE results SET nccl_version = 'latest'")
        with pytest.warns(BadRowWarning, match="Row.nccl_version='latest'"):
            assert tdb.rows() == []


# ------------------------------------------------------------------------------ the trust rule


@pytest.mark.parametrize("running, speedup, trusted, said", [
    ("", 1.1, True, ""),  # no running NCCL (CPU build): no check
    (None, 1.1, True, ""),
    ("2.28.3", 1.1, True, ""),  # same major.minor
    ("2.28", 1.1, True, ""),
    ("2.29.7", 1.1, False, "only 1.10x over that NCCL (< 1.5x)"),
    ("2.29.7", 1.49, False, "only 1.49x"),
    ("2.29.7", NCCL_TRUST_MARGIN, True, "kept, 1.50x over that NCCL >= 1.5x"),
    ("2.27.3", 3.0, True, "kept, 3.00x"),
    ("3.0.0", 1.2, False, "measured with NCCL 2.28.9, running 3.0.0"),
])
def test_the_trust_rule(running, speedup, trusted, said):
    row = make_row(median_us=20.0 / speedup, nccl_us=20.0, nccl_version=MEASURED)
    ok, note = nccl_trust(row, running)
    assert ok is trusted and said in note and (note == "") == (said == "")


def test_nccls_own_rows_and_rows_without_an_nccl_time_stay():
    nccl = make_row(backend="nccl", config=None, median_us=25.0, nccl_us=20.0, nccl_version=MEASURED)
    assert nccl_trust(nccl, "2.29.7") == (True, "measured with NCCL 2.28.9, running 2.29.7: the NCCL baseline itself")
    graph_moe = moe_row(mode="graph", nccl_us=None, speedup=None, nccl_version=MEASURED)  # NCCL cannot capture it
    trusted, note = nccl_trust(graph_moe, "2.29.7")
    assert trusted and "no NCCL time in its run" in note


def test_dispatch_passes_over_a_row_with_a_thin_margin_and_says_why(monkeypatch):
    decision = decide_under(monkeypatch, "2.29.7", rows_beating_nccl_by(1.2))
    assert decision.backend == "nccl"
    assert any("triton_one_shot: measured with NCCL 2.28.9, running 2.29.7: only 1.20x over that NCCL (< 1.5x)" in s
               for s in decision.skipped), decision.skipped
    assert "the NCCL baseline itself" in decision.reason


def test_dispatch_keeps_a_row_with_a_wide_margin_and_names_both_versions(monkeypatch):
    decision = decide_under(monkeypatch, "2.29.7", rows_beating_nccl_by(2.0))
    assert decision.backend == "triton_one_shot"
    assert "measured with NCCL 2.28.9, running 2.29.7: kept, 2.00x over that NCCL >= 1.5x" in decision.reason
    for running in ("2.28.1", ""):  # the same major.minor, or no NCCL: nothing to say, the row serves
        same = decide_under(monkeypatch, running, rows_beating_nccl_by(1.2))
        assert same.backend == "triton_one_shot" and "NCCL 2.28.9" not in same.reason


def test_explain_names_the_mismatch_and_the_margin(monkeypatch, tmp_path):
    path = tmp_path / "tuned.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many(rows_beating_nccl_by(1.2) + [
            make_row(bucket=4096, median_us=5.0, nccl_us=20.0, nccl_version=MEASURED),
            make_row(bucket=4096, backend="nccl", config=None, median_us=20.0, nccl_us=20.0, nccl_version=MEASURED)])
    monkeypatch.setattr(dispatch, "nccl_version", lambda: "2.29.7")
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    runner = CliRunner()
    thin = runner.invoke(main, ["explain", "--bytes", "1MiB", "--world-size", "2", "--gpu", "NVIDIA H200",
                                "--db", str(path), "--mode", "eager"])
    assert thin.exit_code == 0, thin.output
    assert "(nvidia-h200-nvlink): nccl," in thin.stdout
    assert "skipped triton_one_shot: measured with NCCL 2.28.9, running 2.29.7: only 1.20x" in thin.stdout
    wide = runner.invoke(main, ["explain", "--bytes", "4KiB", "--world-size", "2", "--gpu", "NVIDIA H200",
                                "--db", str(path), "--mode", "eager"])
    assert wide.exit_code == 0, wide.output
    assert "triton_one_shot [" in wide.stdout and "running 2.29.7: kept, 4.00x over that NCCL" in wide.stdout


def test_the_group_set_up_logs_the_mismatch_once_with_what_the_rule_does(monkeypatch, tmp_path, caplog):
    import autosymm.db.read as db_read

    path = tmp_path / "tuned.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many(rows_beating_nccl_by(1.2) + [make_row(bucket=4096, median_us=5.0, nccl_us=20.0,
                                                              nccl_version=MEASURED)])
    monkeypatch.setattr(db_read, "nccl_version", lambda: "2.29.7")
    with caplog.at_level(logging.WARNING, logger="autosymm"):
        open_sources(None, [path])
    (record,) = [r for r in caplog.records if "NCCL" in r.getMessage()]
    assert (f"{path}: 3 of 3 rows were measured with NCCL 2.28.9, this process runs NCCL 2.29.7: rows that beat "
            f"that NCCL by >= 1.5x (and NCCL's own) stay, 1 others are passed over") in record.getMessage()
    caplog.clear()
    monkeypatch.setattr(db_read, "nccl_version", lambda: "2.28.4")
    with caplog.at_level(logging.WARNING, logger="autosymm"):
        open_sources(None, [path])
    assert not [r for r in caplog.records if "NCCL" in r.getMessage()]


def test_the_ranks_agree_on_the_running_nccl(monkeypatch):
    from autosymm.runtime.group import LocalSetup

    monkeypatch.setattr(hardware, "nccl_version", lambda: "2.29.7")
    setup = LocalSetup(torch.device("cpu"), 1)
    assert setup.report["ok"], setup.report["error"]
    assert setup.report["settings"]["nccl_version"] == "2.29.7"  # a rank with another NCCL: all take NCCL

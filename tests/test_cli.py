"""Every CLI command through click's CliRunner (no GPU here)."""

import hashlib
import json
import logging
import os
import sqlite3
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from autosymm import spec
from autosymm.db import open as db_open
from autosymm.cli.main import main
from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db.store import Row, TuningDB

HW = "nvidia-h200-nvlink"


def _rows():
    out = []
    for bucket, us in ((4096, 5.0), (1 << 20, 9.0)):
        out.append(Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce", dtype="bf16", bucket=bucket,
                       backend="triton_one_shot", median_us=us, config=AllReduceConfig("one_shot", 2048, 4, 8),
                       nccl_us=20.0, mode="eager"))
        out.append(Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce", dtype="bf16", bucket=bucket,
                       backend="nccl", median_us=20.0, config=None, nccl_us=20.0, mode="eager"))
    out.append(Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="dp_to_ep", dtype="bf16", bucket=128,
                   shape="d7168_e256_k8", backend="triton_moe", median_us=30.0, config=MoEConfig(1024, 4),
                   nccl_us=300.0, mode="eager"))
    return out


@pytest.fixture
def db_file(tmp_path):
    path = tmp_path / "tuned.sqlite"
    TuningDB(path).record_many(_rows())
    return path


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    return CliRunner()


def test_every_command_is_documented_in_the_cli_doc():
    """docs/CLI.md's table has a row per command (the README links it)."""
    doc = (Path(__file__).parent.parent / "docs" / "CLI.md").read_text()
    commands = set(main.commands) | {f"db {c}" for c in main.commands["db"].commands}
    commands.discard("db")
    for command in commands:
        assert f"| `autosymm {command}` |" in doc, command


def test_explain_one_call_from_a_db(runner, db_file):
    result = runner.invoke(main, ["explain", "--op", "all_reduce", "--bytes", "3KiB", "--world-size", "2",
                                  "--gpu", "NVIDIA H200", "--db", str(db_file), "--mode", "eager"])
    assert result.exit_code == 0, result.output
    assert "triton_one_shot [algorithm=one_shot, block_size=2048, num_blocks=4, num_warps=8]" in result.output
    assert "[eager]" in result.output and "5.00 us" in result.output and "4.00x" in result.output


def test_explain_falls_back_without_rows(runner, db_file):
    result = runner.invoke(main, ["explain", "--bytes", "1MiB", "--world-size", "4", "--gpu", "NVIDIA H200",
                                  "--db", str(db_file)])
    assert result.exit_code == 0, result.output
    assert "nccl" in result.output and "no tuned row" in result.output


def test_explain_plan_over_all_sizes(runner, db_file):
    result = runner.invoke(main, ["explain", "--world-size", "2", "--gpu", "NVIDIA H200", "--all", "--db", str(db_file)])
    assert result.exit_code == 0, result.output
    assert "256MiB" in result.output and "triton_one_shot" in result.output


def test_explain_moe(runner, db_file):
    result = runner.invoke(main, ["explain", "--op", "dp_to_ep", "--shape", "deepseek-v3", "--tokens", "100",
                                  "--world-size", "2", "--gpu", "NVIDIA H200", "--db", str(db_file), "--mode", "eager"])
    assert result.exit_code == 0, result.output
    assert "triton_moe" in result.output and "10.00x" in result.output


def test_explain_the_fused_op(runner, tmp_path):
    from autosymm.backends.triton_fused import fused_space
    from autosymm.configs import FusedConfig

    path = tmp_path / "fused.sqlite"
    config = fused_space("one_shot_push", 64, 8192, 2, 2)[0]
    assert isinstance(config, FusedConfig)
    TuningDB(path).record_many([
        Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=64,
            shape="h8192", backend="triton_fused_one_shot_push", median_us=12.0, config=config,
            nccl_us=36.0, mode="graph"),
        Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=64,
            shape="h8192", backend="nccl_fused", median_us=36.0, config=None, nccl_us=36.0, mode="graph")])
    args = ["explain", "--op", "all_reduce_rmsnorm", "--world-size", "2", "--gpu", "NVIDIA H200", "--db", str(path),
            "--mode", "graph"]
    result = runner.invoke(main, args + ["--hidden", "8192", "--tokens", "64"])
    assert result.exit_code == 0, result.output
    assert "h8192 tokens/rank=64 [graph]" in result.output and "triton_fused_one_shot_push" in result.output
    assert "3.00x" in result.output
    result = runner.invoke(main, args + ["--hidden", "4096", "--tokens", "64"])  # no row for that hidden size
    assert result.exit_code == 0 and "nccl_fused" in result.output and "no tuned row" in result.output
    result = runner.invoke(main, args + ["--all"])
    assert result.exit_code == 0 and "h8192 64 tok" in result.output and "h4096 1 tok" in result.output
    result = runner.invoke(main, args + ["--tokens", "64"])
    assert result.exit_code == 2 and "--hidden" in result.output


def test_explain_bad_arguments(runner, db_file):
    assert runner.invoke(main, ["explain", "--world-size", "2", "--db", str(db_file)]).exit_code != 0
    result = runner.invoke(main, ["explain", "--op", "dp_to_ep", "--world-size", "2", "--tokens", "4"])
    assert result.exit_code != 0 and "--shape" in result.output


@pytest.mark.parametrize("shape, message", [("bogus", "'bogus': 'bogus' is not a MoE shape key"), (",", "no MoE shape in ','"),
                                            ("deepseek-v3,mixtral-8x7b", "is not one MoE shape")])
def test_explain_shape_errors_name_the_shape_option(runner, shape, message):
    line = one_line_error(runner.invoke(main, ["explain", "--op", "dp_to_ep", "--shape", shape, "--tokens", "4",
                                               "--world-size", "2"]), 2)
    assert "Invalid value for --shape: " in line and "--shapes" not in line and message in line, line


def test_show_table_and_json(runner, db_file):
    result = runner.invoke(main, ["show", "--db", str(db_file), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {r["backend"] for r in rows} == {"triton_one_shot", "triton_moe"}  # winners only
    ar = next(r for r in rows if r["op"] == "all_reduce" and r["size_bytes"] == 4096)
    assert ar["us"] == 5.0 and ar["nccl_us"] == 20.0 and ar["speedup"] == 4.0 and ar["config"]["block_size"] == 2048
    assert set(ar) >= {"gpu", "world_size", "op", "dtype", "size_bytes", "mode", "backend", "config", "us",
                       "nccl_us", "speedup", "nccl_version"}
    moe = next(r for r in rows if r["op"] == "dp_to_ep")
    assert moe["shape"] == "d7168_e256_k8"
    every = json.loads(runner.invoke(main, ["show", "--db", str(db_file), "--json", "--all"]).output)
    assert len(every) == 5
    table = runner.invoke(main, ["show", "--db", str(db_file)])
    assert table.exit_code == 0 and "triton_one_shot" in table.output


def test_db_merge_and_export(runner, db_file, tmp_path):
    target = tmp_path / "merged.sqlite"
    result = runner.invoke(main, ["db", "merge", str(db_file), "--into", str(target)])
    assert result.exit_code == 0, result.output
    assert "5 new" in result.output
    assert len(TuningDB(target, readonly=True).rows()) == 5
    out = tmp_path / "export.sqlite"
    result = runner.invoke(main, ["db", "export", str(out), "--db", str(target), "--hardware", HW])
    assert result.exit_code == 0 and "exported 5 rows" in result.output
    again = runner.invoke(main, ["db", "export", str(out), "--db", str(target)])
    assert again.exit_code != 0  # refuses to overwrite


def test_tune_and_bench_refuse_without_gpu(runner, tmp_path):
    result = runner.invoke(main, ["tune"])
    assert result.exit_code != 0 and "needs CUDA GPUs" in result.output
    assert not (tmp_path / "user.sqlite").exists()
    result = runner.invoke(main, ["bench"])
    assert result.exit_code != 0 and "needs CUDA GPUs" in result.output


def test_run_without_gpu_says_what_this_machine_runs_what_is_shipped_and_what_next(runner, db_file, monkeypatch):
    import autosymm.db.store as dbmod

    monkeypatch.setattr(dbmod, "shipped_db_paths", lambda: [db_file])
    result = runner.invoke(main, ["run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 120, result.output
    assert lines[0].startswith("autosymm run: no CUDA GPU here, so nothing was tuned")
    assert "hardware cpu (untuned: every call takes its op's fallbacks)" in lines[1]
    decided = {line.split()[0]: line for line in lines if line.startswith("  ") and not line.strip().startswith(
        ("autosymm", HW))}
    assert list(decided) == list(spec.names())  # one representative call per registered op, decided here
    assert decided["all_reduce"].split()[-1] == "nccl" and "all_reduce 1MiB" in decided["all_reduce"]
    assert decided["dp_to_ep"].endswith("triton_moe (its untuned default config)")  # the direct call's default
    assert f"  {HW} (NVIDIA H200): world size 2; all_reduce, dp_to_ep; 5 rows" in lines
    assert any(line.startswith('  autosymm explain --gpu "NVIDIA H200" --world-size 2 --all') for line in lines)
    assert any(line.startswith("  autosymm explain --op all_reduce --bytes 1MiB --world-size 2") for line in lines)
    assert any(line.startswith("  autosymm tune ") and "GPU node" in line for line in lines)


def test_run_without_gpu_fits_a_screen_with_the_shipped_databases(runner):
    result = runner.invoke(main, ["run"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 120, result.output
    assert "nvidia-h200-nvlink (NVIDIA H200): world size 2" in result.output and "│" not in result.output


def test_info(runner):
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0 and "hardware_slug" in result.output and "user_db" in result.output


def test_tune_backends_option_names_known_backends_and_keeps_the_baselines():
    import click

    from autosymm.cli.main import _parse_backends

    assert _parse_backends(None) is None and _parse_backends("") is None
    # the fallbacks are every row's baseline: always measured
    fallbacks = ["nccl_all_to_all", "nccl_fused", "nccl_reduce_scatter", "nccl_all_gather"]
    assert _parse_backends("triton_one_shot_push") == ["triton_one_shot_push", "nccl", *fallbacks]
    assert _parse_backends("nccl, triton_moe") == ["nccl", "triton_moe", *fallbacks]
    with pytest.raises(click.BadParameter, match="unknown backend.*triton_three_shot.*known: nccl"):
        _parse_backends("triton_three_shot")



# ------------------------------------------------------------------ errors: one line, no traceback


def one_line_error(result, exit_code: int) -> str:
    """The one stderr line of a failed command (exit code ``exit_code``, no traceback)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == exit_code, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("args, names", [
    (["explain", "--op", "dp_to_ep", "--shape", "a,b", "--tokens", "4", "--world-size", "2"], ["--shape", "'a'"]),
    (["explain", "--op", "dp_to_ep", "--shape", "deepseek-v3,mixtral-8x7b", "--tokens", "4", "--world-size", "2"],
     ["--shape", "not one MoE shape"]),
    (["explain", "--bytes", "1XB", "--world-size", "2"], ["--bytes", "'1XB'"]),
    (["explain", "--bytes", "1MiB", "--world-size", "0"], ["--world-size"]),
    (["explain", "--bytes", "1MiB", "--world-size", "2", "--dtype", "int8"], ["--dtype", "int8"]),
    (["explain", "--op", "dp_to_ep", "--shape", "deepseek-v3", "--tokens", "0", "--world-size", "2"], ["--tokens"]),
    (["explain", "--world-size", "two"], ["--world-size"]),
    (["bench", "--shapes", "a,b"], ["--shapes", "'a'"]),
    (["bench", "--sizes", "1XB"], ["--sizes", "'1XB'"]),
    (["show", "--db", "/nonexistent/x.sqlite"], ["--db", "/nonexistent/x.sqlite"]),
    (["db", "merge", "--into", "x.sqlite"], ["SOURCES"]),
    (["frobnicate"], ["frobnicate"]),
    (["--frobnicate"], ["--frobnicate"]),
])
def test_usage_errors_are_one_line_with_exit_code_2(runner, args, names):
    line = one_line_error(runner.invoke(main, args), 2)
    for name in names:
        assert name in line, line
    assert "--help" in line


@pytest.fixture
def garbage_file(tmp_path):
    path = tmp_path / "garbage.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    return path


def test_show_and_export_of_a_corrupt_database(runner, garbage_file, tmp_path):
    for args in (["show", "--db", str(garbage_file)], ["db", "export", str(tmp_path / "out.sqlite"), "--db", str(garbage_file)]):
        line = one_line_error(runner.invoke(main, args), 1)
        assert "garbage.sqlite is not a readable SQLite database" in line
    assert not (tmp_path / "out.sqlite").exists()


def test_export_refuses_to_overwrite_in_one_line(runner, db_file, tmp_path):
    out = tmp_path / "out.sqlite"
    out.write_text("keep me")
    line = one_line_error(runner.invoke(main, ["db", "export", str(out), "--db", str(db_file)]), 1)
    assert "exists" in line and out.read_text() == "keep me"


def test_failed_merge_creates_no_target_and_keeps_an_existing_one(runner, db_file, garbage_file, tmp_path):
    new = tmp_path / "new.sqlite"
    line = one_line_error(runner.invoke(main, ["db", "merge", str(db_file), str(garbage_file), "--into", str(new)]), 1)
    assert "garbage.sqlite" in line
    assert not new.exists() and not Path(f"{new}-journal").exists()
    # a corrupt target is left as it was
    before = _sha(garbage_file)
    line = one_line_error(runner.invoke(main, ["db", "merge", str(db_file), "--into", str(garbage_file)]), 1)
    assert "garbage.sqlite" in line and _sha(garbage_file) == before


def test_merge_skips_and_reports_bad_rows(runner, db_file, tmp_path):
    with TuningDB(db_file) as tdb:  # what a bug or a hand edit might leave
        tdb.db.conn.execute("UPDATE results SET config = 'not json' WHERE bucket = 4096 AND backend = 'triton_one_shot'")
        tdb.db.conn.execute("UPDATE results SET median_us = -1 WHERE op = 'dp_to_ep'")
        tdb.db.conn.commit()
    target = tmp_path / "merged.sqlite"
    result = runner.invoke(main, ["db", "merge", str(db_file), "--into", str(target)])
    assert result.exit_code == 0, result.output
    assert "3 new" in result.stdout and "2 bad rows skipped" in result.stdout
    warned = result.stderr.splitlines()
    assert len(warned) == 2 and all(w.startswith("Warning: autosymm: skipping a bad row") for w in warned), warned
    assert "bucket=4096" in warned[0] + warned[1] and "dp_to_ep" in warned[0] + warned[1]
    with TuningDB(target, readonly=True) as merged:
        assert len(merged) == 3 and {r.backend for r in merged.rows()} == {"triton_one_shot", "nccl"}


def test_show_explain_and_info_give_one_verdict_on_an_unusable_database(runner, tmp_path, monkeypatch):
    from test_db_untrusted import hostile_file

    for kind in ("random", "future", "empty"):
        path = hostile_file(tmp_path, kind)
        shown = one_line_error(runner.invoke(main, ["show", "--db", str(path)]), 1)
        explained = one_line_error(runner.invoke(main, ["explain", "--bytes", "1MiB", "--world-size", "2",
                                                        "--gpu", "NVIDIA H200", "--db", str(path)]), 1)
        assert shown == explained and str(path) in shown
        monkeypatch.setenv("AUTOSYMM_DB", str(path))
        info = runner.invoke(main, ["info"])
        assert info.exit_code == 0 and f"{path} (unusable: {shown[len('Error: '):]})" in " ".join(info.output.split())
        assert one_line_error(runner.invoke(main, ["show"]), 1) == shown  # the user DB by default, the same


def test_info_says_which_databases_are_usable(runner, db_file, monkeypatch):
    assert "(absent)" in runner.invoke(main, ["info"]).output
    monkeypatch.setenv("AUTOSYMM_DB", str(db_file))
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0 and f"{db_file} (usable)" in " ".join(result.output.split())


def test_show_of_a_spinning_winners_view_ends_with_the_right_winners(runner, tmp_path):
    from test_db_untrusted import spinning_view_file

    start = time.monotonic()
    result = runner.invoke(main, ["show", "--db", str(spinning_view_file(tmp_path)), "--json"])
    assert result.exit_code == 0, result.output
    assert [r["backend"] for r in json.loads(result.stdout)] == ["triton_one_shot"]
    assert time.monotonic() - start < 5.0


def test_show_merge_and_export_of_a_locked_database_say_so_within_seconds(runner, db_file, tmp_path):
    from test_db_untrusted import locked

    with locked(db_file):
        for args in (["show", "--db", str(db_file)], ["db", "export", str(tmp_path / "out.sqlite"), "--db", str(db_file)],
                     ["db", "merge", str(db_file), "--into", str(tmp_path / "new.sqlite")]):
            start = time.monotonic()
            line = one_line_error(runner.invoke(main, args), 1)
            assert f"{db_file} is locked by another process" in line, line
            assert time.monotonic() - start < 8.0
    assert not (tmp_path / "out.sqlite").exists() and not (tmp_path / "new.sqlite").exists()


def test_export_of_no_matching_rows_refuses_and_writes_nothing(runner, db_file, tmp_path):
    out = tmp_path / "x4.sqlite"
    line = one_line_error(runner.invoke(main, ["db", "export", str(out), "--db", str(db_file), "--world-size", "4"]), 1)
    assert f"nothing to export: {db_file} has no valid row with world_size=4" in line and "world size 2" in line
    assert not out.exists()


def test_merge_skips_rows_of_unknown_backends(runner, db_file, tmp_path):
    with TuningDB(db_file) as tdb:
        tdb.db.conn.execute("UPDATE results SET backend = 'DROP TABLE results' WHERE op = 'dp_to_ep'")
        tdb.db.conn.commit()
    target = tmp_path / "merged.sqlite"
    result = runner.invoke(main, ["db", "merge", str(db_file), "--into", str(target)])
    assert result.exit_code == 0, result.output
    assert "4 new" in result.stdout and "1 bad rows skipped" in result.stdout
    assert "unknown backend 'DROP TABLE results'" in result.stderr and str(db_file) in result.stderr
    assert len(TuningDB(target, readonly=True)) == 4


def test_show_after_a_killed_writer(runner, tmp_path, monkeypatch):
    from test_db_schema import hot_journal_file

    path, journal = hot_journal_file(tmp_path)
    real_access = db_open.os.access
    # as a user who may read the file but not write it or its folder
    monkeypatch.setattr(db_open.os, "access", lambda p, mode, **kw: not mode & os.W_OK and real_access(p, mode, **kw))
    line = one_line_error(runner.invoke(main, ["show", "--db", str(path)]), 1)
    assert "hot journal" in line and "killed.sqlite-journal" in line
    monkeypatch.undo()
    result = runner.invoke(main, ["show", "--db", str(path), "--json"])  # the owner: rolled back, then read
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 1 and not journal.exists()


def test_bad_workspace_bytes_is_one_line_naming_the_variable(runner, db_file, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_WORKSPACE_BYTES", "1e20")
    line = one_line_error(runner.invoke(main, ["explain", "--bytes", "1MiB", "--world-size", "2", "--db", str(db_file)]), 1)
    assert "AUTOSYMM_WORKSPACE_BYTES='1e20'" in line


def test_sqlite_and_os_errors_are_one_line(runner, db_file, monkeypatch):
    import autosymm.db.store as dbmod

    def locked(*args, **kwargs):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(dbmod.TuningDB, "rows", locked)
    assert one_line_error(runner.invoke(main, ["show", "--db", str(db_file)]), 1) == "Error: database is locked"

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/root/x.sqlite")

    monkeypatch.setattr(dbmod.TuningDB, "rows", denied)
    line = one_line_error(runner.invoke(main, ["show", "--db", str(db_file)]), 1)
    assert "Permission denied" in line and "/root/x.sqlite" in line


def test_runtime_failures_are_their_message(runner, db_file, monkeypatch):
    import autosymm.db.store as dbmod

    def worker_failed(*args, **kwargs):
        raise RuntimeError("worker failed:\nrank 1: ValueError('x')\nTraceback (most recent call last):\n  File \"w.py\"")

    monkeypatch.setattr(dbmod.TuningDB, "rows", worker_failed)
    line = one_line_error(runner.invoke(main, ["show", "--db", str(db_file)]), 1)
    assert line == "Error: worker failed: rank 1: ValueError('x')"


def test_an_unexpected_error_is_one_line_unless_debugging(runner, db_file, monkeypatch):
    import autosymm.db.store as dbmod

    def bug(*args, **kwargs):
        raise KeyError("a bug\nover two lines")

    monkeypatch.setattr(dbmod.TuningDB, "rows", bug)
    line = one_line_error(runner.invoke(main, ["show", "--db", str(db_file)]), 1)
    assert line.startswith("Error: unexpected KeyError:") and "AUTOSYMM_LOG=debug" in line
    logger = logging.getLogger("autosymm")
    level = logger.level
    logger.setLevel(logging.DEBUG)  # as AUTOSYMM_LOG=debug does
    try:
        result = runner.invoke(main, ["show", "--db", str(db_file)])
    finally:
        logger.setLevel(level)
    assert isinstance(result.exception, KeyError)  # the traceback is there for the one debugging


# ------------------------------------------------------------- issue 23 item 5: a CLI that tells the truth
_EXPLAIN = ["explain", "--world-size", "2", "--gpu", "NVIDIA H200", "--mode", "eager"]


@pytest.mark.parametrize("text, label, call", [("3MB", "3MB", "call of 3000000 B above"),
                                               ("100kB", "100kB", "call of 100000 B between tuned 4KiB and 1MiB"),
                                               ("3MiB", "3MiB", "call of 3MiB above"), ("4KiB", "4KiB", "row at 4KiB")])
def test_explain_reads_si_sizes_as_decimal(runner, db_file, text, label, call):
    result = runner.invoke(main, _EXPLAIN + ["--bytes", text, "--db", str(db_file)])
    assert result.exit_code == 0, result.output
    assert f"ws=2 {label} [eager]" in result.output and call in result.output, result.output


@pytest.mark.parametrize("gpu", ["H200", "nvidia b200", "bogus"])
def test_explain_for_an_unknown_gpu_names_the_tuned_hardware(runner, db_file, gpu):
    for extra in (["--bytes", "1MiB"], ["--all"]):
        result = runner.invoke(main, ["explain", "--world-size", "2", "--gpu", gpu, "--db", str(db_file)] + extra)
        line = one_line_error(result, 2)
        assert f"--gpu {gpu!r}" in line and "matches no tuned hardware" in line and str(db_file) in line
        assert f"tuned: --gpu 'NVIDIA H200' ({HW}, world size 2)" in line


def test_explain_on_this_untuned_machine_answers_for_it_and_says_so(runner, db_file):
    result = runner.invoke(main, ["explain", "--world-size", "2", "--bytes", "1MiB", "--db", str(db_file)])
    assert result.exit_code == 0, result.output
    note, *lines = result.output.splitlines()
    assert note.startswith("This machine (GPU 'cpu', hardware cpu) is untuned") and "'NVIDIA H200'" in note
    assert len(lines) == 2 and all("on cpu (cpu): nccl - no tuned row" in line for line in lines)
    for args in (["--all"], ["--op", "dp_to_ep", "--shape", "deepseek-v3", "--tokens", "64", "--mode", "eager"]):
        result = runner.invoke(main, ["explain", "--world-size", "2", "--db", str(db_file), *args])
        assert result.exit_code == 0 and "is untuned" in result.output, result.output
    assert "triton_moe [block_n=" in result.output and "untuned default config" in result.output


@pytest.mark.parametrize("text, dtype, message", [
    ("0", "bf16", "'0' (0 B) is not a whole, non-zero number of bf16 elements (2 B each)"),
    ("1", "bf16", "'1' (1 B) is not a whole, non-zero number of bf16 elements"),
    ("3", "bf16", "'3' (3 B) is not a whole"), ("6", "fp32", "of fp32 elements (4 B each)"),
    ("1e30", "bf16", "'1e30' is over 9223372036854775807 bytes"),
    ("16K", "bf16", "'16K' is ambiguous: write 16KiB"), ("-4KiB", "bf16", "negative"),
    ("257MiB", "bf16", "over the workspace's all-reduce region (256MiB"),
    ("64GiB", "bf16", "'64GiB' (64GiB) is over the workspace's all-reduce region (256MiB"),
    ("1TiB", "bf16", "'1TiB' (1024GiB) is over the workspace's all-reduce region (256MiB")])
def test_explain_refuses_sizes_no_call_can_have(runner, db_file, text, dtype, message):
    line = one_line_error(runner.invoke(main, _EXPLAIN + ["--bytes", text, "--dtype", dtype, "--db", str(db_file)]), 2)
    assert "--bytes" in line and message in line, line


def test_explain_refuses_token_counts_beyond_the_numeric_limit(runner, db_file):
    args = ["explain", "--world-size", "2", "--gpu", "NVIDIA H200", "--db", str(db_file), "--tokens", str(10**18)]
    for extra in (["--op", "dp_to_ep", "--shape", "deepseek-v3"], ["--op", "all_reduce_rmsnorm", "--hidden", "8192"]):
        line = one_line_error(runner.invoke(main, args + extra), 2)
        assert "--tokens" in line and f"{10**18} tokens per rank make" in line and "over 2^63 - 1" in line


def test_explain_accepts_the_whole_region_and_follows_the_workspace_setting(runner, db_file, monkeypatch):
    assert runner.invoke(main, _EXPLAIN + ["--bytes", "256MiB", "--db", str(db_file)]).exit_code == 0
    monkeypatch.setenv("AUTOSYMM_WORKSPACE_BYTES", "4GiB")
    result = runner.invoke(main, _EXPLAIN + ["--bytes", "2GiB", "--db", str(db_file)])
    assert result.exit_code == 0 and "nccl" in result.output, result.output
    assert "all-reduce region (2GiB" in one_line_error(runner.invoke(main, _EXPLAIN + ["--bytes", "3GiB", "--db", str(db_file)]), 2)


def test_explain_says_which_times_are_modelled(runner, db_file):
    exact = runner.invoke(main, _EXPLAIN + ["--bytes", "4KiB", "--db", str(db_file)]).output
    assert "expected 5.00 us (measured; NCCL 20.00 us, 4.00x)" in exact
    for args in (["--bytes", "4KiB", "--dtype", "fp32"], ["--bytes", "64KiB"]):  # another dtype's row; between points
        output = runner.invoke(main, _EXPLAIN + args + ["--db", str(db_file)]).output
        assert "us (modelled" in output and "measured;" not in output, output
    graph = runner.invoke(main, _EXPLAIN[:-1] + ["graph", "--bytes", "4KiB", "--db", str(db_file)]).output
    assert "(modelled" in graph and "using the eager-mode row" in graph  # the other mode's row
    plan_output = runner.invoke(main, _EXPLAIN + ["--all", "--db", str(db_file)]).output
    assert "│ 4KiB   │ triton_one_shot │" in plan_output and " 5.00 " in plan_output and "~" in plan_output
    assert "~us: modelled" in plan_output


def test_a_graph_mode_call_that_would_raise_says_so_and_names_the_remedy(runner, db_file):
    args = ["explain", "--op", "dp_to_ep", "--shape", "deepseek-v3", "--world-size", "2", "--gpu", "NVIDIA H200",
            "--db", str(db_file), "--mode", "graph"]
    result = runner.invoke(main, args + ["--tokens", "8192"])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.endswith("[graph] on NVIDIA H200 (nvidia-h200-nvlink): raises - no backend can serve it in graph "
                          "mode (nccl_all_to_all: not CUDA-graph capturable); reserve the MoE room before capturing: "
                          "autosymm.init(moe=[autosymm.MoEPlan('d7168_e256_k8', 8192)])"), first
    small = runner.invoke(main, args + ["--tokens", "128"]).output
    assert "raises" not in small and "triton_moe" in small
    plan_output = runner.invoke(main, args + ["--all"]).output
    row = next(line for line in plan_output.splitlines() if "d7168_e256_k8 8192 tok" in line)
    assert "│ raises " in row and "autosymm.init(moe=[autosymm.MoEPlan('d7168_e256_k8', 8192)])" in row
    assert "nccl_all_to_all │" not in plan_output  # never presented as the plan


def _shipped_like_rows():
    """All-reduce at 2^k and 1.5 x 2^k, a fused row at a token count off the default list."""
    from autosymm.backends.triton_fused import fused_space

    rows = []
    for bucket in (4096, 6144, 3 << 20):
        rows.append(Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce", dtype="bf16", bucket=bucket,
                        backend="triton_one_shot", median_us=5.0, config=AllReduceConfig("one_shot", 2048, 4, 8),
                        nccl_us=20.0, mode="graph"))
    rows.append(Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=128,
                    shape="h2048", backend="triton_fused_one_shot_push", median_us=12.0,
                    config=fused_space("one_shot_push", 128, 2048, 2, 2)[0], nccl_us=36.0, mode="graph"))
    rows.append(Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="dp_to_ep", dtype="bf16", bucket=128,
                    shape="d7168_e256_k8", backend="triton_moe", median_us=30.0, config=MoEConfig(1024, 4),
                    nccl_us=300.0, mode="eager"))
    return rows


def test_a_shipped_plan_shows_every_op_and_every_tuned_size(runner, tmp_path, monkeypatch):
    import autosymm.db.store as dbmod

    path = tmp_path / "shipped.sqlite"
    TuningDB(path).record_many(_shipped_like_rows())
    monkeypatch.setattr(dbmod, "shipped_db_paths", lambda: [path])
    output = ""
    for op in ("all_reduce", "dp_to_ep", "ep_to_dp", "all_reduce_rmsnorm"):  # `run`'s next step, per op
        result = runner.invoke(main, ["explain", "--gpu", "NVIDIA H200", "--world-size", "2", "--all", "--op", op])
        assert result.exit_code == 0 and f"{op} plan: 2x NVIDIA H200" in result.output, result.output
        output += result.output
    lines = output.splitlines()
    for label in ("4KiB", "6KiB", "3MiB", "256MiB"):  # tuned 2^k and 1.5 x 2^k, and the defaults
        assert any(line.startswith(f"│ {label} ") for line in lines), label
    assert any("h2048 128 tok" in line and "triton_fused_one_shot_push" in line for line in lines)
    assert any("h4096 1 tok" in line for line in lines)


def test_tables_never_cut_names(runner, db_file, monkeypatch):
    from rich.console import Console

    import autosymm.cli.main as cli

    long_name = runner.invoke(main, _EXPLAIN + ["--all", "--db", str(db_file)])
    assert "triton_one_shot" in long_name.output and "…" not in long_name.output  # not a TTY: full width
    monkeypatch.setattr(cli, "rich_console", lambda: Console(width=100, force_terminal=True, color_system=None))
    narrow = runner.invoke(main, _EXPLAIN[:-2] + ["--all", "--db", str(db_file)]).output
    assert "…" not in narrow and max(len(line) for line in narrow.splitlines()) <= 100
    assert "triton_one_shot" in narrow and "block_size=2048" in narrow  # wrapped between words, never inside
    shown = runner.invoke(main, ["show", "--db", str(db_file)]).output
    assert "…" not in shown and "triton_one_shot" in shown

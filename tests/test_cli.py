"""Every CLI command through click's CliRunner (no GPU here)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from autosymm.cli import main
from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db import Row, TuningDB

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


def test_every_command_is_documented_in_the_readme():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    commands = set(main.commands) | {f"db {c}" for c in main.commands["db"].commands}
    commands.discard("db")
    for command in commands:
        assert f"autosymm {command}" in readme, command


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


def test_explain_bad_arguments(runner, db_file):
    assert runner.invoke(main, ["explain", "--world-size", "2", "--db", str(db_file)]).exit_code != 0
    result = runner.invoke(main, ["explain", "--op", "dp_to_ep", "--world-size", "2", "--tokens", "4"])
    assert result.exit_code != 0 and "--shape" in result.output


def test_show_table_and_json(runner, db_file):
    result = runner.invoke(main, ["show", "--db", str(db_file), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {r["backend"] for r in rows} == {"triton_one_shot", "triton_moe"}  # winners only
    ar = next(r for r in rows if r["op"] == "all_reduce" and r["size_bytes"] == 4096)
    assert ar["us"] == 5.0 and ar["nccl_us"] == 20.0 and ar["speedup"] == 4.0 and ar["config"]["block_size"] == 2048
    assert set(ar) >= {"gpu", "world_size", "op", "dtype", "size_bytes", "mode", "backend", "config", "us",
                       "nccl_us", "speedup"}
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


def test_run_without_gpu_shows_the_shipped_plan(runner, db_file, monkeypatch):
    import autosymm.db as dbmod

    monkeypatch.setattr(dbmod, "shipped_db_paths", lambda: [db_file])
    result = runner.invoke(main, ["run"])
    assert result.exit_code == 0, result.output
    assert "No CUDA GPU here" in result.output and "all_reduce plan" in result.output


def test_info(runner):
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0 and "hardware_slug" in result.output and "user_db" in result.output


def test_tune_backends_option_names_known_backends_and_keeps_the_baselines():
    import click

    from autosymm.cli import _parse_backends

    assert _parse_backends(None) is None and _parse_backends("") is None
    # the fallbacks are every row's baseline: always measured
    assert _parse_backends("triton_one_shot_push") == ["triton_one_shot_push", "nccl", "nccl_all_to_all", "nccl_fused"]
    assert _parse_backends("nccl, triton_moe") == ["nccl", "triton_moe", "nccl_all_to_all", "nccl_fused"]
    with pytest.raises(click.BadParameter, match="unknown backend.*triton_three_shot.*known: nccl"):
        _parse_backends("triton_three_shot")

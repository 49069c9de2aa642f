"""`autosymm explain --op reduce_scatter|all_gather`: NCCL and says why until a node has tuned the
op, the tuned row once one has (neighbours between tuned sizes, the bf16 rows for other dtypes),
the plan over all sizes; `tune --ops` accepts both."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from autosymm.configs import AllGatherConfig, ReduceScatterConfig
from autosymm.cli.main import _tune_options, main
from autosymm.db.store import Row, TuningDB

HW = "nvidia-h200-nvlink"
ARGS = ["--world-size", "8", "--gpu", "NVIDIA H200"]


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    return CliRunner()


@pytest.fixture
def db_file(tmp_path):
    def row(op, backend, config, us, bucket):
        return Row(hardware=HW, gpu="NVIDIA H200", world_size=8, op=op, dtype="bf16", bucket=bucket, backend=backend,
                   median_us=us, config=config, nccl_us=20.0)

    path = tmp_path / "rs_ag.sqlite"
    rows = []
    for bucket in (1 << 20, 2 << 20):
        rows += [row("reduce_scatter", "triton_reduce_scatter_pull", ReduceScatterConfig("pull", 4096, 32, 8), 8.0,
                     bucket),
                 row("reduce_scatter", "nccl_reduce_scatter", None, 20.0, bucket),
                 row("all_gather", "triton_all_gather_push", AllGatherConfig("push", 16384, 16, 4), 5.0, bucket),
                 row("all_gather", "nccl_all_gather", None, 20.0, bucket)]
    TuningDB(path).record_many(rows)
    return path


@pytest.mark.parametrize("op,fallback", [("reduce_scatter", "nccl_reduce_scatter"), ("all_gather", "nccl_all_gather")])
def test_explain_serves_both_ops_by_nccl_until_rows_exist(runner, op, fallback):
    for size in ("4KiB", "3000000", "1.5MiB", "6"):  # any size, powers of two or not
        result = runner.invoke(main, ["explain", "--op", op, "--bytes", size, *ARGS])
        assert result.exit_code == 0, result.output
        assert result.output.count(f"{fallback} - no tuned row for this hardware/world size/shape") == 2  # both modes


def test_explain_uses_the_tuned_rows_and_their_neighbours(runner, db_file):
    base = ["explain", *ARGS, "--db", str(db_file), "--mode", "eager"]
    result = runner.invoke(main, base + ["--op", "reduce_scatter", "--bytes", "1MiB"])
    assert result.exit_code == 0, result.output
    assert "reduce_scatter bf16 ws=8 1MiB [eager]" in result.output
    assert "triton_reduce_scatter_pull [algorithm=pull, block_size=4096, num_blocks=32, num_warps=8]" in result.output
    assert "8.00 us (measured; NCCL 20.00 us, 2.50x)" in result.output
    result = runner.invoke(main, base + ["--op", "all_gather", "--bytes", "1.5MiB", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "triton_all_gather_push" in result.output and "between tuned 1MiB and 2MiB" in result.output
    assert "no fp32 row, using the bf16 row of the same byte size" in result.output
    result = runner.invoke(main, base + ["--op", "all_gather", "--all"])
    assert result.exit_code == 0, result.output
    assert "all_gather plan" in result.output and "triton_all_gather_push" in result.output
    assert "4KiB" in result.output and "256MiB" in result.output  # every default size, from its tuned neighbours


def test_explain_and_plans_follow_the_deterministic_setting(runner, db_file, monkeypatch):
    """AUTOSYMM_DETERMINISTIC=1: what the runtime would run (the tuned Triton reduce-scatter is
    batch-invariant; without a row the ordered fallback, not NCCL's), in explain and in plans."""
    monkeypatch.setenv("AUTOSYMM_DETERMINISTIC", "1")
    base = ["explain", *ARGS, "--mode", "eager", "--op", "reduce_scatter"]
    result = runner.invoke(main, base + ["--bytes", "64KiB"])
    assert result.exit_code == 0, result.output
    assert "nccl_ordered_reduce_scatter - no tuned row" in result.output and "batch-invariant backends only" in \
        result.output
    result = runner.invoke(main, base + ["--bytes", "1MiB", "--db", str(db_file)])
    assert "triton_reduce_scatter_pull [algorithm=pull" in result.output, result.output
    result = runner.invoke(main, ["explain", *ARGS, "--mode", "eager", "--all"])
    assert result.exit_code == 0 and "nccl_ordered" in result.output and " nccl " not in result.output, result.output


def test_tune_accepts_both_ops_which_are_not_tuned_by_default(runner):
    options = _tune_options({"ops": "reduce_scatter,all_gather", "sizes": "1MiB,3000000", "dtypes": "bf16",
                             "modes": "eager,graph", "shapes": "deepseek-v3", "tokens": "1", "strategy": "auto",
                             "trials": None, "db_path": None, "backend_list": None, "epilogues": "default"})
    assert options.ops == ["reduce_scatter", "all_gather"]
    from autosymm.tuning.session import problems_for

    assert [(p.op, p.nbytes) for p in problems_for(options, 8)] == [
        ("reduce_scatter", 1 << 20), ("reduce_scatter", 3000000), ("all_gather", 1 << 20), ("all_gather", 3000000)]
    help_text = runner.invoke(main, ["tune", "--help"]).output
    assert "reduce_scatter" not in help_text.split("--ops")[1].split("--sizes")[0]

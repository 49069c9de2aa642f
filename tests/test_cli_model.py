"""`autosymm tune --model CONFIG --tp N`: the option parsing, the usage errors (before any worker
starts) and the problems `tune` hands to its workers: exactly the keys the model calls, every op,
no others. No worker starts here: `run_workers` is replaced by a recorder, and the GPU check sees
the number of GPUs each test says."""

from __future__ import annotations

import json

import pytest
import torch

from autosymm.cli.main import main
from autosymm.epilogue import Epilogue
from autosymm.problem import MoEShape
from autosymm.tuning import workers
from autosymm.tuning.model_calls import ModelShape, default_capture_sizes, model_problems
from autosymm.tuning.session import TuneResult, problems_for, tune_job

LLAMA = {"model_type": "llama", "hidden_size": 1024, "torch_dtype": "bfloat16"}
QWEN_MOE = {"model_type": "qwen3_moe", "hidden_size": 512, "torch_dtype": "float16", "num_experts": 16,
            "num_experts_per_tok": 2}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA))
    return path


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: the CLI sees ``n`` CUDA GPUs; returns the list of (fn, nproc, options) that
    `tune` hands to run_workers (each answered by a TuneResult of one row)."""
    handed = []

    def fake_run_workers(fn, nproc, options, **kwargs):
        handed.append((fn, nproc, options))
        return TuneResult(rows=[_summary_row()], failures=[])

    def see(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return handed

    monkeypatch.setattr(workers, "run_workers", fake_run_workers)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return see


def _summary_row(**extra) -> dict:
    row = {"op": "all_reduce", "label": "2KiB", "mode": "eager", "backend": "triton_one_shot_push",
           "config": "{}", "us": 8.0, "nccl_us": 20.0, "speedup": 2.5, "nccl_margin": 1.5, "stack": None,
           "stack_us": None, "stack_margin": None}
    return {**row, **extra}


def test_the_workers_get_exactly_the_keys_the_model_calls(runner, config, gpus):
    handed = gpus(4)  # more GPUs than the model's TP: the tune runs on exactly --tp of them
    result = runner.invoke(main, ["tune", "--model", str(config), "--tp", "2"])
    assert result.exit_code == 0, result.output
    (fn, nproc, options), = handed
    assert fn is tune_job and nproc == 2 and options.model is not None
    shape = ModelShape.from_config(LLAMA, "tiny-llama")
    assert problems_for(options, 2) == model_problems(shape, 2, default_capture_sizes())
    assert {p.op for p in problems_for(options, 2)} == {"all_reduce", "all_reduce_rmsnorm"}
    assert len(problems_for(options, 2)) == 2 * 51  # vLLM's 51 capture sizes, each op once
    assert options.modes == ["eager", "graph"]
    assert "tiny-llama (hidden 1024, bf16) at TP 2, 51 token count(s) 1..512: 102 keys (all_reduce 51, " \
           "all_reduce_rmsnorm 51)" in result.output
    with pytest.raises(ValueError, match="runs at TP 2: its keys are for 2 ranks, not 4"):
        problems_for(options, 4)


@pytest.mark.parametrize("args, tokens", [
    (["--capture-sizes", "1,3000,8"], [1, 8, 3000]),
    (["--capture-sizes", "200:300"], [200, 208, 216, 224, 232, 240, 248, 256, 272, 288]),
    (["--capture-sizes", "1:8"], [1, 2, 4, 8]),
])
def test_capture_sizes_are_a_list_or_the_stacks_sizes_in_a_range(runner, config, gpus, args, tokens):
    handed = gpus(2)
    result = runner.invoke(main, ["tune", "--model", str(config), "--tp", "2", *args])
    assert result.exit_code == 0, result.output
    problems = problems_for(handed[0][2], 2)
    assert [p.n_tokens_local for p in problems if p.op == "all_reduce_rmsnorm"] == tokens
    assert [p.nbytes for p in problems if p.op == "all_reduce"] == [t * 1024 * 2 for t in tokens]


def test_sequence_parallel_and_moe_models(runner, tmp_path, gpus):
    handed = gpus(4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN_MOE))
    result = runner.invoke(main, ["tune", "--model", str(path), "--tp", "4", "--capture-sizes", "4,16",
                                  "--sequence-parallel", "--modes", "graph"])
    assert result.exit_code == 0, result.output
    (_, nproc, options), = handed
    problems = problems_for(options, 4)
    assert nproc == 4 and options.modes == ["graph"]
    assert [(p.op, p.bucket) for p in problems] == [
        ("dp_to_ep", 4), ("dp_to_ep", 16), ("ep_to_dp", 4), ("ep_to_dp", 16),
        ("reduce_scatter", 4 * 512 * 2), ("reduce_scatter", 16 * 512 * 2),
        ("all_gather", 4 * 512 * 2), ("all_gather", 16 * 512 * 2)]
    assert {p.shape for p in problems if p.op in ("dp_to_ep", "ep_to_dp")} == {MoEShape(512, 16, 2)}
    assert {p.dtype for p in problems} == {"fp16"} and {p.world_size for p in problems} == {4}


def test_the_fused_keys_carry_the_checkpoints_epilogue(runner, tmp_path, gpus):
    handed = gpus(2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "model_type": "gemma2",
                                "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}))
    assert runner.invoke(main, ["tune", "--model", str(path), "--tp", "2", "--capture-sizes", "8"]).exit_code == 0
    fused, = [p for p in problems_for(handed[0][2], 2) if p.op == "all_reduce_rmsnorm"]
    assert fused.epilogue == Epilogue(gemma=True, quant="fp8")


def one_line_usage_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.mark.parametrize("args, names", [
    (["--ops", "all_reduce"], ["--ops"]),
    (["--sizes", "1MiB", "--tokens", "4"], ["--sizes", "--tokens"]),
    (["--shapes", "deepseek-v3"], ["--shapes"]),
    (["--epilogues", "all"], ["--epilogues"]),
    (["--dtypes", "fp32"], ["--dtypes"]),
])
def test_options_that_choose_other_keys_clash_with_model(runner, config, gpus, args, names):
    handed = gpus(2)
    line = one_line_usage_error(runner.invoke(main, ["tune", "--model", str(config), "--tp", "2", *args]))
    assert "--model tunes exactly the keys the model calls" in line
    for name in names:
        assert name in line
    assert not handed


@pytest.mark.parametrize("args, message", [
    (["--tp", "2"], "--tp only go(es) with --model CONFIG"),
    (["--capture-sizes", "1,2", "--sequence-parallel"], "--capture-sizes, --sequence-parallel only go(es) with"),
    (["--model", "CONFIG"], "--model needs --tp N"),
    (["--model", "CONFIG", "--tp", "2", "--capture-sizes", "0:8"], "--capture-sizes"),
    (["--model", "CONFIG", "--tp", "2", "--capture-sizes", "a,b"], "'a,b' is not a token list"),
    (["--model", "CONFIG", "--tp", "1"], "--tp"),
    (["--model", "CONFIG", "--tp", "2", "--nproc", "4"], "--nproc 4 with --tp 2"),
])
def test_model_usage_errors(runner, config, gpus, args, message):
    handed = gpus(4)
    args = [str(config) if a == "CONFIG" else a for a in args]
    line = one_line_usage_error(runner.invoke(main, ["tune", *args]))
    assert message in line, line
    assert not handed


def test_fewer_local_gpus_than_tp_is_a_usage_error_before_any_worker(runner, config, gpus):
    handed = gpus(2)
    line = one_line_usage_error(runner.invoke(main, ["tune", "--model", str(config), "--tp", "4"]))
    assert "--tp 4: the model runs on 4 ranks, this node has 2 GPU(s)" in line
    assert not handed


def test_under_torchrun_the_launch_must_match_tp(runner, config, gpus, monkeypatch):
    handed = gpus(8)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    line = one_line_usage_error(runner.invoke(main, ["tune", "--model", str(config), "--tp", "2"]))
    assert "--tp 2, but torchrun started 8 worker(s)" in line and not handed


def test_a_config_that_is_no_model_names_the_file(runner, tmp_path, gpus):
    handed = gpus(2)
    path = tmp_path / "config.json"
    path.write_text("{not json")
    line = one_line_usage_error(runner.invoke(main, ["tune", "--model", str(path), "--tp", "2"]))
    assert "--model" in line and "cannot read the model config" in line
    path.write_text(json.dumps({"torch_dtype": "bfloat16"}))
    line = one_line_usage_error(runner.invoke(main, ["tune", "--model", str(path), "--tp", "2"]))
    assert "no hidden size" in line and not handed


def test_without_gpus_nothing_runs(runner, config, gpus):
    handed = gpus(0)
    result = runner.invoke(main, ["tune", "--model", str(config), "--tp", "2"])
    assert result.exit_code == 1 and "needs CUDA GPUs" in result.output and not handed


def test_the_summary_gives_each_winners_margins(runner, config, gpus, monkeypatch):
    gpus(2)

    def answered(fn, nproc, options, **kwargs):
        return TuneResult(rows=[_summary_row(), _summary_row(mode="graph", backend="nccl", us=20.0, nccl_margin=0.0),
                                _summary_row(label="3KiB", nccl_us=None, nccl_margin=None)], failures=[])

    monkeypatch.setattr(workers, "run_workers", answered)
    result = runner.invoke(main, ["tune", "--model", str(config), "--tp", "2", "--capture-sizes", "1"],
                           terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "margin vs NCCL" in result.output and "margin vs stack" not in result.output
    lines = {line.split("│")[2].strip() + " " + line.split("│")[3].strip(): line
             for line in result.output.splitlines() if line.count("│") > 8}
    assert "+150.0%" in lines["2KiB eager"] and "+0.0%" in lines["2KiB graph"]
    assert lines["3KiB eager"].rstrip("│ ").endswith("-")  # NCCL not timed: no margin


def test_the_summary_gives_the_stack_margin_where_rows_have_one(monkeypatch):
    from rich.console import Console

    from autosymm.cli.model import summary_table

    console = Console(record=True, width=220)
    console.print(summary_table([_summary_row(stack="vllm", stack_us=10.0, stack_margin=0.25), _summary_row()]))
    text = console.export_text()
    assert "margin vs stack" in text and "10.00 (vllm)" in text and "+25.0%" in text


def test_a_registered_ops_own_sweep_option_clashes_with_model_too(runner, config, gpus, monkeypatch):
    """The clashing options are read off the registry: a toy op's --widths is one (tests/toy_op)."""
    import autosymm.problem as problem_module
    from autosymm import spec
    from toy_op.spec import TOY

    monkeypatch.setattr(problem_module, "_SPECS", dict(problem_module._SPECS))
    spec.register(TOY)
    handed = gpus(2)
    line = one_line_usage_error(runner.invoke(main, ["tune", "--model", str(config), "--tp", "2", "--widths", "8"]))
    assert "--widths cannot be given with it" in line and not handed

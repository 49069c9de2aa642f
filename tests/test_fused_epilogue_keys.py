"""The fused op's epilogue in its Problem and database key: 'h{hidden}' for the default epilogue
(the rows tuned before epilogues existed keep serving), 'h{hidden}_{Epilogue.key}' for the
others, read back exactly; a row of one epilogue never serves another; `autosymm explain` with
--quant / --gemma / --no-residual / --epilogue and its usage errors (CliRunner)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from autosymm.cli.main import main
from autosymm.spec import ALL_REDUCE_RMSNORM, PointRequest
from autosymm.spec.all_reduce_rmsnorm import HiddenShape, split_key
from autosymm.spec.all_reduce_rmsnorm import EPILOGUES, parse_epilogues
from autosymm.db.store import Row, TuningDB
from autosymm.epilogue import Epilogue
from autosymm.problem import Problem

HW = "nvidia-h200-nvlink"


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.key or "default")
def test_the_shape_key_round_trips(epilogue):
    problem = Problem.all_reduce_rmsnorm(16, 4096, "bf16", 2, epilogue=epilogue)
    key = problem.shape_key
    assert key == ("h4096" if epilogue == Epilogue() else f"h4096_{epilogue.key}")
    assert split_key(key) == (4096, epilogue) and ALL_REDUCE_RMSNORM.shape_of_key(key) == HiddenShape(4096, epilogue)
    assert HiddenShape(4096, epilogue).key == key
    assert Problem.all_reduce_rmsnorm(16, 4096, "bf16", 2).shape_key == "h4096"  # the shipped rows' key
    assert Problem.all_reduce_rmsnorm(16, 4096, "bf16", 2) == Problem.all_reduce_rmsnorm(16, 4096, "bf16", 2, epilogue=Epilogue())


@pytest.mark.parametrize("key", ["h4096_", "h4096_add_rms", "h4096_fp8", "x4096_rms", "h0_rms"])
def test_bad_shape_keys_are_refused(key):
    with pytest.raises(ValueError, match=repr(key)):
        split_key(key)


def test_problems_refuse_what_an_epilogue_cannot_serve():
    with pytest.raises(ValueError, match="quant='nvfp4' needs hidden % 16 == 0, got hidden=72"):
        Problem.all_reduce_rmsnorm(4, 72, "bf16", 2, epilogue=Epilogue(quant="nvfp4"))
    with pytest.raises(ValueError, match="epilogue must be an autosymm.epilogue.Epilogue, got str"):
        Problem.all_reduce_rmsnorm(4, 64, "bf16", 2, epilogue="fp8")
    nvfp4 = Epilogue(quant="nvfp4")
    request = PointRequest(("bf16",), 2, sizes=(4,), shapes=(HiddenShape(72, nvfp4), HiddenShape(64, nvfp4)))
    assert [p.hidden for p in ALL_REDUCE_RMSNORM.problems(request)] == [64]  # 72 cannot pack
    assert "cannot serve hidden=72" in ALL_REDUCE_RMSNORM.no_calls(HiddenShape(72, nvfp4))


def test_parse_epilogues_reads_keys_default_and_all():
    assert parse_epilogues("default, add_rms_fp8,rms") == (Epilogue(), Epilogue(quant="fp8"), Epilogue(residual=False))
    assert parse_epilogues("all") == EPILOGUES
    with pytest.raises(ValueError, match="epilogue 'fp4': .* known: default, all, rms"):
        parse_epilogues("fp4")


def _db(tmp_path):
    """Rows: the default epilogue's at h8192 (Triton, 3x NCCL) and fp8's (NCCL)."""
    from autosymm.backends.triton_fused import fused_space

    config = fused_space("one_shot_push", 64, 8192, 2, 2)[0]
    path = tmp_path / "fused.sqlite"
    rows = [Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=64,
                shape="h8192", backend="triton_fused_one_shot_push", median_us=12.0, config=config, nccl_us=36.0,
                mode="graph"),
            Row(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=64,
                shape="h8192_rms_fp8", backend="nccl_fused", median_us=40.0, config=None, nccl_us=40.0, mode="graph")]
    TuningDB(path).record_many(rows)
    with TuningDB(path, readonly=True) as db:  # the keys read back as written
        assert sorted(r.shape for r in db.rows()) == ["h8192", "h8192_rms_fp8"]
    return path


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    return CliRunner()


def _explain(runner, path, *extra):
    args = ["explain", "--op", "all_reduce_rmsnorm", "--world-size", "2", "--gpu", "NVIDIA H200", "--db", str(path),
            "--mode", "graph", "--hidden", "8192", "--tokens", "64", *extra]
    return runner.invoke(main, args)


def test_explain_serves_every_epilogue_from_its_own_rows(runner, tmp_path):
    path = _db(tmp_path)
    result = _explain(runner, path)
    assert result.exit_code == 0 and "h8192 tokens/rank=64" in result.output and "triton_fused" in result.output
    for extra in (["--quant", "fp8", "--no-residual"], ["--epilogue", "rms_fp8"]):
        result = _explain(runner, path, *extra)
        assert result.exit_code == 0, result.output
        assert "h8192_rms_fp8 tokens/rank=64" in result.output and "nccl_fused" in result.output
        assert "tuned graph row at 64 tokens/rank" in result.output  # its own row, not the default's
    for extra, key in ((["--quant", "fp8"], "h8192_add_rms_fp8"), (["--gemma"], "h8192_add_gemma"),
                       (["--quant", "nvfp4", "--no-residual"], "h8192_rms_nvfp4"),
                       (["--quant", "fp8_per_token"], "h8192_add_rms_fp8_per_token"),
                       (["--no-residual", "--gemma"], "h8192_gemma")):
        result = _explain(runner, path, *extra)
        assert result.exit_code == 0 and f"{key} tokens/rank=64" in result.output, result.output
        assert "nccl_fused" in result.output and "no tuned row" in result.output  # no row of that epilogue
    result = _explain(runner, path, "--epilogue", "default")
    assert result.exit_code == 0 and "triton_fused" in result.output
    result = runner.invoke(main, ["explain", "--op", "all_reduce_rmsnorm", "--world-size", "2", "--gpu",
                                  "NVIDIA H200", "--db", str(path), "--mode", "graph", "--hidden", "8192", "--all",
                                  "--quant", "fp8", "--no-residual"])
    assert result.exit_code == 0 and "h8192_rms_fp8 64 tok" in result.output, result.output


@pytest.mark.parametrize("extra,match", [
    (["--quant", "fp4"], "Invalid value for '--quant'"),
    (["--epilogue", "fp4"], "epilogue 'fp4'"),
    (["--epilogue", "rms", "--gemma"], "give --epilogue or --quant/--gemma/--no-residual, not both"),
    (["--epilogue", "rms,gemma"], "is not one epilogue"),
])
def test_explain_refuses_bad_epilogues(runner, tmp_path, extra, match):
    result = _explain(runner, _db(tmp_path), *extra)
    assert result.exit_code == 2 and match in result.output, result.output


def test_explain_refuses_epilogues_elsewhere_and_unpackable_sizes(runner, tmp_path):
    path = _db(tmp_path)
    result = runner.invoke(main, ["explain", "--op", "all_reduce", "--world-size", "2", "--gpu", "NVIDIA H200",
                                  "--db", str(path), "--bytes", "1MiB", "--quant", "fp8"])
    assert result.exit_code == 2 and "all_reduce_rmsnorm's, not all_reduce's" in result.output
    result = runner.invoke(main, ["explain", "--op", "all_reduce_rmsnorm", "--world-size", "2", "--gpu",
                                  "NVIDIA H200", "--db", str(path), "--hidden", "72", "--tokens", "4",
                                  "--quant", "nvfp4"])
    assert result.exit_code == 2 and "cannot serve hidden=72" in result.output

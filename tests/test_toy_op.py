"""A new collective, as ARCHITECTURE.md's "A new collective" lists it: the toy op of tests/toy_op
(its spec with a new shape kind and its own options, its door, backends and tuning module) and one
registry line (``spec.register``). With nothing else, the dispatcher decides it, the database's
row validator checks its rows, `autosymm explain --op toy` takes its --width, plans and `db show`
list it, `tune` builds its problems and tunes it on two gloo ranks, and its door runs real calls
on two gloo ranks."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from _gloo import run_gloo
from click.testing import CliRunner

import autosymm.problem as problem_module
from autosymm import spec
from autosymm.backends import Capabilities, backend_names, get_backend
from autosymm.cli.main import _tune_options, main
from autosymm.collectives import doors
from autosymm.configs import MoEConfig, config_from_json, config_to_json, config_types
from autosymm.db.schema import checked_row
from autosymm.db.store import Row, TuningDB
from autosymm.runtime.dispatch import decide
from autosymm.tuning import ops as tuning_ops
from autosymm.tuning.session import TuneOptions, problems_for
from toy_op.spec import TOY, ToyConfig, Width

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=2)


def _register():
    """The one registry line the toy op needs."""
    return spec.register(TOY)


@pytest.fixture
def toy(monkeypatch):
    """The toy op registered for one test (the registry as it was afterwards)."""
    monkeypatch.setattr(problem_module, "_SPECS", dict(problem_module._SPECS))
    return _register()


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    return CliRunner()


def _row(**fields) -> Row:
    base = dict(hardware=HW, gpu="NVIDIA H200", world_size=2, op="toy", dtype="fp32", bucket=4, shape="w64",
                backend="toy_chunked", median_us=5.0, config=ToyConfig(2), nccl_us=10.0, mode="eager")
    return Row(**{**base, **fields})


@pytest.fixture
def db_file(tmp_path, toy):
    path = tmp_path / "toy.sqlite"
    TuningDB(path).record_many([_row(), _row(backend="toy_gloo", median_us=10.0, config=None),
                                _row(mode="graph", bucket=16, config=ToyConfig(4), median_us=7.0)])
    return path


def test_one_registration_puts_it_in_every_registry(toy):
    assert spec.names()[-1] == "toy" and spec.get("toy") is TOY and _register() is TOY  # again: nothing changes
    assert doors()[-1].spec is TOY and tuning_ops.get("toy").record is TOY
    assert backend_names()[-3:] == ["toy_gloo", "toy_chunked", "noop"]
    assert get_backend("toy_chunked").serves(TOY) and not get_backend("nccl").serves(TOY)
    assert config_types()["ToyConfig"] is ToyConfig and config_from_json(config_to_json(ToyConfig(2))) == ToyConfig(2)
    with pytest.raises(ValueError, match=r"toy2 lists backend\(s\) \['toy_gloo'\] with other entries than toy"):
        spec.register(replace(TOY, name="toy2", backends={"toy_gloo": "toy_op.backend:TOY_CHUNKED"}))
    with pytest.raises(ValueError, match=r"option\(s\) \['--width'\] are not toy's"):
        spec.register(replace(TOY, name="toy2", backends={"toy2": "a.b:c"}, fallback="toy2", fallback_order=("toy2",),
                              shape=replace(TOY.shape, option=replace(TOY.shape.option))))  # another --width
    assert spec.names()[-1] == "toy"


def test_the_registry_is_back_without_it():
    assert "toy" not in spec.names() and "toy_gloo" not in backend_names() and "ToyConfig" not in config_types()


def test_the_dispatcher_decides_it(toy, db_file):
    from autosymm.db.read import open_sources

    problem = TOY.problem_at("fp32", 2, 4, Width(64))
    assert problem.describe() == "toy fp32 ws=2 w64 tokens/rank=4" and problem.bucket == 4
    untuned = decide(problem, "eager", CAPS, [], HW)
    assert (untuned.backend, untuned.tuned) == ("toy_gloo", False) and "no tuned row" in untuned.reason
    sources = open_sources(None, [db_file])
    tuned = decide(problem, "eager", CAPS, sources, HW)
    assert (tuned.backend, tuned.config, tuned.measured) == ("toy_chunked", ToyConfig(2), True)
    between = decide(TOY.problem_at("fp32", 2, 8, Width(64)), "graph", CAPS, sources, HW)
    assert between.backend == "toy_chunked" and not between.measured  # modelled from its tuned neighbours
    assert decide(TOY.problem_at("fp32", 1, 4, Width(64)), "eager", CAPS, sources, HW).backend == "noop"
    assert decide(TOY.problem_at("fp32", 2, 0, Width(64)), "eager", CAPS, sources, HW).backend == "noop"


@pytest.mark.parametrize("fields, message", [
    (dict(shape="h64"), "not a row width key"), (dict(shape=""), "not a row width key"),
    (dict(backend="nccl"), "backend nccl does not serve op 'toy'"),
    (dict(config=MoEConfig(512, 4)), "config type MoEConfig does not belong to op 'toy'"),
    (dict(bucket=1 << 40), "over the largest tensor")])
def test_its_database_rows_are_validated(toy, fields, message):
    assert checked_row(_row()).config_obj == ToyConfig(2)
    assert TOY.problem_of_row(_row()) == TOY.problem_at("fp32", 2, 4, Width(64))
    with pytest.raises(ValueError, match=message):
        checked_row(_row(**fields))


def test_explain_takes_its_own_option(toy, runner, db_file):
    args = ["explain", "--op", "toy", "--world-size", "2", "--gpu", "NVIDIA H200", "--db", str(db_file), "--mode",
            "eager"]
    result = runner.invoke(main, args + ["--tokens", "4", "--width", "64"])
    assert result.exit_code == 0, result.output
    assert "toy fp32" not in result.output and "toy bf16 ws=2 w64 tokens/rank=4 [eager]" in result.output
    fp32 = runner.invoke(main, args + ["--tokens", "4", "--width", "64", "--dtype", "fp32"]).output
    assert "toy_chunked [chunks=2], expected 5.00 us (measured; NCCL 10.00 us, 2.00x)" in fp32
    assert "--width" in runner.invoke(main, ["explain", "--help"]).output.split("--epilogue")[1]
    for extra, message in ((["--tokens", "4"], "toy needs --width"), (["--width", "64"], "give --tokens or --all"),
                           (["--tokens", "4", "--width", "0"], "Invalid value for --width: 0 is not >= 1"),
                           (["--tokens", "4", "--width", "64", "--hidden", "8"], "all_reduce_rmsnorm's, not toy's")):
        result = runner.invoke(main, args + extra)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
    result = runner.invoke(main, ["explain", "--bytes", "1MiB", "--width", "64", "--world-size", "2"])
    assert result.exit_code == 2 and "toy's, not all_reduce's" in result.output


def test_plans_and_db_show_list_it(toy, runner, db_file):
    result = runner.invoke(main, ["explain", "--op", "toy", "--world-size", "2", "--gpu", "NVIDIA H200", "--db",
                                  str(db_file), "--all", "--dtype", "fp32"])
    assert result.exit_code == 0 and "toy plan: 2x NVIDIA H200" in result.output, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("│ w64 4 tok ") and "toy_chunked" in line for line in lines), result.output
    assert any(line.startswith("│ w8 1 tok ") and "toy_gloo" in line for line in lines)  # a default point
    narrowed = runner.invoke(main, ["explain", "--op", "toy", "--world-size", "2", "--gpu", "NVIDIA H200", "--db",
                                    str(db_file), "--all", "--width", "64"]).output
    assert "w64 16 tok" in narrowed and "w8 " not in narrowed
    shown = json.loads(runner.invoke(main, ["show", "--db", str(db_file), "--json", "--all"]).output)
    assert {(r["op"], r["shape"], r["tokens_per_rank"], r["backend"]) for r in shown} == {
        ("toy", "w64", 4, "toy_chunked"), ("toy", "w64", 4, "toy_gloo"), ("toy", "w64", 16, "toy_chunked")}
    table = runner.invoke(main, ["show", "--db", str(db_file)]).output
    assert "toy" in table and "w64" in table and "chunks=2" in table


def test_tune_builds_its_problems(toy, runner):
    options = _tune_options({"ops": "toy", "dtypes": "fp32", "modes": "eager", "strategy": "auto", "trials": None,
                             "db_path": None, "backend_list": None, "tokens": "1,4", "widths": "8,16"})
    assert [(p.op, p.shape, p.n_tokens_local) for p in problems_for(options, 2)] == [
        ("toy", Width(8), 1), ("toy", Width(8), 4), ("toy", Width(16), 1), ("toy", Width(16), 4)]
    default = _tune_options({"ops": "toy", "dtypes": "fp32", "modes": "eager", "strategy": "auto", "trials": None,
                             "db_path": None, "backend_list": None})  # `run` invokes tune without the ops' options
    assert {p.shape for p in problems_for(default, 2)} == {Width(8), Width(64)}
    assert "--widths" in runner.invoke(main, ["tune", "--help"]).output
    result = runner.invoke(main, ["tune", "--ops", "toy", "--widths", "8,x"])
    assert result.exit_code != 0 and "needs CUDA GPUs" in result.output  # no GPU: nothing is parsed or run


def _tune_ranks(rank, world_size, db_path):
    """`autosymm tune`'s worker body over the toy op: every registered backend loaded, the toy's
    two competing; rank 0 writes the winners."""
    from autosymm.tuning.session import tune_job

    _register()
    options = TuneOptions(ops=["toy"], dtypes=["fp32"], modes=["eager"], strategy="grid", db_path=db_path,
                          points={"--tokens": [4], "--widths": (Width(8),)})
    result = tune_job(rank, world_size, options)
    return None if result is None else (result.failures, sorted(row["backend"] for row in result.rows))


def _call_ranks(rank, world_size):
    """The toy door's real calls: decided from the tuned database (AUTOSYMM_DB), summed by gloo;
    a bad tensor on one rank raises on both."""
    import autosymm
    from toy_op.door import toy_sum

    _register()
    x = torch.full((4, 8), float(rank + 1))
    out = toy_sum(x)
    again = toy_sum(torch.full((4, 8), 2.0))
    decision = autosymm.explain(op="toy", problem=TOY.problem_at("fp32", world_size, 4, Width(8)))
    try:
        toy_sum(torch.ones(3) if rank == 1 else torch.ones(2, 3))
        refused = ""
    except (ValueError, RuntimeError) as exc:  # rank 0: an AgreementError naming rank 1's
        refused = str(exc)
    return out is x, x.tolist() == [[3.0] * 8] * 4, again.tolist() == [[4.0] * 8] * 4, decision.tuned, \
        decision.backend, autosymm.stats(), refused


def test_tuned_on_two_gloo_ranks_then_decided_and_run_by_its_door(toy, tmp_path, runner):
    db_path = str(tmp_path / "tuned.sqlite")
    reports = run_gloo(_tune_ranks, 2, db_path, deadline_s=90.0)
    failures, winners = reports[0]
    assert failures == [] and winners in (["toy_chunked"], ["toy_gloo"]), reports[0]
    rows = TuningDB(db_path, readonly=True).rows()
    assert {(r.op, r.shape, r.bucket, r.hardware) for r in rows} == {("toy", "w8", 4, "cpu")}
    assert {r.backend for r in rows} == {"toy_gloo", "toy_chunked"}  # each backend's best, checked and stored
    explained = runner.invoke(main, ["explain", "--op", "toy", "--tokens", "4", "--width", "8", "--dtype", "fp32",
                                     "--world-size", "2", "--mode", "eager", "--db", db_path])
    assert explained.exit_code == 0 and "is untuned" not in explained.output, explained.output  # this machine's rows
    assert "tuned eager row at 4 tokens/rank" in explained.output
    calls = run_gloo(_call_ranks, 2, env={"all": {"AUTOSYMM_DB": db_path}}, deadline_s=60.0)
    for rank, (same, summed, summed_again, tuned, backend, stats, refused) in calls.items():
        assert same and summed and summed_again and tuned and backend in winners, calls[rank]
        assert stats == {backend: {"calls": 2, "bytes": 2 * 4 * 8 * 4}}
        assert "x must be [rows, width >= 1], got shape (3,)" in refused or "rank 1" in refused, refused

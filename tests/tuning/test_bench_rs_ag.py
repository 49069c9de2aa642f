"""`autosymm bench --ops all_reduce,reduce_scatter,all_gather` over 2 gloo processes (gloo stands
in for NCCL): NCCL and autosymm validated and timed, torch's ops and the zero-copy form reported
with why they do not run here, the tables and the ratios of the sharded ops; the all-reduce's
nccl_symm baselines."""

import pytest
from _gloo import run_gloo
from rich.console import Console

from autosymm.bench.run import BenchOptions, print_bench
from autosymm.bench.report import compare, cells, losses
from autosymm.bench.rs_ag import SHARDED_IMPLS


def _bench(rank, world_size, options):
    from autosymm.bench.run import bench_job

    return bench_job(rank, world_size, options)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    options = BenchOptions(sizes=[4096, 6000, 6002], modes=["eager", "graph"], shapes={}, tokens=[],
                           ops=["all_reduce", "reduce_scatter", "all_gather"])
    db = str(tmp_path_factory.mktemp("bench") / "none.sqlite")
    return run_gloo(_bench, 2, options, env={"all": {"AUTOSYMM_DB": db}})[0]


def test_both_ops_are_validated_and_timed_against_nccl(result):
    for op in ("reduce_scatter", "all_gather"):
        rows = [r for r in result.rows if r.op == op]
        assert {r.mode for r in rows} == {"eager"} and {r.impl for r in rows} == set(SHARDED_IMPLS)
        timed = {(r.impl, r.label) for r in rows if r.us}
        assert timed == {(impl, label) for impl in ("nccl", "autosymm") for label in ("4KiB", "6kB")}
        auto = [r for r in rows if r.impl == "autosymm" and r.us]
        assert all(r.backend == f"nccl_{op}" for r in auto)  # untuned: the dispatcher's NCCL fallback
        notes = {r.impl: r.note for r in rows if r.label == "4KiB"}
        assert "no torch symmetric memory" in notes["torch_low_contention"]
        assert "no autosymm workspace" in notes["autosymm_zero_copy"]
        odd = {r.note for r in rows if r.nbytes == 6002}
        assert odd == {"6002 bytes do not split into 2 equal shards of torch.bfloat16"}
        cell = cells(result.rows, op)[("4KiB", "eager")]
        c = compare(cell, op)
        assert c.best_no_copy[0] == "nccl" and c.best_copy[0] == "nccl" and c.vs_no_copy > 0


def test_tables_print_each_op(result):
    console = Console(record=True, width=250)
    print_bench(result, console)
    text = console.export_text()
    assert "reduce_scatter: median us per call" in text and "all_gather: median us per call" in text
    assert all("x nccl" in line for line in losses(result.rows))


def test_the_all_reduce_has_the_nccl_symm_baselines(result):
    notes = {r.impl: r.note for r in result.rows if r.op == "all_reduce" and r.label == "4KiB"}
    assert "no autosymm workspace" in notes["nccl_symm"] and "no autosymm workspace" in notes["nccl_symm_copy"]
    from autosymm.bench.report import COPY_OTHERS, NO_COPY_OTHERS

    assert "nccl_symm" in NO_COPY_OTHERS and "nccl_symm_copy" in COPY_OTHERS

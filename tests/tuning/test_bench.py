"""`autosymm bench`'s worker over 2 gloo processes (NCCL stands in as gloo; no GPU here)."""

import pytest
from _gloo import run_gloo
from rich.console import Console

from autosymm.tuning.bench import BenchOptions, BenchResult, print_bench, write_bench_csv
from autosymm.problem import MoEShape


def _bench(rank, world_size, options):
    from autosymm.tuning.bench import bench_job

    return bench_job(rank, world_size, options)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> BenchResult:
    options = BenchOptions(sizes=[4096, 65536], modes=["eager", "graph"],
                           shapes={"mixtral-8x7b": MoEShape(64, 8, 2)}, tokens=[4], ops=["all_reduce", "dp_to_ep", "ep_to_dp"])
    db = str(tmp_path_factory.mktemp("bench") / "none.sqlite")
    out = run_gloo(_bench, 2, options, env={"all": {"AUTOSYMM_DB": db}})
    assert out[1] is None  # only rank 0 returns the result
    return out[0]


def test_all_reduce_rows_are_validated_and_timed(result):
    rows = [r for r in result.rows if r.op == "all_reduce"]
    assert {r.mode for r in rows} == {"eager"}  # no CUDA graphs on the CPU
    auto = [r for r in rows if r.impl == "autosymm"]
    assert len(auto) == 2 and all(r.us and r.us > 0 and r.backend == "nccl" and not r.note for r in auto)
    nccl = [r for r in rows if r.impl == "nccl"]
    assert all(r.us and r.us > 0 for r in nccl)
    torch_rows = [r for r in rows if r.impl.startswith("torch_")]
    assert torch_rows and all(r.us is None and r.note for r in torch_rows)  # no symmetric workspace here


def test_moe_rows(result):
    rows = [r for r in result.rows if r.op in ("dp_to_ep", "ep_to_dp")]
    assert {r.op for r in rows} == {"dp_to_ep", "ep_to_dp"}
    assert all(r.us and r.us > 0 for r in rows), rows  # both impls agree with the NCCL path


def test_table_and_csv(result, tmp_path):
    console = Console(record=True, width=200)
    print_bench(result, console)
    text = console.export_text()
    assert "all_reduce: median us" in text and "4KiB" in text and "autosymm/best other" in text
    assert "dp_to_ep: median us" in text and "link GB/s" in text and "% peer write" in text
    path = tmp_path / "bench.csv"
    write_bench_csv(result, str(path))
    lines = path.read_text().splitlines()
    assert lines[0].startswith("op,label,nbytes,mode,impl,us") and len(lines) == 1 + len(result.rows)


def test_plot(result, tmp_path):
    pytest.importorskip("matplotlib")
    from autosymm.tuning.plot import plot_bench

    path = tmp_path / "bench.png"
    plot_bench(result, str(path))
    assert path.stat().st_size > 10_000


def test_moe_link_bandwidth_counts_only_the_rows_that_leave_the_rank():
    from autosymm.tuning.bench import moe_link_gbps

    assert moe_link_gbps(2_000_000, 10.0, 2) == 100.0  # half of 2 MB in 10 us
    assert moe_link_gbps(4_000_000, 10.0, 4) == 300.0  # three quarters of 4 MB

"""`autosymm bench`: its worker over 2 gloo processes (gloo stands in for NCCL; no GPU here), and
the pure parts (sizes, plans, output checks, best-other ratios, losses, CSV, workers' env)."""

import csv

import pytest
import torch
from _gloo import run_gloo
from rich.console import Console

from autosymm.problem import MoEShape
from autosymm.bench import baselines as bb
from autosymm.bench.run import BenchOptions, BenchResult, BenchRow, moe_link_gbps, print_bench, write_bench_csv
from autosymm.bench.report import (ALL_REDUCE_IMPLS, COPY_OTHERS, DEFAULT_SIZES, NO_COPY_OTHERS, best_of, cells,
                                   compare, csv_rows, failures, losses, parse_bench_sizes, size_label, worst_ratios)


def _bench(rank, world_size, options):
    from autosymm.bench.run import bench_job

    return bench_job(rank, world_size, options)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> BenchResult:
    options = BenchOptions(sizes=[4096, 6000], modes=["eager", "graph"],
                           shapes={"mixtral-8x7b": MoEShape(64, 8, 2)}, tokens=[4], ops=["all_reduce", "dp_to_ep", "ep_to_dp"])
    db = str(tmp_path_factory.mktemp("bench") / "none.sqlite")
    out = run_gloo(_bench, 2, options, env={"all": {"AUTOSYMM_DB": db}})
    assert out[1] is None  # only rank 0 returns the result
    return out[0]


# ------------------------------------------------------------------------------ the worker (gloo)


def test_all_reduce_rows_are_validated_and_timed(result):
    rows = [r for r in result.rows if r.op == "all_reduce"]
    assert {r.mode for r in rows} == {"eager"}  # no CUDA graphs on the CPU
    assert [r.impl for r in rows if r.label == "4KiB"] == list(ALL_REDUCE_IMPLS)
    assert {r.label for r in rows} == {"4KiB", "6kB"}
    for impl in ("nccl", "autosymm"):  # gloo serves both; autosymm falls back to it
        timed = [r for r in rows if r.impl == impl]
        assert len(timed) == 2 and all(r.us and r.us > 0 and r.backend == "nccl" and not r.note for r in timed)
    untimed = [r for r in rows if r.impl.startswith("torch_") or r.impl == "autosymm_zero_copy"]
    assert untimed and all(r.us is None and "here" in r.note for r in untimed)  # no symmetric memory on gloo
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in result.comm_env  # tests/conftest.py sets it; recorded


def test_moe_rows(result):
    rows = [r for r in result.rows if r.op in ("dp_to_ep", "ep_to_dp")]
    assert {(r.op, r.impl) for r in rows} == {(op, impl) for op in ("dp_to_ep", "ep_to_dp")
                                              for impl in ("autosymm", "nccl", "plain_all_to_all")}
    assert all(r.us and r.us > 0 for r in rows), rows  # all agree with the NCCL path
    assert {r.backend for r in rows if r.impl == "nccl"} == {"nccl_all_to_all"}
    assert {r.backend for r in rows if r.impl == "plain_all_to_all"} == {"index_select + all_to_all_single"}
    assert all(r.nbytes == 4 * 2 * 64 * 2 for r in rows)  # tokens x top-k x d_model x bf16


def test_table_and_csv(result, tmp_path):
    console = Console(record=True, width=250)
    print_bench(result, console)
    text = console.export_text()
    assert "all_reduce: median us" in text and "4KiB" in text and "6kB" in text and "…" not in text
    assert "autosymm / best no-copy" in text and "autosymm / best with-copy" in text
    assert "dp_to_ep: median us" in text and "link GB/s nccl" in text and result.comm_env in text
    assert "link GB/s plain_all_to_all" in text and "autosymm / plain" in text
    assert "all_reduce torch_two_shot (4KiB eager, 6kB eager): no torch symmetric memory" in text
    path = tmp_path / "bench.csv"
    write_bench_csv(result, str(path))
    with open(path) as f:
        header = f.readline().strip().split(",")
        assert header == ["op", "label", "nbytes", "mode", "impl", "us", "backend", "note", "world_size", "gpu",
                          "vs_best_no_copy", "vs_best_copy", "comm_env"]
        f.seek(0)
        assert len(list(csv.DictReader(f))) == len(result.rows)


def test_plot(result, tmp_path):
    pytest.importorskip("matplotlib")
    from autosymm.bench.plot import plot_bench

    path = tmp_path / "bench.png"
    plot_bench(result, str(path))
    assert path.stat().st_size > 10_000


# ------------------------------------------------------------------------------ ratios and report


def _cell(label, mode, op="all_reduce", **times):
    return [BenchRow(op, label, 6000, mode, impl, us) for impl, us in times.items()]


ROWS = (_cell("6kB", "eager", nccl=30.0, torch_one_shot=9.0, torch_two_shot=7.5, torch_one_shot_copy=12.0,
              torch_two_shot_copy=20.0, autosymm=8.25, autosymm_zero_copy=7.0)
        + _cell("6kB", "graph", nccl=11.0, torch_one_shot=None, torch_two_shot=8.0, torch_one_shot_copy=None,
                torch_two_shot_copy=None, autosymm=4.0, autosymm_zero_copy=None)
        + _cell("4 tok", "eager", op="dp_to_ep", autosymm=50.0, nccl=40.0)
        + _cell("8 tok", "eager", op="ep_to_dp", autosymm=50.0, nccl=80.0, plain_all_to_all=45.0))


def test_best_other_with_and_without_copy():
    times = {"nccl": 30.0, "torch_two_shot": 7.5, "torch_one_shot_copy": 12.0, "autosymm": 1.0, "torch_one_shot": None}
    assert best_of(times, NO_COPY_OTHERS) == ("torch_two_shot", 7.5)
    assert best_of(times, COPY_OTHERS) == ("torch_one_shot_copy", 12.0)
    assert best_of({"nccl": None}, NO_COPY_OTHERS) is None
    assert "autosymm" not in NO_COPY_OTHERS + COPY_OTHERS and "nccl" in NO_COPY_OTHERS and "nccl" in COPY_OTHERS


def test_ratios_per_call_and_mode():
    by_cell = cells(ROWS, "all_reduce")
    eager = compare(by_cell[("6kB", "eager")], "all_reduce")
    assert eager.vs_no_copy == pytest.approx(1.1) and eager.vs_copy == pytest.approx(8.25 / 12.0)
    zero = compare(by_cell[("6kB", "eager")], "all_reduce", "autosymm_zero_copy")
    assert zero.vs_no_copy == pytest.approx(7.0 / 7.5)
    graph = compare(by_cell[("6kB", "graph")], "all_reduce")
    assert graph.vs_no_copy == pytest.approx(0.5) and graph.vs_copy == pytest.approx(4.0 / 11.0)  # NCCL is in both
    assert compare(by_cell[("6kB", "graph")], "all_reduce", "autosymm_zero_copy").vs_no_copy is None  # not timed
    moe = compare(cells(ROWS, "dp_to_ep")[("4 tok", "eager")], "dp_to_ep")
    assert moe.vs_no_copy == moe.vs_copy == pytest.approx(1.25)  # MoE: against the NCCL path
    plain = compare(cells(ROWS, "ep_to_dp")[("8 tok", "eager")], "ep_to_dp")
    assert plain.best_no_copy == ("plain_all_to_all", 45.0)  # the faster of the two NCCL paths


def test_losses_name_the_winner_and_the_baseline_kind():
    assert losses(ROWS) == [
        "all_reduce 6kB eager: autosymm 8.25 us = 1.10x torch_two_shot (7.50 us, no copy)",
        "dp_to_ep 4 tok eager: autosymm 50.00 us = 1.25x nccl (40.00 us, no copy and with copy)",
        "ep_to_dp 8 tok eager: autosymm 50.00 us = 1.11x plain_all_to_all (45.00 us, no copy and with copy)",
    ]
    slow_zero_copy = [BenchRow("all_reduce", "4KiB", 4096, "graph", impl, us) for impl, us in
                      (("nccl", 9.0), ("torch_two_shot", 5.0), ("torch_two_shot_copy", 6.0),
                       ("autosymm", 5.5), ("autosymm_zero_copy", 6.5))]
    assert losses(slow_zero_copy) == [  # zero-copy against the no-copy baselines only
        "all_reduce 4KiB graph: autosymm 5.50 us = 1.10x torch_two_shot (5.00 us, no copy)",
        "all_reduce 4KiB graph: autosymm_zero_copy 6.50 us = 1.30x torch_two_shot (5.00 us, no copy)",
    ]
    rows = ROWS + [BenchRow("all_reduce", "6kB", 6000, "graph", "torch_one_shot", None, note="wrong output")]
    assert failures(rows) == ["all_reduce torch_one_shot (6kB graph): wrong output"]


def test_worst_ratios_per_mode_and_in_the_mid_range():
    rows = list(ROWS) + _cell("1MiB", "eager", nccl=20.0, torch_two_shot=10.0, torch_two_shot_copy=15.0, autosymm=9.0)
    for r in rows[-4:]:
        r.nbytes = 1 << 20
    assert worst_ratios(rows) == [
        "eager: autosymm / best no-copy <= 1.100 (6kB), 512KiB-8MiB <= 0.900 (1MiB); "
        "autosymm / best with-copy <= 0.688 (6kB), 512KiB-8MiB <= 0.600 (1MiB)",
        "graph: autosymm / best no-copy <= 0.500 (6kB); autosymm / best with-copy <= 0.364 (6kB)"]
    assert worst_ratios(rows, "autosymm_zero_copy") == [
        "eager: autosymm_zero_copy / best no-copy <= 0.933 (6kB)"]


def test_csv_ratios_only_on_autosymm_rows():
    result = BenchResult({"gpu_name": "NVIDIA H200"}, 2, 0.0, 0.0, list(ROWS), comm_env="NCCL_NVLS_ENABLE=0")
    rows = {(r["op"], r["mode"], r["impl"]): r for r in csv_rows(result)}
    assert rows[("all_reduce", "eager", "autosymm")]["vs_best_no_copy"] == "1.1000"
    assert rows[("all_reduce", "eager", "autosymm")]["vs_best_copy"] == "0.6875"
    assert rows[("all_reduce", "eager", "nccl")]["vs_best_no_copy"] == ""
    assert rows[("all_reduce", "graph", "autosymm_zero_copy")]["vs_best_no_copy"] == ""
    assert {r["comm_env"] for r in rows.values()} == {"NCCL_NVLS_ENABLE=0"}


def test_moe_link_bandwidth_counts_only_the_rows_that_leave_the_rank():
    assert moe_link_gbps(2_000_000, 10.0, 2) == 100.0  # half of 2 MB in 10 us
    assert moe_link_gbps(4_000_000, 10.0, 4) == 300.0  # three quarters of 4 MB


# ------------------------------------------------------------------------------ sizes and plans


def test_default_sizes_mix_powers_of_two_and_sizes_between():
    sizes = parse_bench_sizes(DEFAULT_SIZES)
    powers = [s for s in sizes if s & (s - 1) == 0]
    assert powers == [1 << p for p in range(12, 27)]  # 4 KiB .. 64 MiB
    assert {6000, 100_000, 768 << 10, 3_000_000, 5_000_000, 12_000_000} <= set(sizes)
    assert parse_bench_sizes("1MiB, 4KiB:16KiB,1MiB") == [4096, 8192, 16384, 1 << 20]
    with pytest.raises(ValueError):
        parse_bench_sizes(" , ")


@pytest.mark.parametrize("nbytes, label", [(4096, "4KiB"), (786432, "768KiB"), (1536 << 10, "1.5MiB"),
                                           (3_000_000, "3MB"), (6000, "6kB"), (1_234_567, "1234.567kB"), (500, "500B")])
def test_size_labels(nbytes, label):
    assert size_label(nbytes) == label


def test_plan_batches_calls_between_events():
    small, large = bb.bench_plan(6000, "eager"), bb.bench_plan(64 << 20, "graph")
    assert (small.n_inputs, small.calls, small.warmup_calls) == (8, 40, 40)
    assert (large.n_inputs, large.calls) == (2, 16)
    assert bb.bench_plan(1 << 30, "eager").calls == bb.MIN_CALLS
    assert bb.pool_bytes([4096, 64 << 20], 2) == 3 * (64 << 20)  # two inputs and a push stage
    with pytest.raises(ValueError, match="mode"):
        bb.bench_plan(4096, "lazy")


# ------------------------------------------------------------------------------ output checks


def test_two_ranks_must_match_nccl_bit_for_bit():
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(0)).clamp(-4, 4).bfloat16()
    assert bb.check_output(ref.clone(), ref, 2) is None
    off = ref.clone()
    off[7] += 1.0  # |x| <= 4: bf16 spacing there is at most 2^-5, so the value changes
    assert bb.check_output(off, ref, 2) == "differs from NCCL's sum in 1 of 1000 elements"
    assert "expected (1000,)" in bb.check_output(ref[:10], ref, 2)


def test_more_ranks_allow_a_reordered_sum():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(4096, generator=gen) for _ in range(4)]
    ring = (((parts[0].bfloat16() + parts[1].bfloat16()) + parts[2].bfloat16()) + parts[3].bfloat16())
    other = (((parts[3].bfloat16() + parts[2].bfloat16()) + parts[1].bfloat16()) + parts[0].bfloat16())
    assert not torch.equal(ring, other) and bb.check_output(other, ring, 4) is None
    assert "relative error" in bb.check_output(other * 1.1, ring, 4)
    nan = other.clone()
    nan[0] = float("nan")
    assert "relative error nan" in bb.check_output(nan, ring, 4)


# ------------------------------------------------------------------------------ implementations


class _Workspace:
    def __init__(self, capacity, used=0):
        self._capacity, self.empty_bytes = capacity, used

    def capacity(self, region):
        return self._capacity


def test_what_cannot_run_says_why():
    setup = bb.Setup(None, "0", torch.device("cpu"), torch.bfloat16)
    assert "no torch symmetric memory" in bb.torch_ops_why_not(setup, 4096)
    setup.pool = object()
    assert bb.torch_ops_why_not(setup, 4096) is None
    assert "multiple of 4 bytes" in bb.torch_ops_why_not(setup, 4098)
    setup.dtype = torch.float16
    assert "bf16 and fp32" in bb.torch_ops_why_not(setup, 4096)
    assert "no autosymm workspace" in bb.zero_copy_why_not(setup, 4096, 8, 2)
    setup.workspace = _Workspace(10 * 4096)
    assert bb.zero_copy_why_not(setup, 4096, 8, 2) is None  # 8 inputs + 1 push slot
    setup.workspace = _Workspace(10 * 4096, used=4096)
    assert "region has 36864" in bb.zero_copy_why_not(setup, 4096, 8, 3)
    with pytest.raises(ValueError, match="unknown all-reduce implementation 'mpi'"):
        bb.build("mpi", setup, 16, 2)


def test_workers_leave_the_environment_alone(monkeypatch):
    from autosymm.tuning import workers

    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(workers, "_init", lambda *args: None)  # torchrun path: this process is the worker

    def seen(rank, world_size):
        import os

        return {k: os.environ.get(k) for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE",
                                                "NVSHMEM_DISABLE_NVLS")}

    assert workers.run_workers(seen, None) == {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": None,
                                               "NVSHMEM_DISABLE_NVLS": None}


@pytest.fixture(scope="module")
def fused_result(tmp_path_factory) -> BenchResult:
    options = BenchOptions(sizes=[4096], modes=["eager"], shapes={}, tokens=[3], ops=["all_reduce_rmsnorm"])
    db = str(tmp_path_factory.mktemp("bench_fused") / "none.sqlite")
    return run_gloo(_bench, 2, options, env={"all": {"AUTOSYMM_DB": db}})[0]


def test_fused_rows_report_flashinfer_as_a_baseline(fused_result):
    from autosymm.spec.all_reduce_rmsnorm import HIDDEN

    rows = [r for r in fused_result.rows if r.op == "all_reduce_rmsnorm"]
    assert {(r.label, r.impl) for r in rows} == {(f"h{h} 3 tok", i) for h in HIDDEN
                                                 for i in ("nccl_fused", "flashinfer_fused", "autosymm")}
    for row in rows:
        if row.impl == "flashinfer_fused":  # not installed here: said why, not timed
            assert row.us is None and row.note.startswith("flashinfer not importable")
        else:  # autosymm's untuned call runs the NCCL composition over gloo
            assert row.us is not None and row.us > 0 and row.note == "", row
            assert row.backend == "nccl_fused"
    console = Console(record=True, width=200)
    print_bench(fused_result, console)
    assert "all_reduce_rmsnorm: median us per call" in console.export_text()

"""scripts/bench_moe_fallback.py on the CPU: the gloo smoke run end to end (every path checked
against the all_gathered expectation, CSV and markdown written), the peer-write kernel under the
Triton interpreter, and the report's arithmetic and table."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_moe_fallback", ROOT / "scripts" / "bench_moe_fallback.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_moe_fallback"] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_on_two_gloo_ranks(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "absent.sqlite"))  # no user DB: the fallbacks
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the spawned ranks import bench_moe_fallback
    out_csv, out_md = tmp_path / "moe.csv", tmp_path / "moe.md"
    bench.main(["--cpu", "--nproc", "2", "--shapes", "mixtral-8x7b,d64_e8_k2", "--tokens", "16", "--repeats", "2",
                "--csv", str(out_csv), "--md", str(out_md)])
    rows = list(csv.DictReader(open(out_csv)))
    assert [(r["shape"], r["model"], r["op"]) for r in rows] == [
        ("d4096_e8_k2", "mixtral-8x7b", "dp_to_ep"), ("d4096_e8_k2", "mixtral-8x7b", "ep_to_dp"),
        ("d64_e8_k2", "", "dp_to_ep"), ("d64_e8_k2", "", "ep_to_dp")]
    for r in rows:  # every path ran and was checked; on gloo nothing is measured: no time, no ratio
        assert r["autosymm_backend"] == "nccl_all_to_all" and r["note"] == "no CUDA graphs here"
        assert all(r[key] == "" for key in ("autosymm_nccl_us", "plain_nccl_us", "autosymm_us", "autosymm_graph_us",
                                            "autosymm_GBps", "autosymm_pct_peer", "plain_over_autosymm",
                                            "plain_over_autosymm_graph", "plain_over_autosymm_nccl"))
    assert float(rows[0]["remote_MB"]) > 0  # random placement over 8 experts: some pairs leave the rank
    text = out_md.read_text()
    assert "| d4096_e8_k2 | mixtral-8x7b | 16 | dp_to_ep |" in text and "no peer write" in text
    assert "nothing to measure, so no times and no ratios" in text and "x |" not in text  # no "1.31x" cell
    assert text in capsys.readouterr().out


def test_peer_write_kernel_copies_into_the_address_it_is_given(bench):
    src = torch.randint(-2**31, 2**31 - 1, (3 * bench.PEER_WRITE_BLOCK,), dtype=torch.int32)
    dst = torch.zeros_like(src)
    bench.launch_peer_write(torch.tensor([dst.data_ptr()], dtype=torch.int64), src, programs=2)  # strided loop
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="multiple of 4096 words"):
        bench.launch_peer_write(torch.tensor([dst.data_ptr()]), src[:100], programs=1)


def _row(**kw):
    row = {"shape": "d5120_e160_k6", "model": "", "tokens": 3000, "op": "dp_to_ep", "world_size": 2,
           "remote_MB": 100.0, "autosymm_backend": "triton_moe", "autosymm_graph_backend": "triton_moe", "note": "",
           "autosymm_nccl_us": 1000.0, "plain_nccl_us": 500.0, "autosymm_us": 300.0, "autosymm_graph_us": 250.0}
    return {**row, **kw}


def test_bandwidth_share_and_ratios(bench):
    assert bench.gbps(100.0, 250.0) == 400.0  # 100 MB in 250 us
    assert bench.gbps(1.0, None) is None and bench.pct(None, 400.0) is None and bench.ratio(5.0, None) is None
    assert bench.pct(360.0, 400.0) == 90.0 and bench.ratio(500.0, 250.0) == 2.0
    (eager, graph_less) = bench.finish([_row(), _row(op="ep_to_dp", autosymm_graph_us=None)],
                                       {"triton 256MiB": 400.0, "copy_ 256MiB": 380.0})
    assert (eager["autosymm_GBps"], eager["autosymm_graph_GBps"]) == (333.3, 400.0)
    assert (eager["autosymm_pct_peer"], eager["autosymm_graph_pct_peer"]) == (83.3, 100.0)  # of the best peer write
    assert (eager["plain_over_autosymm"], eager["plain_over_autosymm_graph"], eager["plain_over_autosymm_nccl"]) == \
        (1.667, 2.0, 0.5)
    assert graph_less["autosymm_graph_GBps"] is None and graph_less["plain_over_autosymm_graph"] is None
    assert bench.finish([_row()], {})[0]["autosymm_pct_peer"] is None  # no peer write measured (gloo)
    (smoke,) = bench.finish([_row()], {}, measured=False)  # a CPU run: nothing to compare
    assert smoke["plain_over_autosymm"] is smoke["plain_over_autosymm_nccl"] is smoke["autosymm_us"] is None
    assert smoke["autosymm_GBps"] is None and smoke["remote_MB"] == 100.0


def test_markdown_table(bench):
    rows = bench.finish([_row(), _row(op="ep_to_dp", autosymm_graph_us=None, note="graph: x is not capturable")],
                        {"triton 256MiB": 400.0})
    text = bench.markdown(rows, {"triton 256MiB": 400.0})
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| shape |"))
    assert lines[header + 1] == "|" + "---|" * len(bench.COLUMNS)
    assert lines[header + 2] == ("| d5120_e160_k6 | - | 3000 | dp_to_ep | 100.00 | 1000.0 | 500.0 | 300.0 | 333 | 83% "
                                 "| 250.0 | 400 | 100% | 1.67x | 2.00x | 0.50x | triton_moe | triton_moe |")
    assert "| 250.0 |" not in lines[header + 3] and "| - | - | - |" in lines[header + 3]
    assert "triton 256MiB 400.0 GB/s" in text and "- graph: x is not capturable" in text

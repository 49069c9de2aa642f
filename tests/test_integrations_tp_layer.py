"""scripts/bench_tp_layer.py and examples/tp_decoder_layer.py on the CPU: the tiny layer on 2 gloo
ranks end to end (NCCL's stand-in and autosymm agree bit for bit), the layer against an unsplit
reference, and the report's columns."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("bench_tp_layer", ROOT / "scripts" / "bench_tp_layer.py")


def test_tiny_bench_runs_on_two_gloo_ranks(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "absent.sqlite"))  # no user DB: the fallbacks
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the spawned ranks import bench_tp_layer
    out = tmp_path / "tp.md"
    assert bench.main(["--tiny", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    assert {(r["phase"], r["n_tokens"], r["backend"]) for r in rows} == {
        (phase, n, backend) for phase, n in (("decode", "1"), ("decode", "2"), ("prefill", "8"))
        for backend in ("nccl", "autosymm", "autosymm_fused")}
    assert all(r["bit_equal"] == "True" and float(r["step_us"]) > 0 for r in rows)
    text = out.read_text()
    assert "| decode | 1 | eager |" in text
    # every backend is the same gloo call on the CPU: no speed-up is claimed
    assert "nothing to measure" in text and "autosymm vs NCCL" not in text and "x |" not in text


def test_layer_shards_sum_to_the_unsplit_layer(bench):
    """Two shards' partial sums, added as the all-reduce would, equal one rank holding both
    halves of every weight (the TP split is right, not only self-consistent)."""
    from tp_decoder_layer import TINY, ShardWeights, TPDecoderLayer

    torch.manual_seed(0)
    shards = [ShardWeights(TINY, rank, 2, torch.float64, "cpu") for rank in range(2)]
    x = torch.randn(3, TINY.hidden, dtype=torch.float64)
    partials = {}

    def recording(rank):
        def all_reduce(t):
            partials.setdefault(rank, []).append(t.clone())
            return t
        return all_reduce

    for rank in range(2):  # pass 1: collect each rank's partial O projections
        TPDecoderLayer(shards[rank], recording(rank)).decode(x)
    attn_sum = partials[0][0] + partials[1][0]
    # The unsplit reference: heads and intermediate features concatenated over the shards.
    whole = ShardWeights(TINY, 0, 1, torch.float64, "cpu")
    with torch.no_grad():
        n_q, n_kv, d = TINY.n_heads // 2, TINY.n_kv_heads // 2, TINY.head_dim
        parts = [s.wqkv.split([n_q * d, n_kv * d, n_kv * d]) for s in shards]
        whole.wqkv.copy_(torch.cat([p[i] for i in range(3) for p in parts]))
        whole.wo.copy_(torch.cat([s.wo for s in shards], dim=1))
        whole.k_cache.copy_(torch.cat([s.k_cache for s in shards], dim=1))
        whole.v_cache.copy_(torch.cat([s.v_cache for s in shards], dim=1))
        whole.norm1.copy_(shards[0].norm1)
    TPDecoderLayer(whole, recording("whole")).decode(x)
    torch.testing.assert_close(partials["whole"][0], attn_sum)


def test_report_marks_mismatches_and_ratios(bench, tmp_path):
    R = bench.Result
    results = [R("decode", 8, "compiled", "nccl", 100.0, True, 0.0), R("decode", 8, "compiled", "torch_one_shot", 80.0,
               False, 1e-3), R("decode", 8, "compiled", "autosymm", 50.0, False, 0.5, ok=False)]
    text = bench.markdown(results, {"torch_two_shot": "why"}, {"device": "x"})
    assert "| decode | 8 | compiled | 100.0 | 80.0 ~ | 50.0 MISMATCH | 2.00x | 1.60x |" in text
    assert "skipped torch_two_shot: why" in text
    assert bench.write_report(tmp_path / "r.md", results, {}, {}) == 1
    assert bench.write_report(tmp_path / "r.md", results[:2], {}, {}) == 0

"""The reduce-scatter and all-gather records (autosymm.collectives.reduce_scatter / all_gather) and
their tuning sides: problems keyed by the full tensor's bytes, the shard checks, DB rows of their
config types, the dispatcher's NCCL fallback until rows exist (and the tuned row once one does),
the tuning inputs and references' shapes."""

from __future__ import annotations

import pytest
import torch

from autosymm import spec
from autosymm.backends import Capabilities, get_backend
from autosymm.configs import AllGatherConfig, ReduceScatterConfig
from autosymm.spec import ALL_GATHER, REDUCE_SCATTER, PointRequest
from autosymm.collectives.reduce_scatter import shard_counts
from autosymm.db.store import Row, TuningDB
from autosymm.db.read import DBSource
from autosymm.runtime.dispatch import decide
from autosymm.problem import Problem
from autosymm.tuning import ops as tuning_ops
from autosymm.tuning.ops.reduce_scatter import tuning_counts
from autosymm.tuning.reference import ProblemData

CAPS = Capabilities(world_size=4, all_reduce_bytes=64 << 20, moe_bytes=1 << 20, compute_capability=(9, 0))


def test_problems_are_the_full_tensors_bytes_at_the_all_reduce_points():
    rs = REDUCE_SCATTER.problems(PointRequest(("bf16",), 4))
    assert [p.nbytes for p in rs[:3]] == [4096, 6144, 8192] and len(rs) == 33
    assert all(p.record is REDUCE_SCATTER and p.bucket == p.nbytes and p.shape_key == "" for p in rs)
    ag = ALL_GATHER.problems(PointRequest(("fp32",), 2, sizes=(3000,)))
    assert [(p.op, p.dtype, p.nbytes, p.bucket) for p in ag] == [("all_gather", "fp32", 3000, 3000)]
    assert "reduce_scatter" not in spec.default_tuned() and "all_gather" not in spec.default_tuned()
    assert REDUCE_SCATTER.lookups.bf16_same_bytes and ALL_GATHER.lookups.bf16_same_bytes


def test_shard_counts_follow_torch_distributed_and_per_rank_sizes():
    full, shard = torch.empty(12, 3), torch.empty(4, 3)
    assert shard_counts(REDUCE_SCATTER, full, shard, None, 1, 3) is None
    assert shard_counts(REDUCE_SCATTER, torch.empty(7, 3), torch.empty(2, 3), [1, 2, 4], 1, 3) == (3, 6, 12)
    assert shard_counts(ALL_GATHER, torch.empty(1, 2), torch.empty(0, 2), [1, 0], 1, 2) == (2, 0)
    with pytest.raises(ValueError, match="world_size=2 times"):
        shard_counts(REDUCE_SCATTER, full, shard, None, 0, 2)
    with pytest.raises(ValueError, match="one row shape"):
        shard_counts(ALL_GATHER, torch.empty(3, 2), torch.empty(1, 3), [1, 2], 0, 2)
    with pytest.raises(ValueError, match="share one dtype"):
        shard_counts(ALL_GATHER, torch.empty(4), torch.empty(2, dtype=torch.int32), None, 0, 2)


def _row(op, backend, config, us, bucket=1 << 20):
    return Row(hardware="hw", world_size=4, op=op, dtype="bf16", bucket=bucket, backend=backend, median_us=us,
               config=config, nccl_us=20.0, gpu="H200")


def test_rows_parse_into_the_records_config_types_and_dispatch_serves_them(tmp_path):
    rs_config, ag_config = ReduceScatterConfig("pull", 4096, 16, 8), AllGatherConfig("push", 16384, 8, 4)
    db = TuningDB(tmp_path / "t.sqlite")
    db.record_many([_row("reduce_scatter", "triton_reduce_scatter_pull", rs_config, 8.0),
                    _row("reduce_scatter", "nccl_reduce_scatter", None, 20.0),
                    _row("all_gather", "triton_all_gather_push", ag_config, 7.0)])
    assert {r.backend: r.config_obj for r in db.rows()}["triton_all_gather_push"] == ag_config
    with pytest.raises(ValueError, match="does not belong to op 'all_gather'"):
        _row("all_gather", "triton_all_gather_push", rs_config, 1.0)
    sources = [DBSource(db, "user")]
    rs = decide(Problem("reduce_scatter", "bf16", 4, nbytes=1 << 20), "eager", CAPS, sources, "hw")
    assert (rs.backend, rs.config, rs.measured) == ("triton_reduce_scatter_pull", rs_config, True)
    ag = decide(Problem("all_gather", "fp16", 4, nbytes=1 << 20), "graph", CAPS, sources, "hw")
    assert ag.backend == "triton_all_gather_push" and "no fp16 row, using the bf16" in ag.reason
    # no row for this size's neighbourhood on other hardware: NCCL, said so
    none = decide(Problem("all_gather", "bf16", 4, nbytes=3000), "eager", CAPS, sources, "other-hw")
    assert none.backend == "nccl_all_gather" and "no tuned row" in none.reason
    assert get_backend("nccl_reduce_scatter").why_not(Problem("reduce_scatter", "fp32", 4, nbytes=12), CAPS) is None


@pytest.mark.parametrize("op,numel,world_size", [("reduce_scatter", 12, 2), ("reduce_scatter", 13, 3),
                                                 ("all_gather", 16, 4), ("all_gather", 7, 2)])
def test_tuning_inputs_have_the_shapes_the_launchers_take(op, numel, world_size):
    problem = Problem(op, "bf16", world_size, nbytes=2 * numel)
    for rank in range(world_size):
        data = ProblemData(problem, None, torch.device("cpu"), rank, n_inputs=3)
        data.allocate()
        output, input, counts = data.validation_args()
        assert counts == tuning_counts(numel, world_size)
        shard = counts[rank] if counts else numel // world_size
        full, part = (input, output) if op == "reduce_scatter" else (output, input)
        assert (full.numel(), part.numel()) == (numel, shard)
        assert all(len(args) == 3 and args[0].shape == output.shape for args in data.timing_args())
    assert tuning_counts(13, 3) == [5, 4, 4] and tuning_counts(12, 3) is None
    need = tuning_ops.get(op).workspace_bytes(Problem(op, "bf16", 8, nbytes=64 << 20))
    assert need[1] == 0 and need[0] >= (64 << 20 if op == "reduce_scatter" else 8 << 20)

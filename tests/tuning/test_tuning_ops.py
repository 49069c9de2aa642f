"""The tuning side's per-op modules (autosymm.tuning.ops): one per registered op, in the registry's
order, each building its inputs and declaring its workspace needs."""

from __future__ import annotations

import pytest
import torch

from autosymm import spec
from autosymm.problem import MoEShape, Problem
from autosymm.tuning import ops as tuning_ops
from autosymm.tuning.reference import ProblemData


def test_every_registered_op_has_its_tuning_module_in_registry_order():
    assert tuple(op.record for op in tuning_ops.registered()) == spec.ALL
    assert all(tuning_ops.get(r.name).record is r for r in spec.ALL)
    with pytest.raises(ValueError, match="op='x' is not one of"):
        tuning_ops.get("x")
    # the MoE conversions and the all-gather copy: bit for bit
    assert [op.exact for op in tuning_ops.registered()] == [False, True, True, False, False, True]


def test_workspace_needs_are_each_ops_and_at_least_the_defaults():
    from autosymm.backends import triton_all_reduce, triton_fused
    from autosymm.geometry import moe_region_bytes

    ar, moe = Problem.all_reduce(64 << 20, "bf16", 8), Problem.moe("ep_to_dp", MoEShape(7168, 256, 8), 4096, "bf16", 8)
    fused = Problem.all_reduce_rmsnorm(8192, 8192, "bf16", 8)
    need = tuning_ops.workspace_bytes([ar, moe, fused], (1, 1))
    assert need == (max(triton_all_reduce.largest_stage_bytes(ar.nbytes, 8),
                        triton_fused.largest_stage_bytes(fused.nbytes, 8)),
                    moe_region_bytes(4096, 8, 7168 * 2, 8))
    assert need[0] >= 2 * fused.nbytes  # the fused two-shot stages x and out rows
    assert tuning_ops.workspace_bytes([], (5, 6)) == (5, 6)


@pytest.mark.parametrize("problem", [Problem.all_reduce(256, "bf16", 2),
                                     Problem.all_reduce_rmsnorm(3, 64, "fp16", 2),
                                     Problem.moe("dp_to_ep", MoEShape(16, 4, 2), 3, "bf16", 2),
                                     Problem.moe("ep_to_dp", MoEShape(16, 4, 2), 3, "bf16", 2)])
def test_inputs_have_the_shapes_the_launchers_take(problem):
    data = ProblemData(problem, None, torch.device("cpu"), 0, n_inputs=3)
    data.allocate()
    args, timing = data.validation_args(), data.timing_args()
    assert len(timing) == 3 and all(len(t) == len(args) for t in timing)
    x = args[0]
    if problem.record.unit is spec.BYTES:
        assert x.numel() * x.element_size() == problem.nbytes and x is not data.val_input  # in place: a copy
    elif problem.record is spec.ALL_REDUCE_RMSNORM:  # the fused op: [tokens, hidden]
        assert tuple(x.shape) == (3, 64) and args[3] == pytest.approx(1e-6)
    else:
        rows = 3 if problem.record.to_experts else 3 * 2 * 2
        assert tuple(x.shape) == (rows, 16) and tuple(args[2].shape) == (6, 2)


def _public_calls(rank, world_size):
    """Each op's public call (TuningOp.public_call) on the op's validation input, checked against
    the reference as the tuner checks a candidate; gloo serves (the dispatcher's fallbacks)."""
    import torch.distributed as dist

    from autosymm.epilogue import Epilogue
    from autosymm.tuning.reference import check_output

    shape = MoEShape(16, 4, 2)
    problems = [Problem.all_reduce(256, "bf16", 2), Problem.all_reduce_rmsnorm(3, 64, "fp16", 2),
                Problem.all_reduce_rmsnorm(3, 64, "bf16", 2, epilogue=Epilogue(residual=False, gemma=True)),
                Problem.moe("dp_to_ep", shape, 3, "bf16", 2), Problem.moe("ep_to_dp", shape, 3, "bf16", 2),
                Problem("reduce_scatter", "bf16", 2, nbytes=256), Problem("reduce_scatter", "fp32", 2, nbytes=12),
                Problem("all_gather", "bf16", 2, nbytes=256), Problem("all_gather", "fp32", 2, nbytes=12)]
    checked = []
    for problem in problems:
        data = ProblemData(problem, dist.group.WORLD, torch.device("cpu"), rank, n_inputs=2)
        data.allocate()
        data.build_reference()
        call = data.op.public_call(data)
        args = data.validation_args()
        check_output(data.result(call(*args), args), data.expected, data.mask, exact=data.exact)
        for timing in data.timing_args():  # the timing inputs go through it too
            call(*timing)
        checked.append(problem.describe())
    return checked


def test_every_ops_public_call_takes_its_launchers_arguments():
    from _gloo import run_gloo

    checked = run_gloo(_public_calls, 2)
    assert checked[0] == checked[1] and len(checked[0]) == 9
    assert {tuning_ops.get(name).public_call.__func__ is not tuning_ops.TuningOp.public_call
            for name in spec.names()} == {True}  # every shipped op has one

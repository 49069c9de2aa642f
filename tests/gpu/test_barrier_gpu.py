"""Bounded barrier waits on real GPUs: a rank whose peer never launches its kernel finishes,
flags the workspace (Workspace.barrier_errors), and after Workspace.reset_signals on every rank
the same launchers work again. The poll limit is lowered for the spawned ranks
(AUTOSYMM_BARRIER_MAX_POLLS, read when autosymm.kernels.barrier is imported)."""

from __future__ import annotations

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

POLLS = 1 << 20  # about 0.3-1 s of polling on an H100/H200


def _missing_peer_body(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import RunContext
    from autosymm.backends.triton_moe import TritonMoE
    from autosymm.backends.triton_all_reduce import triton_one_shot
    from autosymm.configs import MoEConfig
    from autosymm.kernels.barrier import MAX_POLLS
    from autosymm.routing import make_expt_assignment, make_expt_dict_uniform, random_expt_indx, route
    from autosymm.problem import MoEShape, Problem
    from autosymm.geometry import SIGNAL_BYTES
    from autosymm.workspace.symm import get_workspace

    assert int(MAX_POLLS.value) == POLLS, "the spawned rank must see the lowered limit"
    device = torch.device("cuda", rank)
    ws = get_workspace(dist.group.WORLD, device, all_reduce_bytes=1 << 20, moe_bytes=8 << 20)
    ctx = RunContext(group=dist.group.WORLD, workspace=ws)

    numel = 8192 + 5
    problem = Problem.all_reduce(numel * 2, "bf16", world_size)
    all_reduce = triton_one_shot.prepare(problem, triton_one_shot.search_space(problem)[0], ctx)
    shape, tokens = MoEShape(1024, 16, 8), 1
    assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                      make_expt_dict_uniform(world_size, shape.n_expts_tot), device)
    expt_indx = random_expt_indx(world_size * tokens, shape.n_expts_tot, shape.n_expts_act, seed=1, device=device)
    gate_indx, _ = route(expt_indx)
    src = torch.randn(tokens, shape.d_model, device=device).to(torch.bfloat16)
    moe_problem = Problem.moe("dp_to_ep", shape, tokens, "bf16", world_size)
    dp_to_ep = TritonMoE().prepare(moe_problem, MoEConfig(256, 8, rows_per_program=2), ctx)  # fused end barrier

    def both():
        all_reduce(torch.ones(numel, dtype=torch.bfloat16, device=device))
        dp_to_ep(src, assignment, expt_indx, gate_indx)

    both()  # compile and bind everywhere (a compile skew past the limit would only flag errors)
    ws.reset_signals()
    assert ws.barrier_errors() == 0

    if rank == 0:  # the peers launch nothing: rank 0's kernels must still finish
        both()
        counts = ws.barrier_error_counts()  # synchronizes: both kernels ended
        assert counts["all_reduce"] > 0 and counts["moe_end"] == 1, counts
    ws.reset_signals()  # collective: every rank, pads and error slots zero again
    assert ws.barrier_errors() == 0

    x = torch.ones(numel, dtype=torch.bfloat16, device=device)
    all_reduce(x)
    dp_to_ep(src, assignment, expt_indx, gate_indx)
    assert ws.barrier_errors() == 0
    assert bool((x == world_size).all()), "a clean all-reduce after the reset"
    dist.barrier()
    assert int(ws.buffer[:SIGNAL_BYTES].count_nonzero()) == 0, "pads balanced again"


def test_a_missing_peer_never_hangs_and_reset_recovers(monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    monkeypatch.setenv("AUTOSYMM_BARRIER_MAX_POLLS", str(POLLS))  # inherited by the spawned ranks
    run_on_gpus(_missing_peer_body, world_size=2)

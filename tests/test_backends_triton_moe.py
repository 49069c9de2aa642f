"""The MoE backends: capability answers, search spaces, triton_moe launchers on simulated ranks
(interpreter); nccl_all_to_all's exchange in tests/test_backends_nccl_all_to_all.py."""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (CUDA present, TRITON_INTERPRET unset)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from autosymm import spec
from autosymm.backends import get_backend  # noqa: E402
from autosymm.backends.base import Capabilities, RunContext  # noqa: E402
from autosymm.backends.nccl_all_to_all import NCCL_ALL_TO_ALL
from autosymm.backends.triton_moe import TRITON_MOE  # noqa: E402
from autosymm.configs import MoEConfig  # noqa: E402
from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route
from _moe_ref import reference_dp_to_ep, reference_ep_to_dp, rows_written
from autosymm.problem import MODEL_SHAPES, MoEShape, Problem  # noqa: E402
from autosymm.geometry import ALIGN, moe_buffer  # noqa: E402
from autosymm.workspace.symm import simulated_workspaces  # noqa: E402

from _moe_sim import check_and_clear, presatisfy  # noqa: E402

CAPS = Capabilities(world_size=8, moe_bytes=256 << 20)
DSV3 = MODEL_SHAPES["deepseek-v3"]


def test_registry_finds_both_backends():
    assert get_backend("triton_moe") is TRITON_MOE and get_backend("nccl_all_to_all") is NCCL_ALL_TO_ALL
    for backend in (TRITON_MOE, NCCL_ALL_TO_ALL):  # listed by both MoE specs
        assert [r.name for r in spec.ALL if backend.serves(r)] == ["dp_to_ep", "ep_to_dp"]
    assert not NCCL_ALL_TO_ALL.needs.graph_capturable and TRITON_MOE.needs.graph_capturable


@pytest.mark.parametrize("problem,caps,reason", [
    (Problem.moe("dp_to_ep", DSV3, 128, "bf16", 8), CAPS, None),
    (Problem.moe("ep_to_dp", DSV3, 64, "fp32", 8), CAPS, None),
    (Problem.all_reduce(4096), CAPS, "does not serve all_reduce"),
    (Problem.moe("dp_to_ep", MoEShape(512, 64, 33), 4, "bf16", 8), CAPS, "top-k 33 outside 1..32"),
    (Problem.moe("dp_to_ep", MoEShape(512, 4, 2), 4, "bf16", 8), CAPS, "4 experts for 8 ranks"),
    (Problem.moe("dp_to_ep", DSV3, 128, "bf16", 8), Capabilities(8, moe_bytes=256 << 20, intra_node=False),
     "group spans nodes"),
    (Problem.moe("dp_to_ep", DSV3, 128, "bf16", 8), Capabilities(8), "no symmetric workspace"),
    # 8 * 512 * 8 * 7168 * 2 bytes = 448 MiB > the dp->ep part (8/9) of 256 MiB
    (Problem.moe("dp_to_ep", DSV3, 512, "bf16", 8), CAPS, "needs 469762048 bytes, the MoE workspace buffer has"),
    (Problem.moe("ep_to_dp", DSV3, 512, "fp32", 8), CAPS, "needs 117440512 bytes"),
])
def test_triton_moe_why_not(problem, caps, reason):
    got = TRITON_MOE.why_not(problem, caps)
    assert got == reason if reason is None else reason in got


def test_a_graph_mode_call_that_does_not_fit_names_the_declaration_that_reserves_it():
    problem = Problem.moe("dp_to_ep", DSV3, 512, "bf16", 8)
    got = TRITON_MOE.why_not(problem, CAPS, "graph")
    assert "needs 469762048 bytes" in got and "autosymm.init(moe=[autosymm.MoEPlan('d7168_e256_k8', 512)])" in got
    assert "autosymm.init" not in TRITON_MOE.why_not(problem, CAPS, "eager")


def test_nccl_all_to_all_serves_what_the_group_cannot_hold():
    problem = Problem.moe("dp_to_ep", DSV3, 4096, "bf16", 8)
    assert NCCL_ALL_TO_ALL.why_not(problem, Capabilities(8, intra_node=False)) is None
    assert "top-k" in NCCL_ALL_TO_ALL.why_not(Problem.moe("ep_to_dp", MoEShape(64, 64, 40), 4), CAPS)
    assert NCCL_ALL_TO_ALL.search_space(problem) == [None]


@pytest.mark.parametrize("op, grids", [
    # dp->ep: the programs walk this rank's 64 x top-8 = 512 pairs; 4 rows a program are 128 groups
    ("dp_to_ep", {1: [0, 132, 264], 2: [0, 132], 4: [0]}),
    # ep->dp: every sorted row of the 8 ranks, 4096: every persistent grid is narrower
    ("ep_to_dp", {1: [0, 132, 264], 2: [0, 132, 264], 4: [0, 132, 264]}),
])
def test_triton_moe_search_space(op, grids):
    """The space is sized to the rows the op's programs walk: persistent grids (num_blocks > 0)
    only where they are narrower than the row groups; BLOCKs up to d_model's (7168: all)."""
    problem = Problem.moe(op, DSV3, 64, "bf16", 8)
    space = TRITON_MOE.search_space(problem)
    assert space and len(space) == len(set(space)) and all(isinstance(c, MoEConfig) for c in space)
    by_rows: dict[int, set[int]] = {}
    for config in space:
        by_rows.setdefault(config.rows_per_program, set()).add(config.num_blocks)
    assert {rows: sorted(counts) for rows, counts in by_rows.items()} == grids
    assert sorted({c.block_n for c in space}) == [256, 512, 1024, 2048, 4096]


@pytest.mark.parametrize("world_size", range(1, 9))
def test_buffer_layout_splits_the_region_in_disjoint_aligned_buffers(world_size):
    moe_bytes = 1 << 20
    ep_off, ep_bytes = moe_buffer("ep_to_dp", moe_bytes, world_size)
    dp_off, dp_bytes = moe_buffer("dp_to_ep", moe_bytes, world_size)
    assert ep_off == 0 and dp_off == ep_bytes and dp_off + dp_bytes == moe_bytes
    assert ep_off % ALIGN == dp_off % ALIGN == 0
    # A problem whose ep->dp output fills its buffer has a dp->ep output (world_size times larger) that fits too.
    assert ep_bytes * world_size <= dp_bytes


# -- triton_moe launchers on simulated ranks -----------------------------------------------------

@pytest.mark.parametrize("world_size,k,dtype,config", [
    (2, 6, torch.bfloat16, MoEConfig(256, 1, rows_per_program=4)),
    (4, 2, torch.float32, MoEConfig(128, 2, rows_per_program=8, num_blocks=3)),
])
def test_triton_moe_launchers_round_trip(world_size, k, dtype, config):
    n_tokens_local, d_model, n_experts = 3, 72, 12
    dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    assignment = make_expt_assignment(world_size, n_experts, make_expt_dict_random(world_size, n_experts, seed=3))
    expt_indx = random_expt_indx(world_size * n_tokens_local, n_experts, k, seed=4, drop_fraction=0.1)
    gate, topk = route(expt_indx)
    srcs = [torch.randn(n_tokens_local, d_model).to(dtype) for _ in range(world_size)]
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    shape = MoEShape(d_model, n_experts, k)
    launchers = {op: [TRITON_MOE.prepare(Problem.moe(op, shape, n_tokens_local, dtype_name, world_size), config,
                                         RunContext(workspace=ws)) for ws in wss]
                 for op in ("dp_to_ep", "ep_to_dp")}

    def run(op, inputs, indx):
        presatisfy(wss, op)
        outs = [launch(x, assignment, expt_indx, indx) for launch, x in zip(launchers[op], inputs)]
        check_and_clear(wss, op)
        return outs

    ep = run("dp_to_ep", srcs, gate)
    for ws, out in zip(wss, ep):  # a view into the rank's own MoE region, at the dp->ep buffer
        offset = ws.offset_in_region(out, "moe")
        assert offset == moe_buffer("dp_to_ep", ws.capacity("moe"), world_size)[0]
        assert out.shape == (world_size * n_tokens_local * k, d_model) and out.dtype == dtype
    want = reference_dp_to_ep(srcs, assignment, expt_indx, gate)
    written = rows_written("dp_to_ep", assignment, expt_indx, gate, world_size)
    for rank in range(world_size):
        assert torch.equal(ep[rank][written[rank]], want[rank][written[rank]])

    ep_srcs = [x.clone() for x in ep]
    dp = run("ep_to_dp", ep_srcs, topk)
    assert run("ep_to_dp", ep_srcs, topk)[0] is dp[0]  # the same view, call after call
    want = reference_ep_to_dp(ep_srcs, assignment, expt_indx, topk)
    written = rows_written("ep_to_dp", assignment, expt_indx, topk, world_size)
    for rank in range(world_size):
        mask = written[rank]
        assert torch.equal(dp[rank][mask], want[rank][mask])
        assert torch.equal(dp[rank][mask], srcs[rank].repeat_interleave(k, 0)[mask])

"""The MoE conversion kernels under the Triton interpreter, 1..8 ranks simulated in one process.

Outputs are poisoned with random bytes first and compared bit-exactly, whole buffers included:
rows a conversion must not write (other ranks' experts, dropped pairs) must keep their poison.
"""

from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (CUDA present, TRITON_INTERPRET unset)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from autosymm.configs import MoEConfig
from autosymm.routing import (make_expt_assignment, make_expt_dict_random, make_expt_dict_uniform, random_expt_indx,
                              route)
from _moe_ref import reference_dp_to_ep, reference_ep_to_dp, rows_written
from autosymm.workspace.symm import simulated_workspaces

from _moe_sim import assert_bits_equal, dst_views, poison, run_all_ranks  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (world_size, top-k, dtype, placement, config, n_tokens_local, d_model, n_experts, drop, fused barrier:
#  True, False, or None = the launcher's default)
CASES = [
    (2, 1, FP32, "uniform", MoEConfig(256, 1), 5, 200, 4, 0.0, True),
    (2, 2, BF16, "random", MoEConfig(64, 2, rows_per_program=3), 4, 200, 6, 0.2, None),  # 4 column steps, tail
    (2, 4, FP16, "random", MoEConfig(256, 1, rows_per_program=2, num_blocks=3), 3, 96, 8, 0.0, False),
    (3, 6, BF16, "random", MoEConfig(128, 1, rows_per_program=8, num_blocks=2), 3, 200, 12, 0.1, True),
    (4, 4, FP16, "uniform", MoEConfig(256, 2, rows_per_program=8, num_blocks=5), 2, 136, 16, 0.0, None),
    (4, 8, FP32, "random", MoEConfig(256, 1, rows_per_program=16), 2, 100, 16, 0.1, False),  # d % 4 == 0
    (8, 8, BF16, "random", MoEConfig(256, 1, rows_per_program=32, num_blocks=4), 2, 200, 32, 0.05, True),
    (8, 6, FP32, "uniform", MoEConfig(512, 4, rows_per_program=16), 1, 77, 16, 0.0, None),  # odd d_model
    (8, 2, FP16, "random", MoEConfig(256, 1, rows_per_program=4, num_blocks=6), 3, 64, 8, 0.0, True),
    (1, 4, BF16, "uniform", MoEConfig(256, 1, rows_per_program=4), 4, 200, 4, 0.0, None),
    (5, 3, BF16, "random", MoEConfig(256, 1, rows_per_program=8), 2, 48, 10, 0.0, True),
]


def _setup(world_size, k, dtype, placement, n_tokens_local, d_model, n_experts, drop, seed=0, index_dtype=torch.int32):
    experts = (make_expt_dict_uniform(world_size, n_experts) if placement == "uniform"
               else make_expt_dict_random(world_size, n_experts, seed=seed))
    assignment = make_expt_assignment(world_size, n_experts, experts)
    expt_indx = random_expt_indx(world_size * n_tokens_local, n_experts, k, seed=seed + 1, drop_fraction=drop,
                                 dtype=index_dtype)
    gate_indx, topk_indx = route(expt_indx)
    gen = torch.Generator().manual_seed(seed + 2)
    srcs = [torch.randn(n_tokens_local, d_model, generator=gen).to(dtype) for _ in range(world_size)]
    return assignment, expt_indx, gate_indx, topk_indx, srcs


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ws{c[0]}-k{c[1]}-{str(c[2])[6:]}-{c[3]}-{c[4].block_n}"
                         f"x{c[4].rows_per_program}x{c[4].num_blocks}-d{c[6]}-fused{c[9]}")
def test_dp_to_ep_then_ep_to_dp(case):
    world_size, k, dtype, placement, config, n_tokens_local, d_model, n_experts, drop, fused = case
    assignment, expt_indx, gate_indx, topk_indx, srcs = _setup(world_size, k, dtype, placement, n_tokens_local,
                                                               d_model, n_experts, drop)
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)

    ep_bufs = dst_views(wss, "dp_to_ep", n_tokens_local, k, d_model, dtype)
    before = poison(ep_bufs)
    run_all_ranks("dp_to_ep", wss, config, srcs, assignment, expt_indx, gate_indx, fused_barrier=fused)
    assert_bits_equal(ep_bufs, reference_dp_to_ep(srcs, assignment, expt_indx, gate_indx, out=before), "dp->ep")

    # ep->dp of the dp->ep buffers: rows of other ranks' experts hold poison and must not be sent.
    ep_srcs = [b.clone() for b in ep_bufs]
    dp_bufs = dst_views(wss, "ep_to_dp", n_tokens_local, k, d_model, dtype)
    before = poison(dp_bufs, seed=2)
    run_all_ranks("ep_to_dp", wss, config, ep_srcs, assignment, expt_indx, topk_indx, fused_barrier=fused)
    assert_bits_equal(dp_bufs, reference_ep_to_dp(ep_srcs, assignment, expt_indx, topk_indx, out=before), "ep->dp")

    # Round trip: row t*k + j of every rank holds token t's row for each valid top-k slot j.
    written = rows_written("ep_to_dp", assignment, expt_indx, topk_indx, world_size)
    for rank in range(world_size):
        expected = srcs[rank].repeat_interleave(k, dim=0)
        mask = written[rank]
        assert torch.equal(dp_bufs[rank][mask], expected[mask]), f"round trip rank {rank}"
        assert mask.sum() == (expt_indx.view(world_size, -1)[rank] >= 0).sum()


@pytest.mark.parametrize("index_dtype", [torch.int16, torch.int64])
def test_ep_to_dp_random_rows_and_index_dtypes(index_dtype):
    """Every sorted row of every rank holds data; only the rank's own experts' rows travel."""
    world_size, k, n_tokens_local, d_model = 4, 3, 3, 40
    assignment, expt_indx, gate_indx, topk_indx, _ = _setup(world_size, k, BF16, "random", n_tokens_local,
                                                            d_model, 9, 0.1, seed=5, index_dtype=index_dtype)
    gen = torch.Generator().manual_seed(9)
    srcs = [torch.randn(world_size * n_tokens_local * k, d_model, generator=gen).to(BF16) for _ in range(world_size)]
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    bufs = dst_views(wss, "ep_to_dp", n_tokens_local, k, d_model, BF16)
    before = poison(bufs)
    config = MoEConfig(64, 1, rows_per_program=4, num_blocks=3)
    run_all_ranks("ep_to_dp", wss, config, srcs, assignment, expt_indx, topk_indx.to(index_dtype))
    assert_bits_equal(bufs, reference_ep_to_dp(srcs, assignment, expt_indx, topk_indx, out=before), "ep->dp")


def test_out_of_range_indices_write_nothing():
    """Expert ids >= n_experts and corrupt gate/topk rows are skipped, never written out of bounds."""
    world_size, k, n_tokens_local, d_model, n_experts = 2, 2, 4, 32, 4
    assignment, expt_indx, gate_indx, topk_indx, srcs = _setup(world_size, k, FP32, "uniform", n_tokens_local,
                                                               d_model, n_experts, 0.0, seed=3)
    expt_indx[0, 0] = n_experts  # invalid expert id: a dropped pair
    gate_bad = gate_indx.clone()
    gate_bad[n_tokens_local, 1] = 10**6  # rank 1's first token, slot 1: row out of range
    gate_bad[n_tokens_local + 1, 0] = -3
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    bufs = dst_views(wss, "dp_to_ep", n_tokens_local, k, d_model, FP32)
    before = poison(bufs)
    config = MoEConfig(32, 1, rows_per_program=2)
    run_all_ranks("dp_to_ep", wss, config, srcs, assignment, expt_indx, gate_bad)
    dropped = expt_indx.clone()
    dropped[n_tokens_local, 1] = dropped[n_tokens_local + 1, 0] = -1
    assert_bits_equal(bufs, reference_dp_to_ep(srcs, assignment, dropped, gate_indx, out=before), "dp->ep")

    topk_bad = topk_indx.clone()
    topk_bad[0], topk_bad[1] = -1, 10**6
    ep_srcs = [torch.randn(world_size * n_tokens_local * k, d_model) for _ in range(world_size)]
    bufs = dst_views(wss, "ep_to_dp", n_tokens_local, k, d_model, FP32)
    before = poison(bufs)
    run_all_ranks("ep_to_dp", wss, config, ep_srcs, assignment, expt_indx, topk_bad)
    want = reference_ep_to_dp(ep_srcs, assignment, expt_indx, topk_indx, out=before)
    for pair in topk_indx[:2].tolist():  # the two corrupted rows' pairs arrive nowhere
        home, row = divmod(pair, n_tokens_local * k)
        want[home][row] = before[home][row]
    assert_bits_equal(bufs, want, "ep->dp")


def test_repeated_calls_keep_pads_balanced():
    """Fused and separate end barriers alternate on one workspace; the pads stay balanced."""
    world_size, k, n_tokens_local, d_model = 2, 2, 2, 16
    assignment, expt_indx, gate_indx, _, srcs = _setup(world_size, k, FP16, "random", n_tokens_local, d_model, 4, 0.0)
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    bufs = dst_views(wss, "dp_to_ep", n_tokens_local, k, d_model, FP16)
    for fused in (True, False, True):
        before = poison(bufs)
        run_all_ranks("dp_to_ep", wss, MoEConfig(32, 1, 1, 2), srcs, assignment, expt_indx, gate_indx,
                      fused_barrier=fused)
        assert_bits_equal(bufs, reference_dp_to_ep(srcs, assignment, expt_indx, gate_indx, out=before))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("op", ["dp_to_ep", "ep_to_dp"])
def test_a_missing_peer_flags_the_error_and_the_conversion_completes(monkeypatch, op, fused):
    """Only rank 0 converts (rank 1 never launches; no signal pre-set): the end barrier's wait
    gives up, rank 0's 'moe_end' error slot counts it once, the arrival counter is back at 0
    and its signal reached rank 1."""
    from _all_reduce_sim import tiny_poll_limit
    from _moe_sim import _slots

    from autosymm.backends.triton_moe import launch

    tiny_poll_limit(monkeypatch, 3)
    world_size, k, n_tokens_local, d_model = 2, 8, 1, 64  # DeepSeek-like top-8, one token per rank
    assignment, expt_indx, gate_indx, topk_indx, srcs = _setup(world_size, k, BF16, "uniform", n_tokens_local,
                                                               d_model, 16, 0.0, seed=5)
    if op == "ep_to_dp":
        srcs = [torch.randn(world_size * n_tokens_local * k, d_model).to(BF16) for _ in range(world_size)]
    indx = gate_indx if op == "dp_to_ep" else topk_indx
    wss = simulated_workspaces(world_size, moe_bytes=1 << 20)
    launch(op, wss[0], MoEConfig(32, 1, rows_per_program=2), srcs[0], assignment.expt_owner, expt_indx, indx,
           fused_barrier=fused)
    assert wss[0].barrier_error_counts() == {"all_reduce": 0, "moe": 0, "moe_end": 1, "host": 0}
    assert _slots(wss[0], op).tolist() == [0] * 8  # counter reset, no signal consumed
    assert _slots(wss[1], op).tolist() == [1] + [0] * 7  # rank 0's signal to rank 1
    assert wss[1].barrier_errors() == 0

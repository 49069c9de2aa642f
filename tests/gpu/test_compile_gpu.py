"""torch.compile(fullgraph=True) of functions calling autosymm, on real GPUs: default inductor and
``mode="reduce-overhead"`` (inductor's CUDA graphs). All-reduces of 4 KiB .. 4 MiB bf16 bit-equal
to NCCL's (dist.all_reduce of a copy; a sum over 2 ranks is one rounded addition either way), an
MoE dp->ep -> experts -> ep->dp round trip equal to the reference, and under reduce-overhead the
captured calls prepared with the graph-mode rows (their cache keys say "capturing").

Runs on 2 local GPUs (one process each) through tests/gpu/_dist.run_on_gpus.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from autosymm.problem import MoEShape
from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route
from _moe_ref import reference_dp_to_ep, rows_written

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]  # bytes of bf16
MOE_SHAPE, MOE_TOKENS = MoEShape(7168, 256, 8), 16  # DeepSeek-V3-like, tokens per rank
STEPS = 4  # reduce-overhead: warm-up, capture, then replays, each with new data


def _layer(xs):
    """Per input: a pointwise op, the in-place all-reduce, then the out-of-place op on the last one."""
    import autosymm
    from autosymm.dist_compat import group_name

    outs = []
    for x in xs:
        y = x * 2  # exact in bf16: the compiled and the eager inputs of the reduction are bit-equal
        autosymm.all_reduce(y)
        outs.append(y)
    outs.append(torch.ops.autosymm.all_reduce(outs[-1] * 2, "sum", group_name()))
    return outs


def _nccl_layer(xs):
    import torch.distributed as dist

    outs = []
    for x in xs:
        y = x * 2
        dist.all_reduce(y)
        outs.append(y)
    last = outs[-1] * 2
    dist.all_reduce(last)
    return outs + [last]


def _inputs(rank, step, device):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(nbytes // 2, generator=gen).to(torch.bfloat16).to(device) for nbytes in SIZES]


def _moe_case(rank, world_size, device):
    shape = MOE_SHAPE
    assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                      make_expt_dict_random(world_size, shape.n_expts_tot, seed=7), device)
    expt_indx = random_expt_indx(world_size * MOE_TOKENS, shape.n_expts_tot, shape.n_expts_act, seed=8, device=device)
    gate, topk = route(expt_indx)
    return assignment, expt_indx, gate, topk


def _moe_srcs(world_size, step):
    gen = torch.Generator().manual_seed(50 + step)
    return [torch.randn(MOE_TOKENS, MOE_SHAPE.d_model, generator=gen).to(torch.bfloat16) for _ in range(world_size)]


def _check_all_reduces(compiled, rank, device, what):
    for step in range(STEPS):
        xs = _inputs(rank, step, device)
        got = [t.clone() for t in compiled(xs)]  # reduce-overhead: outputs live in the graph's pool
        want = _nccl_layer([x.clone() for x in xs])
        for nbytes, g, w in zip(SIZES + ["out-of-place"], got, want):
            assert torch.equal(g, w), f"{what} step {step}: all-reduce of {nbytes} bytes differs from NCCL"


def _check_moe(compiled, rank, world_size, device, case, what):
    assignment, expt_indx, gate, topk = case
    ep_rows = rows_written("dp_to_ep", assignment, expt_indx, gate, world_size)[rank].to(device)
    for step in range(STEPS):
        srcs = _moe_srcs(world_size, step)
        ep, dp = (t.clone() for t in compiled(srcs[rank].to(device)))
        want_ep = reference_dp_to_ep(srcs, assignment, expt_indx, gate)[rank].to(device)
        assert torch.equal(ep[ep_rows], want_ep[ep_rows]), f"{what} step {step}: dp->ep rows differ"
        want_dp = srcs[rank].to(device).repeat_interleave(MOE_SHAPE.n_expts_act, 0)
        assert torch.equal(dp, want_dp), f"{what} step {step}: the round trip differs"


def _check_graph_mode_calls(state, rank):
    """The captured calls were prepared in graph mode: one prepared call per all-reduce size and
    one per conversion whose decision has mode 'graph' (prepared calls are keyed by mode)."""
    graph = [e for e in state.cache.values() if e.decision.mode == "graph"]
    moe = [e for e in graph if e.decision.backend in ("triton_moe", "nccl_all_to_all")]
    reduced = sorted(e.bytes_per_call for e in graph if all(e is not m for m in moe))
    assert reduced == SIZES, f"graph-mode all-reduces of {reduced} bytes, expected {SIZES}"
    assert len(moe) == 2, f"{len(moe)} graph-mode conversions, expected dp->ep and ep->dp"
    assert all(e.calls >= 1 for e in graph)
    if rank == 0:
        for e in graph:
            print(f"captured, {e.bytes_per_call} bytes: {e.decision.describe()}")


def _compile_body(rank, world_size, db_dir):
    os.environ["AUTOSYMM_DB"] = os.path.join(db_dir, f"none-{rank}.sqlite")  # the shipped rows only
    import autosymm
    from torch._dynamo.utils import counters

    device = torch.device("cuda", rank)
    case = _moe_case(rank, world_size, device)
    assignment, expt_indx, gate, topk = case

    def round_trip(src):
        ep = autosymm.convert_dp_to_ep(src, assignment, expt_indx, gate)
        return ep, autosymm.convert_ep_to_dp(ep * 1, assignment, expt_indx, topk)

    autosymm.init()  # the first call's collectives run outside any capture
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        _check_all_reduces(torch.compile(_layer, fullgraph=True, mode=mode), rank, device, mode)
        _check_moe(torch.compile(round_trip, fullgraph=True, mode=mode), rank, world_size, device, case, mode)
        torch.cuda.synchronize()
    assert not counters["inductor"]["cudagraph_skips"], f"inductor skipped CUDA graphs: {dict(counters['inductor'])}"
    _check_graph_mode_calls(autosymm.api.STATES[None], rank)
    assert autosymm.barrier_errors() == 0


def test_compiled_and_reduce_overhead_match_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    with tempfile.TemporaryDirectory() as db_dir:
        run_on_gpus(_compile_body, db_dir, world_size=2)

"""Room for the MoE conversions (autosymm.runtime.moe_room): declared sizes, the dispatcher's view of a
region that may grow, eager growth through the public API on a simulated one-rank workspace
(interpreter), the CUDA-graph error, and the rank agreement of init(moe=...) over gloo."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from autosymm.runtime.agreement import Exchange

if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter tests (CUDA present, TRITON_INTERPRET unset)", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import autosymm  # noqa: E402
from autosymm import api
from autosymm.collectives import moe as moe_door
from autosymm.runtime import moe_room  # noqa: E402
from autosymm.backends.base import Capabilities, RunContext  # noqa: E402
from autosymm.backends.triton_moe import TRITON_MOE, buffer_bytes, region_bytes_for  # noqa: E402
from autosymm.geometry import DEFAULT_MOE_MAX_BYTES, MOE_REGION_SLACK, grown_moe_bytes, moe_buffer  # noqa: E402
from autosymm.problem import MoEShape, Problem  # noqa: E402
from autosymm.routing import make_expt_assignment, make_expt_dict_uniform, random_expt_indx, route
from _moe_ref import reference_dp_to_ep
from autosymm.workspace.symm import simulated_workspaces  # noqa: E402

from _gloo import run_with_deadline  # noqa: E402

BIG = MoEShape(5120, 160, 6)  # the model shape outside the default sweep


def test_plans_normalise_and_size_the_region_for_the_largest():
    plan = autosymm.MoEPlan("d5120_e160_k6", max_tokens_per_rank=3000)
    assert plan.shape == BIG and plan.dtype == torch.bfloat16
    assert autosymm.MoEPlan(BIG, 3000, "bf16") == plan
    assert autosymm.MoEPlan("deepseek-v3", 8, torch.float32).shape == MoEShape(7168, 256, 8)
    # dp->ep: 2 ranks x 3000 tokens x 6 pairs; ep->dp: 3000 x 6; rows of 10240 bytes; + slack
    assert plan.region_bytes(2) == (2 * 3000 * 6 + 3000 * 6) * 10240 + MOE_REGION_SLACK
    small = autosymm.MoEPlan("d2048_e128_k8", 64)
    assert moe_room.plans_region_bytes([small, plan], 2) == plan.region_bytes(2)
    assert moe_room.plans_region_bytes([], 8) == 0
    for bad, error in [(("d5120_e160", 8), ValueError), ((BIG, 0), ValueError), ((BIG, 8, torch.int32), ValueError),
                       ((BIG, 2.5), ValueError), ((5120, 8), TypeError)]:
        with pytest.raises(error):
            autosymm.MoEPlan(*bad)
    with pytest.raises(TypeError, match="MoEPlan"):
        moe_room.plans_region_bytes([("d5120_e160_k6", 3000)], 2)


def test_growth_target_at_least_doubles_and_stays_under_the_limit():
    assert grown_moe_bytes(256 << 20, 554008576, 16 << 30) == 554008576
    assert grown_moe_bytes(600 << 20, 700 << 20, 16 << 30) == 1200 << 20  # doubling: fewer regrowths
    assert grown_moe_bytes(600 << 20, 700 << 20, 900 << 20) == 900 << 20
    assert grown_moe_bytes(1000, 1001, 1 << 20) % 256 == 0


def test_eager_calls_may_grow_the_region_graph_calls_may_not():
    caps = Capabilities.of(2, region_bytes=(256 << 20, 256 << 20), compute_capability=(9, 0))
    assert caps.moe_max_bytes == DEFAULT_MOE_MAX_BYTES
    assert caps.moe_room("eager") == DEFAULT_MOE_MAX_BYTES and caps.moe_room("graph") == 256 << 20
    assert Capabilities.of(2).moe_room("eager") == 0  # no workspace: nothing to grow
    assert Capabilities.of(2, region_bytes=(1, 1 << 30), moe_max_bytes=0).moe_room("eager") == 1 << 30
    problem = Problem.moe("dp_to_ep", BIG, 3000, "bf16", 2)
    assert TRITON_MOE.why_not(problem, caps, "eager") is None
    assert f"needs {buffer_bytes(problem)} bytes" in TRITON_MOE.why_not(problem, caps, "graph")
    huge = Problem.moe("dp_to_ep", MoEShape(7168, 256, 8), 1 << 16, "bf16", 8)
    assert "after growing the region to its limit" in TRITON_MOE.why_not(huge, caps, "eager")


def test_explain_with_default_settings_picks_the_triton_conversion_at_3000_tokens(monkeypatch):
    """The issue's done-when: d_model 5120, 160 experts, top-6, 3000 tokens/rank on 2x H200."""
    from click.testing import CliRunner

    from autosymm.cli.main import main

    monkeypatch.delenv("AUTOSYMM_WORKSPACE_BYTES", raising=False)
    for op in ("dp_to_ep", "ep_to_dp"):
        result = CliRunner().invoke(main, ["explain", "--op", op, "--shape", "d5120_e160_k6", "--tokens", "3000",
                                           "--world-size", "2", "--gpu", "NVIDIA H200"])
        assert result.exit_code == 0, result.output
        eager, graph = [line for line in result.output.splitlines() if "tokens/rank=3000" in line]
        assert "[eager]" in eager and ": triton_moe" in eager, result.output
        assert "[graph]" in graph and ": triton_moe" not in graph, result.output  # no room without a declaration


# -- growth through the public API, one simulated rank -------------------------------------------

def _one_rank_state(monkeypatch, moe_bytes):
    """A group state of one CPU rank over a simulated workspace, as api.GroupState would hold it."""
    (ws,) = simulated_workspaces(1, all_reduce_bytes=4096, moe_bytes=moe_bytes)
    from autosymm.runtime.group import GroupState
    from autosymm.runtime.warmup import WarmupLog

    state = object.__new__(GroupState)
    state.group, state.world_size, state.rank, state.device = None, 1, 0, torch.device("cpu")
    state.workspace, state.sources, state.safe_reason, state.hardware = ws, [], None, "cpu"
    state.channel, state.prepared_calls = Exchange(None, 0, 1, store=object()), 0  # one rank: no store traffic
    state.caps = Capabilities.of(1, workspace=ws, compute_capability=(9, 0))
    state.ctx, state.cache = RunContext(workspace=ws), {}
    state.warmup, state.agreed_reports, state.past_counts = WarmupLog(), [], {}
    monkeypatch.setitem(api.STATES, None, state)
    moves = []

    def grow_region(ws, name, nbytes):
        moves.append(nbytes)
        ws.move_region(name, [torch.zeros(nbytes, dtype=torch.uint8)])
        return True

    monkeypatch.setattr(moe_room, "grow_region", grow_region)
    return state, moves


def _call(n_tokens, d_model=64, k=2, n_experts=4):
    assignment = make_expt_assignment(1, n_experts, make_expt_dict_uniform(1, n_experts))
    expt_indx = random_expt_indx(n_tokens, n_experts, k, seed=n_tokens)
    gate, _ = route(expt_indx)
    src = torch.randn(n_tokens, d_model).bfloat16()
    want = reference_dp_to_ep([src], assignment, expt_indx, gate)[0]
    return autosymm.convert_dp_to_ep(src, assignment, expt_indx, gate), want, (src, assignment, expt_indx, gate)


def test_an_eager_call_that_does_not_fit_grows_the_region_once_and_relaunches_cached_calls(monkeypatch, caplog):
    state, moves = _one_rank_state(monkeypatch, moe_bytes=4096)  # dp->ep buffer 2048 bytes: 8 tokens of 128
    ws = state.workspace
    small, want, args = _call(8)
    assert torch.equal(small, want) and ws.offset_in_region(small, "moe") is not None and moves == []
    before = small.clone()
    with caplog.at_level(logging.WARNING, logger="autosymm"):
        big, want_big, _ = _call(40)
    problem = Problem.moe("dp_to_ep", MoEShape(64, 4, 2), 40, "bf16", 1)
    assert moves == [grown_moe_bytes(4096, region_bytes_for(problem), DEFAULT_MOE_MAX_BYTES)]
    assert torch.equal(big, want_big) and state.caps.moe_bytes == ws.capacity("moe") == moves[0]
    assert [r.getMessage() for r in caplog.records if "grew the MoE workspace" in r.getMessage()] != []
    assert len(caplog.records) == 1 and "4096 to" in caplog.records[0].getMessage()
    assert torch.equal(small, before), "the old region stays alive and untouched"
    again = autosymm.convert_dp_to_ep(*args)  # the cached 8-token launcher, prepared again on the new region
    assert again is not small and ws.offset_in_region(again, "moe") == moe_buffer("dp_to_ep", moves[0], 1)[0]
    assert torch.equal(again, want)
    _call(40)
    assert len(moves) == 1, "a call that fits never grows"
    assert autosymm.stats()["triton_moe"]["calls"] == 4


def test_a_graph_call_that_does_not_fit_names_the_bytes_and_the_reserving_api(monkeypatch):
    state, moves = _one_rank_state(monkeypatch, moe_bytes=4096)
    monkeypatch.setattr(moe_door, "stream_capturing", lambda: True)
    problem = Problem.moe("dp_to_ep", MoEShape(64, 4, 2), 40, "bf16", 1)
    with pytest.raises(RuntimeError, match=rf"needs a MoE workspace region of {region_bytes_for(problem)} bytes.*"
                                           r"autosymm.init\(group, moe=\[autosymm.MoEPlan\('d64_e4_k2', "
                                           r"max_tokens_per_rank=40, dtype=torch.bfloat16\)\]\)"):
        _call(40)
    assert moves == [] and state.cache == {}
    small, want, _ = _call(8)  # one that fits is captured as usual
    assert torch.equal(small, want)


def test_declared_room_grows_a_set_up_group_and_limits_apply(monkeypatch):
    state, moves = _one_rank_state(monkeypatch, moe_bytes=4096)
    plan = autosymm.MoEPlan("d64_e4_k2", 40)
    moe_room.configure(state, moe_room.plans_region_bytes([plan], 1), 0)
    assert moves == [plan.region_bytes(1)] and state.caps.moe_max_bytes == state.caps.moe_bytes == moves[0]
    monkeypatch.setattr(moe_door, "stream_capturing", lambda: True)
    out, want, _ = _call(40)  # declared: fits inside a capture
    assert torch.equal(out, want)
    monkeypatch.setattr(moe_door, "stream_capturing", lambda: False)
    problem = Problem.moe("dp_to_ep", MoEShape(64, 4, 2), 4000, "bf16", 1)
    assert state.decide(problem, "eager").backend == "nccl_all_to_all"  # moe_max_bytes=0: no growth past it


def test_a_failed_growth_stops_growing_on_every_rank(monkeypatch):
    state, _ = _one_rank_state(monkeypatch, moe_bytes=4096)
    monkeypatch.setattr(moe_room, "grow_region", lambda ws, name, nbytes: False)
    problem = Problem.moe("dp_to_ep", MoEShape(64, 4, 2), 40, "bf16", 1)
    assert not moe_room.grow(state, 1 << 20, "test")
    assert state.caps.moe_max_bytes == 4096 and state.decide(problem, "eager").backend == "nccl_all_to_all"


def test_reserved_room_sizes_the_workspace_made_later(monkeypatch):
    from autosymm.workspace import symm

    made = []

    class Made:
        def __init__(self, ar, moe):
            self.bytes = {"all_reduce": ar, "moe": moe}
            made.append(moe)

        def capacity(self, name):
            return self.bytes[name]

    monkeypatch.setattr(symm, "_rendezvous", lambda group, device, ar, moe: Made(ar, moe))
    monkeypatch.setattr(symm, "_WORKSPACES", {})
    monkeypatch.setattr(symm, "_MOE_RESERVED", {})
    monkeypatch.delenv("AUTOSYMM_WORKSPACE_BYTES", raising=False)

    class Group:
        group_name = "test-moe-room"

    symm.reserve_moe_bytes(Group(), 3 << 30)
    ws = symm.get_workspace(Group(), torch.device("cuda", 0))
    assert made == [3 << 30]
    symm.reserve_moe_bytes(Group(), 5 << 30)  # made already: the cached one is returned (init grows it instead)
    assert symm.get_workspace(Group(), torch.device("cuda", 0)) is ws and made == [3 << 30]
    symm.reserve_moe_bytes(Group(), 1 << 20)  # never shrinks a reservation
    assert symm._MOE_RESERVED["test-moe-room"] == 5 << 30


# -- init(moe=...) over gloo ----------------------------------------------------------------------

def _init_rank(rank, world_size, port, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            report = _init_body(rank)
        finally:
            autosymm.reset()
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, report, None))
    except BaseException:
        import traceback

        queue.put((rank, None, traceback.format_exc()))


def _init_body(rank):
    plan = autosymm.MoEPlan("d64_e4_k2", 40)
    autosymm.init(moe=[plan], moe_max_bytes=1 << 30)  # gloo: no workspace, NCCL serves; nothing to size
    try:
        autosymm.init(moe=[autosymm.MoEPlan("d64_e4_k2", 40 + rank)])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_init_agrees_on_the_declared_room_or_fails_on_every_rank():
    reports = run_with_deadline(_init_rank, 2, deadline_s=90)
    assert all("ranks must pass the same moe=" in r and "moe_region_bytes: rank 0" in r for r in reports.values()), reports

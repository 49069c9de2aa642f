"""What a sweep tries (autosymm.tuning.sweep): default problems and modes, timing plans, the
candidates each backend offers, and how an item reports a failure."""

from __future__ import annotations

from autosymm.backends.base import Backend, Needs
from autosymm.backends import Capabilities
from autosymm.configs import moe_space
from autosymm.problem import MoEShape, Problem
from autosymm.tuning.outcome import TuneOutcome
from autosymm.tuning.sweep import MOE_TOKENS, SweepItem, candidates_for, default_modes, default_sweep, timing_plan


def test_default_sweep_and_modes():
    problems = default_sweep(8)
    ar = [p for p in problems if p.op == "all_reduce"]
    assert [p.nbytes for p in ar] == [4096 << i for i in range(17)] and ar[-1].nbytes == 256 << 20
    moe = [p for p in problems if p.op != "all_reduce"]
    assert len(moe) == 4 * 2 * 8 and {p.n_tokens_local for p in moe} == {1, 4, 16, 64, 256, 1024, 4096, 8192}
    from autosymm.cli import DEFAULT_TOKENS, _parse_tokens

    assert _parse_tokens(DEFAULT_TOKENS) == MOE_TOKENS, "`autosymm tune`'s default is the default sweep's"
    assert all(p.world_size == 8 and p.dtype == "bf16" for p in problems)
    assert default_modes(ar[0]) == ("eager", "graph") == default_modes(ar[-1])
    small = next(p for p in moe if p.n_tokens_local == 256)
    large = next(p for p in moe if p.n_tokens_local == 1024)
    assert default_modes(small) == ("eager", "graph") and default_modes(large) == ("eager",)
    tiny, huge = timing_plan(ar[0], "eager"), timing_plan(ar[-1], "eager")
    assert tiny.calls_per_sample > 1 and huge.calls_per_sample == 1 and huge.n_inputs == 2 and tiny.n_inputs == 8
    assert timing_plan(ar[0], "graph").calls_per_graph >= 8


class _FakeBackend(Backend):
    def __init__(self, name, ops, space, reason=None, graph_capturable=True):
        self.name, self.space, self.reason = name, space, reason
        self.needs = Needs(ops=ops, graph_capturable=graph_capturable)

    def limits(self, problem, caps):
        return self.reason

    def search_space(self, problem):
        return self.space


def test_candidates_for_skips_unsupported_and_uncapturable():
    shape = MoEShape(2048, 128, 8)
    problem = Problem.moe("dp_to_ep", shape, 4, world_size=2)
    not_capturable = _FakeBackend("nccl_all_to_all", ("dp_to_ep",), [None], graph_capturable=False)
    backends = {"nccl_all_to_all": not_capturable,
                "triton_moe": _FakeBackend("triton_moe", ("dp_to_ep",), moe_space(shape.d_model, 4)),
                "nccl": _FakeBackend("nccl", ("all_reduce",), [None]),
                "broken": _FakeBackend("broken", ("dp_to_ep",), [None], reason="no workspace")}
    caps = Capabilities(world_size=2)
    eager, why = candidates_for(problem, "eager", backends, caps)
    assert sorted(eager) == ["nccl_all_to_all", "triton_moe"] and why == {"broken": "no workspace"}
    graph, why = candidates_for(problem, "graph", backends, caps)
    assert sorted(graph) == ["triton_moe"] and why["nccl_all_to_all"] == "not CUDA-graph capturable"


def test_an_item_reports_a_failed_or_aborted_search_and_a_failed_database_write():
    problem = Problem.all_reduce(8192, "bf16", 2)
    assert SweepItem(problem, "eager", "failed", "no candidate passed validation").failure() == (
        "all_reduce bf16 ws=2 8KiB [eager]: failed no candidate passed validation")
    assert SweepItem(problem, "graph", "aborted", "hung").failure() == "all_reduce bf16 ws=2 8KiB [graph]: aborted hung"
    outcome = TuneOutcome(problem, None, [], None)
    written_badly = SweepItem(problem, "eager", "tuned", "database write failed: OperationalError: locked", outcome)
    assert written_badly.failure().endswith("tuned database write failed: OperationalError: locked")
    assert SweepItem(problem, "eager", "tuned", "", outcome).failure() is None
    assert SweepItem(problem, "eager", "skipped", "no backend but the fallback serves it").failure() is None

"""What a sweep tries (autosymm.tuning.sweep): default problems and modes, timing plans, the
candidates each backend offers, how an item reports a failure or a skip (and `tune` lists the
skips), and the `tune` options (--shapes, --tokens, --sizes) that make the sweep."""

from __future__ import annotations

import dataclasses

from autosymm.backends.base import Backend, Needs
from autosymm.backends import Capabilities
from autosymm.configs import moe_space
import pytest

from autosymm.problem import MODEL_SHAPES, MoEShape, Problem, parse_size_range
from autosymm.tuning.outcome import TuneOutcome
from autosymm import spec
from autosymm.spec import PointRequest
from autosymm.spec.kinds import SIZES as ALL_REDUCE_SIZES, SIZES_SPEC as ALL_REDUCE_SIZES_SPEC, TOKEN_COUNTS as MOE_TOKENS
from autosymm.tuning.session import TuneSession, TuneSettings, sweep_problems
from autosymm.tuning.sweep import SweepItem, candidates_for, timing_plan, with_eager_launches


def test_default_sweep_and_modes():
    """The ops tuned by default at their records' default points, in both modes."""
    request = PointRequest(("bf16",), 8)
    problems = [p for name in spec.default_tuned() for p in spec.get(name).problems(request)]
    from autosymm.cli.main import _tune_options

    options = _tune_options({"ops": ",".join(spec.default_tuned()), "dtypes": "bf16", "modes": "eager,graph",
                             "strategy": "auto", "trials": None, "db_path": None, "backend_list": None})
    assert problems == sweep_problems(options.ops, ["bf16"], 8, options.points), "`autosymm tune`'s defaults are the records'"
    assert sweep_problems(options.ops, ["bf16"], 8, {}) == problems  # no option given: each op's points
    ar = [p for p in problems if p.op == "all_reduce"]
    powers = [4096 << i for i in range(17)]
    assert [p.nbytes for p in ar] == sorted(powers + [3 * p // 2 for p in powers[:-1]]) and ar[-1].nbytes == 256 << 20
    assert len({p.bucket for p in ar}) == len(ar) == 33  # each size its own rows
    moe = [p for p in problems if p.op != "all_reduce"]
    assert len(moe) == 4 * 2 * 8 and {p.n_tokens_local for p in moe} == {1, 4, 16, 64, 256, 1024, 4096, 8192}
    assert spec.TOKENS.sweep.parse(spec.TOKENS.sweep.default) == list(MOE_TOKENS), "`tune --tokens` by default"
    assert spec.BYTES.sweep.default == ALL_REDUCE_SIZES_SPEC and parse_size_range(ALL_REDUCE_SIZES_SPEC) == list(ALL_REDUCE_SIZES)
    assert all(p.world_size == 8 and p.dtype == "bf16" for p in problems)
    # graph mode at every size and token count: decode and prefill batches alike
    session = object.__new__(TuneSession)
    session.settings = TuneSettings()
    assert {session.modes_for(p) for p in problems} == {("eager", "graph")}
    tiny, huge = timing_plan(ar[0], "eager"), timing_plan(ar[-1], "eager")
    assert tiny.calls_per_sample > 1 and huge.calls_per_sample == 1 and huge.n_inputs == 2 and tiny.n_inputs == 8
    assert timing_plan(ar[0], "graph").calls_per_graph >= 8


def test_any_shape_and_token_list_parse_for_tune():
    from autosymm.spec.kinds import parse_counts
    from autosymm.spec.moe import parse_moe_shapes

    shapes = parse_moe_shapes("DeepSeek-V3, d5120_e160_k6,d4096_e8_k2")
    assert shapes == {"DeepSeek-V3": MODEL_SHAPES["deepseek-v3"], "d5120_e160_k6": MoEShape(5120, 160, 6),
                      "d4096_e8_k2": MoEShape(4096, 8, 2)}
    for bad, match in (("d5120_e160", "not a MoE shape key"), ("d64_e4_k8", "top-k"), ("llama", "model names"),
                       (",", "no MoE shape")):
        with pytest.raises(ValueError, match=match):
            parse_moe_shapes(bad)
    assert parse_counts("3000,1,3000,700") == [3000, 1, 700]
    assert parse_counts("1:16") == [1, 2, 4, 8, 16] and parse_counts("16:64:2") == [16, 24, 32, 48, 64]
    for bad in ("0,4", "a,b", "8:1", "1:8:3", ""):
        with pytest.raises(ValueError):
            parse_counts(bad)


def test_a_skipped_item_says_so_with_each_backends_reason():
    problem = Problem.moe("dp_to_ep", MoEShape(7168, 256, 8), 3000, world_size=2)
    item = SweepItem(problem, "graph", "skipped", "no backend but the fallback serves it",
                     unsupported={"triton_moe": "needs 688128000 bytes, the MoE workspace buffer has 1024",
                                  "nccl_all_to_all": "not CUDA-graph capturable"})
    assert item.skip_line() == (
        "dp_to_ep bf16 ws=2 d7168_e256_k8 tokens/rank=3000 [graph]: skipped, no backend but the fallback serves it "
        "(nccl_all_to_all: not CUDA-graph capturable; triton_moe: needs 688128000 bytes, the MoE workspace buffer "
        "has 1024)")
    assert item.failure() is None
    assert SweepItem(problem, "graph", "tuned", "", TuneOutcome(problem, None, [], None)).skip_line() is None


class _FakeBackend(Backend):
    def __init__(self, name, ops, space, reason=None, graph_capturable=True):
        self.name, self.ops, self.space, self.reason = name, ops, space, reason
        self.needs = Needs(graph_capturable=graph_capturable)

    def serves(self, record):
        return record.name in self.ops

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


def test_eager_candidates_are_timed_in_both_launch_styles():
    """Eager: every Triton config again as a bound direct launch (configs without the field, as
    MoE's, once); graph: the space as it is."""
    from autosymm.backends.triton_all_reduce import all_reduce_space

    problem = Problem.all_reduce(1 << 16, "bf16", 2)
    space = all_reduce_space("one_shot", 1 << 16, 2, 2)
    backends = {"triton_one_shot": _FakeBackend("triton_one_shot", ("all_reduce",), space),
                "nccl": _FakeBackend("nccl", ("all_reduce",), [None])}
    caps = Capabilities(world_size=2)
    eager, _ = candidates_for(problem, "eager", backends, caps)
    assert eager["triton_one_shot"][:len(space)] == space and eager["nccl"] == [None]
    assert eager["triton_one_shot"][len(space):] == [dataclasses.replace(c, eager_launch="direct") for c in space]
    graph, _ = candidates_for(problem, "graph", backends, caps)
    assert graph["triton_one_shot"] == space and {c.eager_launch for c in space} == {"replay"}
    moe = moe_space(2048, 4)
    assert with_eager_launches(moe, "eager") == moe


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


def test_a_summary_gives_the_winners_margins_over_nccl_and_the_stacks_path():
    from autosymm.configs import AllReduceConfig
    from autosymm.tuning.outcome import Candidate, TrialResult
    from autosymm.tuning.sweep import margin
    from autosymm.tuning.timing import Timing

    problem = Problem.all_reduce(8192, "bf16", 2)

    def result(backend, us, config=None):
        timing = Timing(us, us, us, 5) if us else Timing.failed()
        return TrialResult(Candidate(backend, config), timing, None if us else "failed")

    best = result("triton_one_shot", 8.0, AllReduceConfig("one_shot", 2048, 4, 8))
    nccl, vllm = result("nccl", 20.0), result("vllm", 10.0)
    item = SweepItem(problem, "eager", "tuned", "", TuneOutcome(problem, best, [best, vllm, nccl], nccl))
    summary = item.summary("vllm")
    assert summary["nccl_margin"] == pytest.approx(1.5) and summary["speedup"] == pytest.approx(2.5)
    assert (summary["stack"], summary["stack_us"], summary["stack_margin"]) == ("vllm", 10.0, pytest.approx(0.25))
    plain = item.summary()  # `autosymm tune`: no stack's path on the group
    assert (plain["stack"], plain["stack_us"], plain["stack_margin"]) == (None, None, None)
    untimed = SweepItem(problem, "eager", "tuned", "", TuneOutcome(problem, best, [best, result("vllm", None)], None))
    assert untimed.summary("vllm")["nccl_margin"] is None and untimed.summary("vllm")["stack_us"] is None
    assert margin(None, 8.0) is None and margin(float("inf"), 8.0) is None and margin(8.0, 8.0) == 0.0


def _tune_graph_moe_where_nothing_can_capture(rank, world_size):
    import contextlib
    import io

    from autosymm.tuning import session as session_module
    from autosymm.tuning.session import TuneOptions

    backends = {"nccl_all_to_all": _FakeBackend("nccl_all_to_all", ("dp_to_ep",), [None], graph_capturable=False),
                "triton_moe": _FakeBackend("triton_moe", ("dp_to_ep",), [None], reason="needs 9 bytes, has 0")}
    session_module._load_backends = lambda names: (backends, {})
    options = TuneOptions(ops=["dp_to_ep"], dtypes=["bf16"], modes=["graph"], db_path="",
                          points={"--shapes": (MoEShape(7168, 256, 8),), "--tokens": [3000]})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = session_module.tune_job(rank, world_size, options)
    return result.failures, out.getvalue()


def test_tune_lists_what_it_was_asked_for_and_skipped():
    from _gloo import run_gloo

    failures, printed = run_gloo(_tune_graph_moe_where_nothing_can_capture, 1)[0]
    assert failures == []  # a skip is not a failure
    assert ("dp_to_ep bf16 ws=1 d7168_e256_k8 tokens/rank=3000 [graph]: skipped, no backend but the fallback serves "
            "it (nccl_all_to_all: not CUDA-graph capturable; triton_moe: needs 9 bytes, has 0)") in printed

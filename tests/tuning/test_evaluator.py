"""autosymm.tuning.evaluator and the session's sweep around device barriers: validation copies a
workspace output before peers may overwrite it, a barrier wait that gave up fails the candidate on
every rank, and the signal pads are reset on every rank, in lock-step, before the search goes on."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch

from autosymm.backends import RunContext
from autosymm.backends.triton_all_reduce import all_reduce_space
from autosymm.kernels.barrier import max_wait_s
from autosymm.problem import Problem
from autosymm.geometry import ERROR_SLOTS_OFFSET, SIGNAL_CHANNEL, workspace_layout
from autosymm.workspace.symm import Workspace
from autosymm.tuning.evaluator import BarrierTimeout, SweepEvaluator
from autosymm.tuning.outcome import Candidate
from autosymm.tuning.sweep import TimingPlan, measure_timeout_s

from _gloo import run_with_deadline
from test_tuner_ranks import GlooAllReduce

PLAN = TimingPlan(2, warmup=1, repeats=3, calls_per_sample=1, calls_per_graph=2)


class CpuWorkspace(Workspace):
    """A rank's workspace over one CPU buffer (peers are other processes, never addressed): real
    error slots and reset_signals; the device barrier is recorded, or replaced by ``on_barrier``."""

    def __init__(self, rank: int = 0, world_size: int = 2, on_barrier=None):
        layout = workspace_layout(1024, 1024)
        buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        super().__init__(rank, [buffer] * world_size, layout)
        self.on_barrier = on_barrier
        self.device_barriers = 0
        self.resets: list[int] = []  # barrier_errors() seen at each reset

    def device_barrier(self) -> None:
        self.device_barriers += 1
        if self.on_barrier is not None:
            self.on_barrier()

    def reset_signals(self, group=None) -> None:
        self.resets.append(self.barrier_errors())
        super().reset_signals(group)

    def give_up_a_wait(self, family: str = "all_reduce") -> None:
        """What a kernel's barrier wait does when a peer never arrives (autosymm.kernels.barrier)."""
        self.buffer[ERROR_SLOTS_OFFSET:ERROR_SLOTS_OFFSET + 16].view(torch.int32)[SIGNAL_CHANNEL[family]] += 1


class FakeData:
    """ProblemData's interface for one output of 16 floats (exact check)."""

    def __init__(self):
        from autosymm.tuning import ops as tuning_ops

        self.op = tuning_ops.get("all_reduce")  # its launcher called as is (TuningOp.callable)
        self.device = torch.device("cpu")
        self.expected = torch.arange(16, dtype=torch.float32)
        self.mask, self.exact = None, True

    def refresh(self):
        pass

    def validation_args(self):
        return (torch.zeros(16),)

    def result(self, out, args):
        return out

    def timing_args(self):
        return [(torch.zeros(16),)] * 2


def _evaluator(ws, control_group=None):
    return SweepEvaluator(Problem.all_reduce(64, "fp32", 2), "eager", {}, FakeData(), RunContext(workspace=ws), PLAN,
                          control_group=control_group)


def test_a_workspace_output_is_copied_before_the_ranks_line_up():
    """A MoE result lives in the workspace, where a peer's next call (it may start as soon as the
    ranks passed the device barrier) overwrites it: the check must see the copy."""
    log = []
    ws = CpuWorkspace(on_barrier=lambda: (log.append("barrier"), ws.local_view("moe", (16,), torch.float32).fill_(-1)))
    calls = []

    def launcher(_):
        calls.append(len(log))
        out = ws.local_view("moe", (16,), torch.float32)
        out.copy_(torch.arange(16, dtype=torch.float32))
        return out

    timing = _evaluator(ws).measure(launcher)
    assert timing.ok and ws.device_barriers == 1 and calls[0] == 0  # validation call, then the barrier
    assert len(calls) == 1 + PLAN.warmup + PLAN.repeats


def test_a_barrier_that_gave_up_during_validation_fails_the_candidate_before_timing():
    ws = CpuWorkspace()
    calls = []

    def launcher(x):
        calls.append(1)
        ws.give_up_a_wait()
        return torch.arange(16, dtype=torch.float32)  # looks right: the flag alone must fail it

    with pytest.raises(BarrierTimeout, match="barrier timed out: a peer never arrived .*validation"):
        _evaluator(ws).measure(launcher)
    assert len(calls) == 1, "nothing is timed after a failed barrier"


def test_a_barrier_that_gave_up_during_timing_fails_the_candidate():
    ws = CpuWorkspace()
    calls = []

    def launcher(x):
        calls.append(1)
        if len(calls) == 3:
            ws.give_up_a_wait("moe_end")
        return torch.arange(16, dtype=torch.float32)

    with pytest.raises(BarrierTimeout, match="1 wait.*during timing"):
        _evaluator(ws).measure(launcher)


def test_reset_uses_the_control_group_and_clears_the_flags(monkeypatch):
    ws = CpuWorkspace()
    ws.give_up_a_wait()
    groups = []
    monkeypatch.setattr(Workspace, "_host_barrier", staticmethod(groups.append))
    _evaluator(ws, control_group="control").reset()
    assert ws.resets == [1] and ws.barrier_errors() == 0 and groups == ["control", "control"]
    _evaluator(None).reset()  # NCCL-only sweeps have no workspace: nothing to do


def test_the_measure_timeout_outlasts_a_spinning_wait():
    assert measure_timeout_s() >= 2 * max_wait_s() + 60 and measure_timeout_s() >= 120
    from autosymm.kernels.barrier import POLL_US_MAX, RUNTIME_MAX_POLLS, TUNING_MAX_POLLS

    assert 2.0 < TUNING_MAX_POLLS * POLL_US_MAX * 1e-6 < 60.0  # the tuner's 2**24 polls at 2 us
    assert RUNTIME_MAX_POLLS * 0.3e-6 > 300  # at run time: minutes, like NCCL's watchdog


# -- two gloo ranks ----------------------------------------------------------------------------

class TimingOutAllReduce(GlooAllReduce):
    """GlooAllReduce whose ``timeouts`` configs, on rank 1, make a barrier wait give up in the first
    timing call (after validation: the fake's host collectives stay matched on both ranks)."""

    def __init__(self, name, space, timeouts):
        super().__init__(name, space)
        self.timeouts = set(timeouts)

    def prepare(self, problem, config, ctx):
        import torch.distributed as dist

        inner = super().prepare(problem, config, ctx)
        if config not in self.timeouts or dist.get_rank() != 1:
            return inner
        calls = []

        def launcher(x):
            calls.append(1)
            if len(calls) == 2:
                ctx.workspace.give_up_a_wait()
            return inner(x)

        return launcher


def _sweep_worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        from autosymm.tuning.session import TuneSession, TuneSettings

        space = all_reduce_space("one_shot", 8192, world_size, 2)[:3]
        backends = {"nccl": GlooAllReduce("nccl", [None]),
                    "triton_one_shot": TimingOutAllReduce("triton_one_shot", space, timeouts=space[1:2])}
        ws = CpuWorkspace(rank, world_size)
        settings = TuneSettings(strategy="grid", modes=("eager",), timeout_s=30.0, plan_for=lambda problem, mode: PLAN)
        session = TuneSession(settings, backends, group=dist.group.WORLD, workspace=ws, hardware="test-hw",
                              control_group=dist.new_group(backend="gloo"))
        items = session.sweep([Problem.all_reduce(16384, world_size=world_size)])
        (item,) = items
        out.put((rank, {
            "status": item.status, "winner": item.summary()["backend"] if item.summary() else None,
            "results": [(r.candidate.describe(), r.score, r.error) for r in item.outcome.results],
            "details": [r.detail for r in item.outcome.results if r.detail],
            "bad": Candidate("triton_one_shot", space[1]).describe(),
            "resets": ws.resets, "device_barriers": ws.device_barriers, "errors_left": ws.barrier_errors(),
        }, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_a_barrier_timeout_on_one_rank_fails_the_candidate_everywhere_and_the_sweep_goes_on():
    reports = run_with_deadline(_sweep_worker, 2, deadline_s=90.0)
    r0, r1 = reports[0], reports[1]
    assert r0["results"] == r1["results"], "every rank holds the same outcome"
    results = {name: (score, error) for name, score, error in r0["results"]}
    # NCCL and 3 configs, each in both eager launch styles (sweep.with_eager_launches)
    assert len(results) == 7, "every candidate was measured: the search went on after the failure"
    assert results[r0["bad"]] == (float("inf"), "measure failed on rank(s) [1]")
    assert all(error is None for name, (_, error) in results.items() if name != r0["bad"])
    assert r0["status"] == "tuned" and r0["winner"] is not None
    assert any("barrier timed out: a peer never arrived" in d for d in r1["details"])
    # one reset before the first problem, one after the failed candidate, on both ranks
    assert r0["resets"] == [0, 0] and r1["resets"] == [0, 1]
    assert r0["errors_left"] == r1["errors_left"] == 0
    assert r0["device_barriers"] == r1["device_barriers"] == 7  # one per measured candidate


def test_eager_candidates_are_timed_as_the_runtime_runs_them():
    """An eager Triton all-reduce candidate is wrapped as autosymm.runtime.group wraps it (replay.wrap_eager)
    and every timing input is planned before the clock runs: the timed calls are hits."""
    from autosymm.runtime.replay import EagerReplay

    ws = CpuWorkspace()

    class Launcher:  # a Triton all-reduce launcher's interface: checked call, bind, workspace
        workspace = ws

        def __init__(self):
            self.log = []

        def __call__(self, x):
            self.log.append("call")
            return x.copy_(torch.arange(16, dtype=torch.float32))  # in place, as an all-reduce

        def bind(self, x):
            return lambda: self.log.append("bound")

    launcher = Launcher()

    class Backend:
        def prepare(self, problem, config, ctx):
            return launcher

    evaluator = SweepEvaluator(Problem.all_reduce(64, "fp32", 2), "eager", {"triton_one_shot": Backend()},
                               FakeData(), RunContext(workspace=ws), PLAN)
    wrapped = evaluator.prepare(Candidate("triton_one_shot", None))
    assert isinstance(wrapped, EagerReplay) and wrapped.launcher is launcher
    timing = evaluator.measure(wrapped)
    timed = PLAN.warmup + PLAN.repeats * PLAN.calls_per_sample
    assert timing.ok and launcher.log[-timed:] == ["bound"] * timed  # no checked call, no planning, while timed
    graph = SweepEvaluator(Problem.all_reduce(64, "fp32", 2), "graph", {"triton_one_shot": Backend()},
                           FakeData(), RunContext(workspace=ws), PLAN)
    assert graph.prepare(Candidate("triton_one_shot", None)) is launcher  # graph mode: captured as it is

"""The tuner's rank protocol over gloo: 2 and 4 CPU processes, fake timers, failing candidates.

Every rank must end with the same results and winner; a candidate that fails on one rank (in
prepare, in measure, by a wrong result, by hanging past the timeout) never wins; nothing
deadlocks; a candidate that never comes back stops the problem on every rank.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from datetime import timedelta

import pytest

from _gloo import run_with_deadline

from autosymm.backends.base import Backend, Needs
from autosymm.backends.triton_all_reduce import all_reduce_space
from autosymm.configs import config_to_json
from autosymm.problem import Problem
from autosymm.tuning.timing import Timing
from autosymm.tuning.outcome import Candidate, build_candidates
from autosymm.tuning.tuner import SearchSettings, tune

TIMEOUT_S = 1.0  # generous: a loaded CI machine must not time out a healthy fake
SPACE = {"nccl": [None], "torch_one_shot": [None],
         "triton_one_shot": all_reduce_space("one_shot", 65536, 4, 2)[:10],
         "triton_two_shot": all_reduce_space("two_shot", 65536, 4, 2)[:8]}
BIG = {"nccl": [None], "triton_one_shot": all_reduce_space("one_shot", 8 * 1024 * 1024, 8, 2)}


def _stuck_candidate():
    return build_candidates(SPACE)[6]


STUCK = _stuck_candidate()


def base_time(candidate: Candidate) -> float:
    if candidate.config is None:
        return 100.0 if candidate.backend == "nccl" else 90.0
    c = candidate.config
    return 10.0 + abs(c.block_size - 4096) / 512 + abs(c.num_blocks - 16) / 4 + c.num_warps / 8 + (
        0 if c.algorithm == "two_shot" else 3)


def ranked(space):
    return sorted(build_candidates(space), key=base_time)


class RankEvaluate:
    """Fake evaluate on one rank: ``plan`` maps candidate -> (failing rank, how)."""

    def __init__(self, rank: int, plan: dict, hang_s: float):
        self.rank, self.plan, self.hang_s = rank, plan, hang_s

    def _how(self, candidate):
        rank, how = self.plan.get(candidate, (None, None))
        return how if rank == self.rank else None

    def prepare(self, candidate):
        if self._how(candidate) == "prepare":
            raise RuntimeError(f"rank {self.rank}: compile failed")
        return candidate

    def measure(self, candidate):
        how = self._how(candidate)
        if how == "raise":
            raise RuntimeError("launch failed")
        if how == "wrong":
            raise ValueError("wrong result")
        if how == "inf":
            return Timing.failed()
        if how == "hang":
            time.sleep(self.hang_s)
            return Timing(0.01, 0.01, 0.01, 1)  # too late: must not count
        t = base_time(candidate) * (1 + 0.01 * self.rank)  # ranks differ; MAX takes the slowest
        return Timing(t, 0.9 * t, 1.1 * t, 20)


class GlooAllReduce(Backend):
    """Stands in for NCCL (and, with ``wrong``/``broken`` configs, for the tuned kernels) on gloo."""

    needs = Needs()  # serves the all-reduce: its names are the spec's

    def __init__(self, name, space, wrong=(), broken=()):
        self.name, self.space, self.wrong, self.broken = name, space, set(wrong), set(broken)


    def search_space(self, problem):
        return self.space

    def prepare(self, problem, config, ctx):
        import torch.distributed as dist

        if config in self.broken:
            raise RuntimeError("does not compile")
        wrong = config in self.wrong

        def launcher(x):
            dist.all_reduce(x, group=ctx.group)
            if wrong:
                x[::7] += 1  # a racy kernel: a few elements off
            return x

        return launcher


class GatherMoE(Backend):
    """A correct (slow) MoE conversion through all_gather + autosymm.routing's references; ``wrong``
    configs drop one written row."""

    needs = Needs()
    name = "triton_moe"

    def __init__(self, space, wrong=()):
        self.space, self.wrong = space, set(wrong)


    def search_space(self, problem):
        return self.space

    def prepare(self, problem, config, ctx):
        import torch
        import torch.distributed as dist

        import _moe_ref as moe

        wrong, rank = config in self.wrong, dist.get_rank(ctx.group)

        def launcher(src, assignment, expt_indx, indx):
            srcs = [torch.empty_like(src) for _ in range(problem.world_size)]
            dist.all_gather(srcs, src.contiguous(), group=ctx.group)
            out = getattr(moe, f"reference_{problem.op}")(srcs, assignment, expt_indx, indx)[rank]
            if wrong:
                written = moe.rows_written(problem.op, assignment, expt_indx, indx, problem.world_size)[rank]
                out[torch.nonzero(written)[0]] += 1
            return out

        return launcher


def quick_sweep(rank: int, backends: dict, problems: list):
    """(items, the rank-0 TuningDB or None): TuneSession.sweep of ``problems`` over ``backends`` on
    the gloo world, eager only, with a short timing plan."""
    import torch.distributed as dist

    from autosymm.db.store import TuningDB
    from autosymm.tuning.session import TuneSession, TuneSettings
    from autosymm.tuning.sweep import TimingPlan

    db = TuningDB(":memory:") if rank == 0 else None
    control = dist.new_group(backend="gloo")
    settings = TuneSettings(strategy="grid", modes=("eager",), timeout_s=30.0,
                            plan_for=lambda problem, mode: TimingPlan(2, warmup=1, repeats=3, calls_per_sample=1,
                                                                      calls_per_graph=2))
    session = TuneSession(settings, backends, group=dist.group.WORLD, db=db, hardware="test-hw", control_group=control)
    return session.sweep(problems), db


def run_gloo_sweep(rank, world_size):
    """TuneSession.sweep end to end on gloo CPU tensors with stand-in backends (eager mode only)."""
    from autosymm.backends.nccl_all_to_all import NCCL_ALL_TO_ALL
    from autosymm.configs import moe_space
    from autosymm.problem import MoEShape

    ar_space = all_reduce_space("one_shot", 8192, world_size, 2)[:3]
    shape = MoEShape(64, 8, 2)
    moe_configs = moe_space(64, 16)[:2]
    backends = {"nccl": GlooAllReduce("nccl", [None]),
                "triton_one_shot": GlooAllReduce("triton_one_shot", ar_space, wrong=ar_space[:1], broken=ar_space[1:2]),
                "triton_moe": GatherMoE(moe_configs, wrong=moe_configs[:1]),
                "nccl_all_to_all": NCCL_ALL_TO_ALL}
    problems = [Problem.all_reduce(16384, world_size=world_size),
                Problem.moe("dp_to_ep", shape, 4, world_size=world_size),
                Problem.moe("ep_to_dp", shape, 8, world_size=world_size)]
    items, db = quick_sweep(rank, backends, problems)
    rows = [(r.op, r.backend, r.config, r.nccl_us is not None) for r in db.rows()] if db is not None else None
    return {"items": [(i.problem.describe(), i.mode, i.status, i.summary()["backend"] if i.summary() else None,
                       [(r.candidate.describe(), r.error) for r in i.outcome.results]) for i in items],
            "rows": rows, "bad": [config_to_json(c) for c in (ar_space[0], ar_space[1], moe_configs[0])]}


def summary(outcome):
    return {
        "best": outcome.best.candidate.describe() if outcome.best else None,
        "best_us": outcome.best.timing.median_us if outcome.best else None,
        "results": [(r.candidate.describe(), r.score, r.error) for r in outcome.results],
        "baseline": outcome.baseline.score if outcome.baseline else None,
        "aborted": outcome.aborted,
    }


def scenarios(world_size: int):
    fast = ranked(SPACE)
    last = world_size - 1
    plan = {fast[0]: (1, "prepare"), fast[1]: (last, "raise"), fast[2]: (0, "hang"), fast[3]: (0, "wrong"),
            fast[4]: (last, "inf")}
    big_fast = ranked(BIG)
    big_plan = {big_fast[0]: (last, "raise"), big_fast[1]: (1, "prepare")}
    return plan, big_plan


def _worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        plan, big_plan = scenarios(world_size)
        problem = Problem.all_reduce(1 << 17, world_size=world_size)
        report = {}
        start = time.monotonic()
        # A: grid; failures in prepare / measure / wrong result / inf / a hang that recovers
        outcome = tune(problem, SPACE, RankEvaluate(rank, plan, hang_s=TIMEOUT_S + 0.5),
                       SearchSettings(strategy="grid", timeout_s=TIMEOUT_S, grace_s=5.0))
        report["grid"] = summary(outcome)
        # B: optuna (only rank 0 runs the study; the others follow its broadcasts)
        outcome = tune(problem, BIG, RankEvaluate(rank, big_plan, 0),
                       SearchSettings(strategy="optuna", trials=12, seed=3, timeout_s=TIMEOUT_S))
        report["optuna"] = summary(outcome)
        # C: the ranks disagree on the candidates: every rank raises, nobody hangs
        mine = dict(SPACE, triton_two_shot=SPACE["triton_two_shot"][: (7 if rank == 1 else 8)])
        try:
            tune(problem, mine, RankEvaluate(rank, {}, 0), SearchSettings(strategy="grid", timeout_s=TIMEOUT_S))
            report["mismatch"] = "no error"
        except RuntimeError as exc:
            report["mismatch"] = "different candidate lists" in str(exc)
        # S: the sweep driver end to end (references, validation, db rows on rank 0)
        report["sweep"] = run_gloo_sweep(rank, world_size)
        # D: a candidate never comes back on one rank: the problem is abandoned everywhere
        stuck = {STUCK: (1, "hang")}
        outcome = tune(problem, SPACE, RankEvaluate(rank, stuck, hang_s=120.0),
                       SearchSettings(strategy="grid", timeout_s=TIMEOUT_S, grace_s=0.5))
        report["stuck"] = summary(outcome)
        report["elapsed"] = time.monotonic() - start
        out.put((rank, report, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, deadline_s: float = 90.0):
    return run_with_deadline(_worker, world_size, deadline_s)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_protocol(world_size):
    start = time.monotonic()
    reports = run_ranks(world_size)
    elapsed = time.monotonic() - start
    plan, big_plan = scenarios(world_size)
    first = reports[0]
    for rank in range(1, world_size):  # identical outcomes everywhere
        for key in ("grid", "optuna", "stuck"):
            assert reports[rank][key] == first[key], (rank, key)

    grid = first["grid"]
    bad = {c.describe() for c in plan}
    assert grid["aborted"] is None and grid["best"] not in bad
    expected = ranked(SPACE)[5]  # the fastest candidate that no rank spoils
    assert grid["best"] == expected.describe()
    assert grid["best_us"] == pytest.approx(base_time(expected) * (1 + 0.01 * (world_size - 1)))  # MAX over ranks
    errors = {name: error for name, score, error in grid["results"]}
    assert len(grid["results"]) == len(build_candidates(SPACE))
    fast = ranked(SPACE)
    assert errors[fast[0].describe()] == "prepare failed on rank(s) [1]"
    assert errors[fast[1].describe()] == f"measure failed on rank(s) [{world_size - 1}]"
    assert errors[fast[2].describe()].startswith("measure timed out") and "rank(s) [0]" in errors[fast[2].describe()]
    assert errors[fast[3].describe()] == "measure failed on rank(s) [0]"
    assert errors[fast[4].describe()] == f"measure failed on rank(s) [{world_size - 1}]"
    assert all(math.isinf(score) for name, score, error in grid["results"] if name in bad)
    assert grid["baseline"] == pytest.approx(100.0 * (1 + 0.01 * (world_size - 1)))

    optuna = first["optuna"]
    assert optuna["best"] not in {c.describe() for c in big_plan} and optuna["best"] is not None
    assert len(optuna["results"]) == 1 + 12

    assert all(r["mismatch"] is True for r in reports.values())

    stuck = first["stuck"]
    assert stuck["best"] is None and stuck["aborted"] and "did not recover" in stuck["aborted"]
    # evaluated in grid order up to the stuck candidate, then the search stopped
    assert len(stuck["results"]) == build_candidates(SPACE).index(STUCK) + 1

    sweep = first["sweep"]
    assert all(reports[r]["sweep"]["items"] == sweep["items"] for r in range(world_size))
    assert [status for _, mode, status, _, _ in sweep["items"]] == ["tuned"] * 3
    for _, _, _, winner, results in sweep["items"]:
        errors = [e for _, e in results if e]
        assert len(errors) >= 1 and all("rank(s) [0" in e for e in errors)  # the bad configs fail everywhere
    rows = sweep["rows"]
    assert {(op, backend) for op, backend, _, _ in rows} == {
        ("all_reduce", "nccl"), ("all_reduce", "triton_one_shot"), ("dp_to_ep", "triton_moe"),
        ("dp_to_ep", "nccl_all_to_all"), ("ep_to_dp", "triton_moe"), ("ep_to_dp", "nccl_all_to_all")}
    assert all(has_nccl for _, _, _, has_nccl in rows)
    assert not any(config in sweep["bad"] for _, _, config, _ in rows)  # nothing unverified recorded
    assert all(r["sweep"]["rows"] is None for rank, r in reports.items() if rank)  # rank 0 writes

    assert max(r["elapsed"] for r in reports.values()) < 25
    assert elapsed < 60, f"{world_size} ranks took {elapsed:.1f} s"

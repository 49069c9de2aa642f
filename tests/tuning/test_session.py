"""autosymm.tuning.session: the settings, and one setup path for `tune`, `bench` and the optuna
script (TuneSession.open) over two gloo ranks: no workspace, the database on rank 0 only, the
sweep's rows in it, and `tune`'s result with the failed items."""

from __future__ import annotations

import math

import pytest
from _gloo import run_gloo

from autosymm.backends.base import Backend, Needs
from autosymm.backends.triton_all_reduce import all_reduce_space
from autosymm.problem import Problem
from autosymm.tuning.outcome import Candidate
from autosymm.tuning.session import TuneOptions, TuneSettings
from autosymm.tuning.sweep import TimingPlan, measure_timeout_s, timing_plan

PLAN = TimingPlan(2, warmup=1, repeats=3, calls_per_sample=1, calls_per_graph=2)


def _fast_plan(problem, mode):
    return PLAN


def test_settings_defaults_and_conversion():
    settings = TuneSettings()
    assert settings.strategy == "auto" and settings.trials is None and settings.modes is None
    assert settings.timeout_s == measure_timeout_s() and settings.plan_for is timing_plan
    settings = TuneSettings(modes=["eager"], backends=["nccl"])
    assert settings.modes == ("eager",) and settings.backends == ("nccl",)
    options = TuneOptions(ops=["all_reduce"], dtypes=["bf16"], modes=["eager", "graph"], points={"--sizes": [4096]},
                          strategy="optuna", trials=7, seed=3, backends=[])
    assert options.settings() == TuneSettings(strategy="optuna", trials=7, seed=3, modes=("eager", "graph"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="bayes"), "strategy='bayes' is not one of"),
    (dict(trials=0), "trials=0 must be at least 1"),
    (dict(modes=("eager", "replay")), r"modes \['replay'\] are not in"),
    (dict(timeout_s=0.0), "timeout_s=0.0 must be > 0 s"),
    (dict(prepare_timeout_s=-1.0), "prepare_timeout_s=-1.0 must be > 0 s"),
    (dict(grace_s=-1.0), "grace_s=-1.0 must be >= 0 s"),
])
def test_settings_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TuneSettings(**kwargs)


class _OnlyRightAt(Backend):
    """A stand-in all-reduce (gloo) that is right only below ``max_nbytes``: above, every config
    (the baseline too) adds 1 to the result, so no candidate passes validation."""

    needs = Needs()

    def serves(self, record):
        return record.name == "all_reduce"

    def __init__(self, space, max_nbytes):
        self.space, self.max_nbytes = space, max_nbytes


    def search_space(self, problem):
        return self.space

    def prepare(self, problem, config, ctx):
        import torch.distributed as dist

        wrong = problem.nbytes > self.max_nbytes

        def launcher(x):
            dist.all_reduce(x, group=ctx.group)
            return x + 1 if wrong else x

        return launcher


def _backends(world_size, max_nbytes=1 << 30):
    space = all_reduce_space("one_shot", 8192, world_size, 2)[:2]
    return {"nccl": _OnlyRightAt([None], max_nbytes), "triton_one_shot": _OnlyRightAt(space, max_nbytes)}


def _session_ranks(rank, world_size, db_path, job_db_path):
    import torch.distributed as dist

    from autosymm.db.store import TuningDB
    from autosymm.tuning import session as session_module
    from autosymm.tuning.session import TuneSession

    settings = TuneSettings(strategy="grid", modes=("eager",), timeout_s=30.0, plan_for=_fast_plan)
    problems = [Problem.all_reduce(16384, "fp32", world_size)]
    session = TuneSession.open(settings, problems, db_path=db_path, backends=_backends(world_size))
    report = {"workspace": session.workspace, "device": str(session.device), "same_group": (
        session.control_group is dist.group.WORLD), "has_db": session.db is not None}
    items = session.sweep(problems + [Problem.all_reduce(16384, "fp32", world_size)])
    report["items"] = [(i.status, i.rows_written, i.summary()["backend"]) for i in items]
    only_nccl = session.with_settings(TuneSettings(strategy="grid", modes=("eager",), backends=("nccl",)))
    report["derived"] = (sorted(only_nccl.backends), only_nccl.db is session.db, sorted(session.backends))
    dist.barrier()
    if rank == 0:
        report["rows"] = sorted((r.backend, r.hardware) for r in TuningDB(db_path).rows())
    # `autosymm tune`'s worker body: 8 KiB tunes, 16 KiB fails everywhere (no candidate is right)
    session_module._load_backends = lambda names: (_backends(world_size, max_nbytes=8192), {})
    options = TuneOptions(ops=["all_reduce"], dtypes=["fp32"], modes=["eager"], points={"--sizes": [8192, 16384]},
                          strategy="grid", db_path=job_db_path)
    report["job"] = session_module.tune_job(rank, world_size, options)
    # two picks re-timed interleaved through the same evaluator; a backend the session lacks fails
    space = sorted(session.backends["triton_one_shot"].space, key=str)
    picks = [Candidate("triton_one_shot", space[0]), Candidate("nccl"), Candidate("triton_one_shot_push", space[0])]
    report["timed"] = session.time_candidates(Problem.all_reduce(4096, "fp32", world_size), "eager", picks, rounds=2)
    return report


def test_a_session_opened_over_gloo_sweeps_and_rank_0_alone_writes(tmp_path):
    db_path, job_db_path = str(tmp_path / "session.sqlite"), str(tmp_path / "job.sqlite")
    reports = run_gloo(_session_ranks, 2, db_path, job_db_path)
    r0, r1 = reports[0], reports[1]
    for report in (r0, r1):  # gloo: no symmetric workspace, inputs on the CPU, gloo is the control group
        assert report["workspace"] is None and report["device"] == "cpu" and report["same_group"]
        assert report["derived"] == (["nccl"], True, ["nccl", "triton_one_shot"])
    assert r0["has_db"] and not r1["has_db"]
    # the same problem twice: rank 0 records each backend's best row per item, rank 1 nothing
    assert [status for status, _, _ in r0["items"]] == ["tuned", "tuned"] == [s for s, _, _ in r1["items"]]
    assert [written for _, written, _ in r0["items"]] == [2, 2] and [w for _, w, _ in r1["items"]] == [0, 0]
    assert r0["rows"] == [("nccl", "cpu"), ("triton_one_shot", "cpu")]  # upserted: one row per backend and key
    job = r0["job"]
    assert r1["job"] is None, "only rank 0 returns the result"
    timed = list(r0["timed"].values())
    assert timed[0] > 0 and timed[1] > 0 and math.isinf(timed[2]) and r0["timed"] == r1["timed"]  # MAX over ranks
    assert [(row["label"], row["mode"]) for row in job.rows] == [("8KiB", "eager")]
    assert job.failures == ["all_reduce fp32 ws=2 16KiB [eager]: failed no candidate passed validation"]

"""A sweep of the fused op's epilogues on 2 gloo ranks: `tune --epilogues` makes one problem per
epilogue under its own shape key; a candidate is validated against autosymm.epilogue.reference
(residual, quantized output, scales): the NCCL fallback passes, a candidate two e4m3 steps off
on one value (or returning the unquantized output) is disqualified on every rank."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch
from _gloo import run_with_deadline

from autosymm.backends.base import Backend, Needs
from autosymm.backends.nccl_fused import nccl_fused
from autosymm.spec.all_reduce_rmsnorm import EPILOGUES, parse_epilogues
from autosymm.configs import FusedConfig
from autosymm.epilogue import Epilogue
from autosymm.problem import Problem
from autosymm.tuning.session import sweep_problems
from autosymm.tuning.sweep import TimingPlan

PLAN = TimingPlan(2, warmup=1, repeats=3, calls_per_sample=1, calls_per_graph=2)
OK, TWO_STEPS, ONE_STEP = (FusedConfig("one_shot", 128, 4, n) for n in (1, 2, 4))


class _Shifted(Backend):
    """NCCL + the reference, then (per config) one fp8 value moved by 0, 2 or 1 code steps."""

    name = "shifted"
    needs = Needs()

    def serves(self, record):
        return record.name == "all_reduce_rmsnorm"

    def search_space(self, problem):
        return [OK, TWO_STEPS, ONE_STEP]

    def prepare(self, problem, config, ctx):
        inner = nccl_fused.prepare(problem, None, ctx)
        steps = {1: 0, 2: 2, 4: 1}[config.num_blocks]

        def launcher(x, residual, weight, eps, *, scale=None):
            out = inner(x, residual, weight, eps, scale=scale)
            bits = out.view(torch.uint8)
            bits[0, 0] = (bits[0, 0] & 0x80) | ((bits[0, 0] & 0x7F) - steps if bits[0, 0] & 0x7F > 8
                                                else (bits[0, 0] & 0x7F) + steps)
            return out

        return launcher


def _worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        from autosymm.tuning.session import TuneSession, TuneSettings

        settings = TuneSettings(strategy="grid", modes=("eager",), timeout_s=30.0, plan_for=lambda p, m: PLAN)
        session = TuneSession(settings, {"nccl_fused": nccl_fused, "shifted": _Shifted()}, group=dist.group.WORLD,
                              hardware="test-hw", control_group=dist.new_group(backend="gloo"))
        problems = [Problem.all_reduce_rmsnorm(3, 64, "bf16", world_size, epilogue=Epilogue(quant="fp8")),
                    Problem.all_reduce_rmsnorm(3, 64, "bf16", world_size, epilogue=Epilogue(residual=False,
                                                                                            quant="fp8"))]
        report = []
        for item in session.sweep(problems):
            report.append({"status": item.status, "winner": item.summary()["backend"],
                           "results": [(r.candidate.describe(), r.score == float("inf"))
                                       for r in item.outcome.results]})
        out.put((rank, report, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_an_epilogue_sweep_validates_against_the_reference():
    reports = run_with_deadline(_worker, 2, deadline_s=180.0)
    assert reports[0] == reports[1]
    for problem in reports[0]:
        failed = [name for name, inf in problem["results"] if inf]
        passed = [name for name, inf in problem["results"] if not inf]
        # two steps off fails (in both eager launch styles); one step off and exact pass
        assert failed and all("num_blocks=2" in name for name in failed), problem["results"]
        assert any("num_blocks=4" in name for name in passed) and any("nccl_fused" in name for name in passed)


def test_tune_epilogues_make_one_problem_per_epilogue_and_key():
    epilogues = parse_epilogues("default,add_rms_fp8,rms_nvfp4")
    problems = sweep_problems(["all_reduce_rmsnorm"], ["bf16"], 2, {"--tokens": [16], "--epilogues": epilogues})
    keys = {p.shape_key for p in problems}
    assert {"h4096", "h4096_add_rms_fp8", "h4096_rms_nvfp4", "h7168_rms_nvfp4"} <= keys
    every = sweep_problems(["all_reduce_rmsnorm"], ["bf16"], 2, {"--tokens": [16], "--epilogues": parse_epilogues("all")})
    assert {p.epilogue for p in every} == set(EPILOGUES)
    assert {p.epilogue for p in sweep_problems(["all_reduce_rmsnorm"], ["bf16"], 2, {"--tokens": [16]})} == {Epilogue()}

"""A sweep of the fused all-reduce + RMSNorm on 2 gloo ranks: the problems `--ops
all_reduce_rmsnorm` makes, their inputs and reference (the residual and the output both
checked), a wrong candidate disqualified on every rank, the right one tuned against nccl_fused."""

from __future__ import annotations

import dataclasses
import os
import traceback
from datetime import timedelta

from _gloo import run_with_deadline

from autosymm.backends.base import Backend, Needs
from autosymm.backends.nccl_fused import nccl_fused
from autosymm.configs import FusedConfig
from autosymm.problem import MODEL_SHAPES, Problem
from autosymm.tuning.session import sweep_problems, workspace_bytes
from autosymm.spec import with_extra_sizes
from autosymm.spec.all_reduce_rmsnorm import EXTRA_TOKENS, HIDDEN as FUSED_HIDDEN
from autosymm.spec.kinds import TOKEN_COUNTS as TOKENS
from autosymm.tuning.sweep import TimingPlan

MOE_TOKENS = list(TOKENS)

PLAN = TimingPlan(2, warmup=1, repeats=3, calls_per_sample=1, calls_per_graph=2)


OK, FORGETS = FusedConfig("one_shot", 128, 4, 1), FusedConfig("one_shot", 128, 4, 2)


class _Composed(Backend):
    """A fused 'kernel' made of NCCL + torch; config FORGETS leaves the residual as it was."""

    name = "composed"
    needs = Needs()

    def serves(self, record):
        return record.name == "all_reduce_rmsnorm"

    def search_space(self, problem):
        return [OK, FORGETS]

    def prepare(self, problem, config, ctx):
        inner = nccl_fused.prepare(problem, None, ctx)
        if dataclasses.replace(config, eager_launch=OK.eager_launch) == OK:  # either eager launch style
            return inner

        def forgets(x, residual, weight, eps):
            saved = residual.clone()
            out = inner(x, residual, weight, eps)
            residual.copy_(saved)
            return out

        return forgets


def _worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        from autosymm.tuning.session import TuneSession, TuneSettings

        settings = TuneSettings(strategy="grid", modes=("eager",), timeout_s=30.0, plan_for=lambda p, m: PLAN)
        session = TuneSession(settings, {"nccl_fused": nccl_fused, "composed": _Composed()}, group=dist.group.WORLD,
                              hardware="test-hw", control_group=dist.new_group(backend="gloo"))
        (item,) = session.sweep([Problem.all_reduce_rmsnorm(3, 72, "bf16", world_size)])
        out.put((rank, {"status": item.status, "winner": item.summary()["backend"],
                        "results": [(r.candidate.describe(), r.score == float("inf"), r.error)
                                    for r in item.outcome.results]}, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def test_a_fused_sweep_checks_residual_and_output():
    reports = run_with_deadline(_worker, 2, deadline_s=120.0)
    assert reports[0]["results"] == reports[1]["results"]
    failed = {name for name, inf, _ in reports[0]["results"] if inf}
    # FORGETS in both eager launch styles (sweep.with_eager_launches), nothing else
    assert len(failed) == 2 and all('num_blocks=2' in name for name in failed), reports[0]["results"]
    assert reports[0]["status"] == "tuned" and reports[0]["winner"] in ("composed", "nccl_fused")


def test_ops_all_reduce_rmsnorm_sweeps_the_hidden_sizes_at_the_token_counts():
    problems = sweep_problems(["all_reduce_rmsnorm"], ["bf16"], 2, {"--tokens": [1, 64, 8192]})
    tokens = (1, 64, 128, 2048, 8192)  # and the fused targets' token counts inside the range
    assert [(p.hidden, p.n_tokens_local) for p in problems] == [(h, t) for h in FUSED_HIDDEN for t in tokens]
    assert {p.shape_key for p in problems} == {f"h{h}" for h in FUSED_HIDDEN}
    # the fused two-shot stages x and out rows: 2 x 128 MiB at 8192 tokens of 8192
    assert workspace_bytes(problems)[0] >= 2 * 8192 * 8192 * 2


def fused_tokens(tokens):
    return with_extra_sizes(tokens, EXTRA_TOKENS)


def test_fused_tokens_add_the_targets_inside_the_range_only():
    assert fused_tokens(MOE_TOKENS) == [1, 4, 16, 64, 128, 256, 1024, 2048, 4096, 8192]
    assert fused_tokens([1, 4]) == [1, 4] and fused_tokens([4, 1, 256]) == [1, 4, 128, 256] and fused_tokens([]) == []
    moe = sweep_problems(["dp_to_ep"], ["bf16"], 2, {"--shapes": [next(iter(MODEL_SHAPES.values()))],
                                                      "--tokens": MOE_TOKENS})
    assert [p.n_tokens_local for p in moe] == MOE_TOKENS, "the MoE sweep keeps its token counts"

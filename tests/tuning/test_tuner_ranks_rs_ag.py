"""The tuner's rank protocol for reduce-scatter and all-gather over gloo (the pattern of
test_tuner_ranks.py): a fake-timer search over the Triton families' real config spaces with
candidates failing on one rank, and the sweep driver end to end (tuning/ops inputs, NCCL's result
as the reference, validation, rows on rank 0) with stand-in Triton backends, some of them wrong.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from datetime import timedelta

import pytest
from _gloo import run_with_deadline
from test_tuner_ranks import RankEvaluate, quick_sweep, summary

from autosymm.backends.base import Backend, Needs
from autosymm.backends.triton_rs_ag import all_gather_space, reduce_scatter_space
from autosymm.configs import config_to_json
from autosymm.problem import Problem
from autosymm.tuning.outcome import build_candidates
from autosymm.tuning.tuner import SearchSettings, tune

TIMEOUT_S = 1.0


def _spaces(world_size: int) -> dict[str, dict]:
    rs = {"nccl_reduce_scatter": [None],
          "triton_reduce_scatter_pull": reduce_scatter_space("pull", 1 << 16, world_size, 2)[:6],
          "triton_reduce_scatter_push": reduce_scatter_space("push", 1 << 16, world_size, 2)[:4]}
    ag = {"nccl_all_gather": [None], "triton_all_gather_push": all_gather_space("push", 1 << 17, world_size)[:6],
          "triton_all_gather_pull": all_gather_space("pull", 1 << 17, world_size)[:4]}
    return {"reduce_scatter": rs, "all_gather": ag}


class Standin(Backend):
    """A Triton backend stood in for on gloo by NCCL's launcher; ``wrong`` configs spoil an element
    (on every rank), ``broken`` ones fail to prepare."""

    def __init__(self, name: str, op: str, space, wrong=(), broken=()):
        self.name, self.space, self.wrong, self.broken = name, space, set(wrong), set(broken)
        self.needs = Needs()
        self.op = op

    def search_space(self, problem):
        return self.space

    def prepare(self, problem, config, ctx):
        import torch.distributed as dist

        from autosymm.backends.nccl_rs_ag import all_gather_launcher, reduce_scatter_launcher

        if config in self.broken:
            raise RuntimeError("does not compile")
        inner = (reduce_scatter_launcher(ctx.group, dist.ReduceOp.SUM) if self.op == "reduce_scatter"
                 else all_gather_launcher(ctx.group))
        wrong = config in self.wrong

        def launcher(output, input, counts=None):
            inner(output, input, counts)
            if wrong:  # on every rank: a stand-in's timing calls are blocking collectives
                output.view(-1)[0] += 1
            return output

        return launcher


def _sweep(rank: int, world_size: int, spaces: dict) -> dict:
    from autosymm.backends import get_backend

    backends = {}
    for op, space in spaces.items():
        for name, configs in space.items():
            if configs == [None]:
                backends[name] = get_backend(name)  # the real NCCL backends, gloo standing in
            else:
                backends[name] = Standin(name, op, configs[:3], wrong=configs[:1], broken=configs[1:2])
    # 12 KiB: 6144 bf16 elements, equal shards for 2 and 3 ranks; 6146 B (3073 elements): per-rank counts
    problems = [Problem(op, "bf16", world_size, nbytes=n) for op in spaces for n in (12288, 6146)]
    items, db = quick_sweep(rank, backends, problems)
    rows = [(r.op, r.backend, r.config, r.nccl_us is not None, r.bucket) for r in db.rows()] if db else None
    bad = [config_to_json(c) for space in spaces.values() for name, configs in space.items()
           if configs != [None] for c in configs[:2]]
    return {"items": [(i.problem.describe(), i.status, i.summary()["backend"] if i.summary() else None,
                       [(r.candidate.describe(), r.error) for r in i.outcome.results]) for i in items],
            "rows": rows, "bad": bad}


def _worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        report = {}
        for op, space in _spaces(world_size).items():
            ranked = build_candidates(space)
            tuned = [c for c in ranked if c.config is not None]
            plan = {tuned[0]: (world_size - 1, "raise"), tuned[1]: (0, "wrong"), tuned[2]: (1, "prepare")}
            outcome = tune(Problem(op, "bf16", world_size, nbytes=1 << 17), space, RankEvaluate(rank, plan, 0),
                           SearchSettings(strategy="grid", timeout_s=TIMEOUT_S))
            report[op] = summary(outcome)
            report[op + "_bad"] = [c.describe() for c in plan]
        report["sweep"] = _sweep(rank, world_size, _spaces(world_size))
        out.put((rank, report, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_protocol_for_reduce_scatter_and_all_gather(world_size):
    start = time.monotonic()
    reports = run_with_deadline(_worker, world_size, 120.0)
    first = reports[0]
    for rank in range(1, world_size):
        assert reports[rank] == {**first, "sweep": {**first["sweep"], "rows": None}}, rank
    for op in ("reduce_scatter", "all_gather"):
        outcome = first[op]
        assert outcome["aborted"] is None and outcome["best"] is not None
        assert outcome["best"] not in first[op + "_bad"]
        bad = [(name, score) for name, score, _ in outcome["results"] if name in first[op + "_bad"]]
        assert len(bad) == 3 and all(math.isinf(score) for _, score in bad)
        # the baseline is the op's fallback (its record's nccl_*: base_time gives a config-less non-'nccl' 90 us)
        assert outcome["baseline"] == pytest.approx(90.0 * (1 + 0.01 * (world_size - 1)))
    sweep = first["sweep"]
    assert [status for _, status, _, _ in sweep["items"]] == ["tuned"] * 4
    for _, _, _, results in sweep["items"]:
        errors = [e for _, e in results if e]
        assert len(errors) == 4 and all("rank(s) [" in e for e in errors)  # wrong and broken, both families
    rows = sweep["rows"]
    assert {(op, backend) for op, backend, *_ in rows} == {
        ("reduce_scatter", "nccl_reduce_scatter"), ("reduce_scatter", "triton_reduce_scatter_pull"),
        ("reduce_scatter", "triton_reduce_scatter_push"), ("all_gather", "nccl_all_gather"),
        ("all_gather", "triton_all_gather_push"), ("all_gather", "triton_all_gather_pull")}
    assert {bucket for *_, bucket in rows} == {12288, 6146}  # the full tensor's bytes
    assert all(has_nccl for _, _, _, has_nccl, _ in rows)
    assert not any(config in sweep["bad"] for _, _, config, _, _ in rows)
    assert time.monotonic() - start < 100

"""`autosymm bench --regret` on real GPUs (autosymm.bench.regret): a small database tuned here first
(the all-reduce at 4 and 16 KiB, the fused op at h1024 x 1 and 4 tokens, both modes), then the
worker over it: the dispatcher's picks between those points against exact tunes, re-timed; every
exact tune repeated; every graph row's public call captured in a user's CUDA graph and replayed.
What is checked is that every measure ran and holds together, never a time."""

from __future__ import annotations

import math

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]


def _tuned_then_measured(rank, world_size, db_path):
    from autosymm.bench.regret import RegretOptions, regret_job
    from autosymm.db import store
    from autosymm.problem import Problem
    from autosymm.settings import export
    from autosymm.tuning.session import TuneSession, TuneSettings

    export({"AUTOSYMM_DB": db_path})  # what the runtime reads first (as `bench --regret --db` sets it)
    store.shipped_db_paths = lambda: []  # and nothing else: the points are this database's
    problems = [Problem.all_reduce(n, "bf16", world_size) for n in (4096, 16384)]
    problems += [Problem.all_reduce_rmsnorm(t, 1024, "bf16", world_size) for t in (1, 4)]
    session = TuneSession.open(TuneSettings(strategy="optuna", trials=4), problems, db_path=db_path)
    assert all(item.status == "tuned" for item in session.sweep(problems))
    torch.distributed.barrier()  # rank 0's rows are in the file before any rank reads it
    result = regret_job(rank, world_size, RegretOptions(limit=1, rounds=1, calls=4))
    if rank != 0:
        assert result is None
        return
    assert not result.stand_in and result.sources == [db_path]
    assert [(r.op, r.label, r.mode) for r in result.regret] == [
        ("all_reduce", "6.146kB", "eager"), ("all_reduce", "6.146kB", "graph"),
        ("all_reduce_rmsnorm", "h1024 t=2", "eager"), ("all_reduce_rmsnorm", "h1024 t=2", "graph")]
    for row in result.regret:
        assert row.note == "" and row.best and row.regret is not None and row.regret >= 0, row
        assert math.isfinite(row.chosen_us) and math.isfinite(row.best_us) and "between tuned" in row.reason
    assert [(f.op, f.label, f.mode) for f in result.flips] == [(r.op, r.label, r.mode) for r in result.regret]
    assert [(r.op, r.label) for r in result.replay] == [("all_reduce", "4KiB"), ("all_reduce_rmsnorm", "h1024 t=1")]
    for row in result.replay:
        assert row.note == "" and row.as_tuned and row.replay_us > 0 and row.ratio > 0, row


def test_regret_flips_and_replay_run_on_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("regret needs a collective: at least 2 GPUs")
    run_on_gpus(_tuned_then_measured, str(tmp_path / "tuned.sqlite"), world_size=2)

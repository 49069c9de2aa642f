"""Warm-up tuning (autosymm.autotune; autosymm.tuning.warmup over autosymm.runtime.warmup) on gloo
ranks: the first eager call of a key without rows is tuned on every rank together and served
from its rows; ranks with different timings agree; a failing candidate or a dying rank ends the
tune everywhere within its deadline, the database intact; the budget holds; nothing is tuned
inside a capture; a restart tunes nothing and decides the same; two groups writing one database
lose no row; the stack's own path keeps a call within the margin and loses it beyond; a
candidate of other numerics is refused before it is timed.

The candidates are gloo's own (NCCL's stand-in), the ordered all-gather sum, and a stand-in
'triton_one_shot' that sleeps per config (tests/_warmup_backends.py): its BLOCK 1024 config is
the fastest by design."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest
import torch
from _gloo import context, free_port, run_gloo, start

from autosymm.db.store import TuningDB

DEADLINE_S = 240.0
KEY = 4096  # elements of the all-reduce tuned (fp32: 16 KiB)


def _env(db, **more):
    return {"all": {"AUTOSYMM_DB": str(db), "AUTOSYMM_AGREE_TIMEOUT_S": "20", **more}}


def _rows(db) -> list:
    if not os.path.exists(db):
        return []
    with TuningDB(str(db), readonly=True) as opened:
        return opened.rows()


def _tune_calls(rank, world_size, slow=(1.0, 1.0), fail_on=0, budget_s=60.0, sizes=(KEY,), stack_us=None,
                clock_step=None, backends=None):
    """Calls of ``sizes`` inside autotune (each twice), then outside; what was tuned and decided."""
    import autosymm
    from _warmup_backends import SleepyAllReduce, install, sleepy_stack
    from autosymm.runtime.group import state_of

    sleepy = install(SleepyAllReduce(slow=slow[rank], fail_on=fail_on if rank == world_size - 1 else 0))
    stack_calls: list = []
    if stack_us is not None:
        state_of(None).attach_stack(sleepy_stack(stack_us, stack_calls))
    ticks = [0.0]

    def clock():  # an injected clock: every reading advances it (a budget spent in known steps)
        ticks[0] += clock_step
        return ticks[0]

    options = dict(modes=("eager",), trials=3, key_s=30.0, backends=backends, spacing=1.0)
    if clock_step is not None:
        options["clock"] = clock
    with autosymm.autotune(budget_s, **options) as tuner:
        for n in sizes:
            for _ in range(2):
                x = torch.full((n,), float(rank + 1))
                autosymm.all_reduce(x)
                assert float(x[0]) == sum(range(1, world_size + 1))
    after = torch.ones(KEY)
    autosymm.all_reduce(after)  # outside: served from the rows, nothing tuned
    decisions = {n: autosymm.explain(torch.ones(n), mode="eager") for n in sizes}
    return dict(tuned=[r.problem.nbytes for r in tuner.reports], spent=tuner.spent_s,
                backends={n: d.backend for n, d in decisions.items()},
                configs={n: d.config.block_size if d.config else None for n, d in decisions.items()},
                reasons={n: d.reason for n, d in decisions.items()}, calls=sleepy.calls, stack_calls=len(stack_calls),
                stack_us={n: d.stack_us for n, d in decisions.items()})


def test_the_first_call_tunes_its_key_and_the_next_start_tunes_nothing(tmp_path):
    db = tmp_path / "user.sqlite"
    first = run_gloo(_tune_calls, 2, env=_env(db), deadline_s=DEADLINE_S)
    for out in first.values():
        assert out["tuned"] == [KEY * 4]  # one key, tuned once, by both ranks
        assert out["configs"][KEY] in (1024, None) and "warm-up tuning: tuned here" in out["reasons"][KEY]
        assert sorted(set(out["calls"])) == [1024, 2048, 4096]  # each config validated and timed
    assert first[0]["backends"] == first[1]["backends"] and first[0]["configs"] == first[1]["configs"]
    rows = _rows(db)
    assert {r.backend for r in rows} >= {"nccl", "triton_one_shot"} and {r.bucket for r in rows} == {KEY * 4}
    one_shot = next(r for r in rows if r.backend == "triton_one_shot")
    assert one_shot.config_obj.block_size == 1024 and one_shot.nccl_us and one_shot.nccl_version is None or True
    again = run_gloo(_tune_calls, 2, env=_env(db), deadline_s=DEADLINE_S)
    for out in again.values():  # a restart: the rows are read, nothing tuned, the same decision
        assert out["tuned"] == [] and out["calls"] == [1024] * (3 if out["backends"][KEY] == "triton_one_shot" else 0)
        assert out["backends"] == first[0]["backends"] and out["configs"] == first[0]["configs"]


def test_ranks_with_different_timings_agree_on_one_winner(tmp_path):
    db = tmp_path / "user.sqlite"
    out = run_gloo(_tune_calls, 2, (1.0, 40.0), env=_env(db), deadline_s=DEADLINE_S)  # rank 1's sleeps 40x longer
    assert out[0]["backends"] == out[1]["backends"] and out[0]["configs"] == out[1]["configs"]
    (one_shot,) = [r for r in _rows(db) if r.backend == "triton_one_shot"]
    assert one_shot.median_us >= 40 * 100.0  # the MAX over ranks: rank 1's time


def test_a_candidate_failing_on_one_rank_is_out_everywhere_and_the_rest_is_tuned(tmp_path):
    db = tmp_path / "user.sqlite"
    out = run_gloo(_tune_calls, 2, (1.0, 1.0), 1024, env=_env(db), deadline_s=DEADLINE_S)
    assert out[0]["tuned"] == out[1]["tuned"] == [KEY * 4]
    (one_shot,) = [r for r in _rows(db) if r.backend == "triton_one_shot"]
    assert one_shot.config_obj.block_size == 2048  # 1024 failed on rank 1: scored +inf on both


def test_the_budget_holds_and_explain_says_why_a_key_was_not_tuned(tmp_path):
    db = tmp_path / "user.sqlite"
    # the injected clock advances 1 s per reading: the first key spends the 2 s budget
    out = run_gloo(_tune_calls, 2, (1.0, 1.0), 0, 2.0, (KEY, 2 * KEY, 3 * KEY), None, 1.0, env=_env(db),
                   deadline_s=DEADLINE_S)
    for rank in out.values():
        assert rank["tuned"] == [KEY * 4] and rank["spent"] >= 2.0
        for n in (2 * KEY, 3 * KEY):
            assert "warm-up budget of 2 s is spent" in rank["reasons"][n], rank["reasons"][n]  # served by neighbours
    assert {r.bucket for r in _rows(db)} == {KEY * 4}


def _capturing(rank, world_size):
    """A first call while the stream captures (the capture check faked on CPU): nothing tuned."""
    import autosymm
    import autosymm.runtime.entry as entry
    from _warmup_backends import SleepyAllReduce, install

    sleepy = install(SleepyAllReduce())
    entry.stream_capturing = lambda: True
    with autosymm.autotune(60, modes=("eager",)) as tuner:
        autosymm.all_reduce(torch.ones(KEY))
    return len(tuner.reports), len(sleepy.calls)


def test_nothing_is_tuned_inside_a_capture(tmp_path):
    assert run_gloo(_capturing, 2, env=_env(tmp_path / "user.sqlite"), deadline_s=DEADLINE_S) == {0: (0, 0),
                                                                                                    1: (0, 0)}
    assert not (tmp_path / "user.sqlite").exists()


def test_the_stack_path_keeps_the_call_within_the_margin_and_loses_it_beyond(tmp_path):
    """vLLM's own path (a stand-in: the NCCL baseline's own call, then a sleep) against the
    stand-in kernel's (its fastest config 2 ms slower) and NCCL's, at a 50 % margin
    (AUTOSYMM_STACK_MARGIN): faster than the kernel, it keeps the call; 50 ms slower than NCCL,
    it loses it, and every row records its time. (Against NCCL alone the two are one call: which
    is faster is the machine's jitter, on a loaded 2-core runner up to 3x.)"""
    env = {"AUTOSYMM_STACK_MARGIN": "0.5"}
    close = run_gloo(_tune_calls, 2, (20.0, 20.0), 0, 60.0, (KEY,), 0.0, None, ["triton_one_shot", "vllm"],
                     env=_env(tmp_path / "a.sqlite", **env), deadline_s=DEADLINE_S)
    far = run_gloo(_tune_calls, 2, (1.0, 1.0), 0, 60.0, (KEY,), 50000.0, None, ["nccl", "triton_one_shot", "vllm"],
                   env=_env(tmp_path / "b.sqlite", **env), deadline_s=DEADLINE_S)
    for rank in (0, 1):
        assert close[rank]["stack_calls"] > 0 and far[rank]["stack_calls"] > 0  # timed as a candidate
        assert close[rank]["backends"][KEY] == "vllm", close[rank]["reasons"]
        assert far[rank]["backends"][KEY] != "vllm" and far[rank]["stack_us"][KEY] >= 50000.0, far[rank]["reasons"]
        assert "faster than vllm's own path" in far[rank]["reasons"][KEY]
    rows = _rows(tmp_path / "b.sqlite")
    assert rows and all(r.stack == "vllm" and r.stack_us >= 50000.0 for r in rows)


def _fused_numerics(rank, world_size, numerics):
    """The fused op's warm-up: the NCCL fallback computes the native chain; the ordered fallback
    the single-rounding formula: refused before timing unless numerics='any'."""
    import autosymm
    from autosymm.backends import nccl_ordered

    timed = []
    real_prepare = nccl_ordered.NcclOrderedFused.prepare

    def recorded(self, problem, config, ctx):
        timed.append(problem.n_tokens_local)
        return real_prepare(self, problem, config, ctx)

    nccl_ordered.NcclOrderedFused.prepare = recorded
    x, residual, weight = torch.ones(8, 64), torch.zeros(8, 64), torch.ones(64)
    with autosymm.autotune(60, modes=("eager",), numerics=numerics, ops=["all_reduce_rmsnorm"]) as tuner:
        autosymm.all_reduce_rmsnorm(x, residual, weight)
    return len(timed), tuner.reports[0].note if tuner.reports else ""


@pytest.mark.parametrize("numerics", ["same", "any"])
def test_a_candidate_of_other_numerics_is_refused_before_timing(tmp_path, numerics):
    out = run_gloo(_fused_numerics, 2, numerics, env=_env(tmp_path / "user.sqlite"), deadline_s=DEADLINE_S)
    for timed, note in out.values():
        assert (timed == 0) == (numerics == "same"), (timed, note)
    rows = _rows(tmp_path / "user.sqlite")
    assert ("nccl_ordered_fused" in {r.backend for r in rows}) == (numerics == "any")


def _one_group_of_two(rank, world_size, db):
    """Ranks {0, 1} and {2, 3} each tune their own size into one database, at the same time."""
    import torch.distributed as dist

    import autosymm
    from _warmup_backends import SleepyAllReduce, install

    install(SleepyAllReduce())
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    n = KEY * (1 + rank // 2)
    with autosymm.autotune(60, modes=("eager",), db=str(db)):
        autosymm.all_reduce(torch.ones(n), group=mine)
    return n


def test_two_groups_tuning_into_one_database_lose_no_row(tmp_path):
    db = tmp_path / "user.sqlite"
    run_gloo(_one_group_of_two, 4, db, env=_env(db), deadline_s=DEADLINE_S)
    assert {r.bucket for r in _rows(db)} == {KEY * 4, 2 * KEY * 4}
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def _dies(rank, world_size, port, out, db):
    """Rank 1 ends its process in the middle of the tune (at its BLOCK 2048 candidate)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOSYMM_DB=str(db),
                      AUTOSYMM_AGREE_TIMEOUT_S="10")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import autosymm
    from _warmup_backends import SleepyAllReduce, install

    install(SleepyAllReduce(die_on=2048 if rank == 1 else 0))
    start_s = time.monotonic()
    try:
        with autosymm.autotune(60, modes=("eager",)) as tuner:
            autosymm.all_reduce(torch.ones(KEY))
        said = "no error"
    except Exception as exc:  # the untuned path's sum has no peer either
        said = f"{type(exc).__name__}"
    out.put((rank, time.monotonic() - start_s, said, [r.note for r in tuner.reports]))


def test_a_rank_dying_mid_tune_ends_the_tune_on_the_others_in_time_with_the_database_intact(tmp_path):
    db = tmp_path / "user.sqlite"
    ctx, port = context(), free_port()
    out = ctx.Queue()
    procs = [start(ctx, _dies, (rank, 2, port, out, db)) for rank in range(2)]
    try:
        rank, seconds, said, notes = out.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert rank == 0 and seconds < 60, (seconds, said, notes)
    assert not db.exists() or _rows(db) == []

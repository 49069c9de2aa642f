"""The search on one process with fake evaluations: who wins, what is visited, Optuna's budget."""

from __future__ import annotations

import math
import time

import pytest

from autosymm.backends.triton_all_reduce import all_reduce_space
from autosymm.configs import AllReduceConfig, config_from_json, moe_space
from autosymm.problem import MoEShape, Problem
from autosymm.tuning.timing import Timing
from autosymm.tuning.search import default_trials, resolve_strategy
from autosymm.tuning.outcome import Candidate, TuneOutcome, build_candidates
from autosymm.tuning.tuner import SearchSettings, tune

PROBLEM = Problem.all_reduce(1 << 20, world_size=4)
NUMEL = 8 * 1024 * 1024
BIG = {"triton_one_shot": all_reduce_space("one_shot", NUMEL, 8, 2),
       "triton_two_shot": all_reduce_space("two_shot", NUMEL, 8, 2)}
BIG_PROBLEM = Problem.all_reduce(NUMEL * 2, world_size=8)
GRID = SearchSettings(strategy="grid", timeout_s=None)  # no thread, no timeout


def optuna(trials: int, seed: int) -> SearchSettings:
    return SearchSettings(strategy="optuna", trials=trials, seed=seed, timeout_s=None)


def smooth(config: AllReduceConfig) -> float:
    """A smooth landscape over log2 of the launch parameters (minimum inside the space)."""
    return (1 + 0.05 * (math.log2(config.block_size) - 12.3) ** 2 + 0.04 * (math.log2(config.num_blocks) - 5.4) ** 2
            + 0.06 * (math.log2(config.num_warps) - 3.2) ** 2)


def fake_time(candidate: Candidate) -> float:
    if candidate.config is None:
        return {"nccl": 50.0, "torch_one_shot": 45.0}.get(candidate.backend, 70.0)
    base = {"triton_one_shot": 40.0, "triton_two_shot": 30.0}[candidate.backend]
    return base * smooth(candidate.config)


class FakeEvaluate:
    """prepare/measure with deterministic times; ``bad`` maps a candidate to how it fails."""

    def __init__(self, times=fake_time, bad=None):
        self.times = times
        self.bad = bad or {}
        self.prepared: list[Candidate] = []
        self.measured: list[Candidate] = []

    def prepare(self, candidate):
        self.prepared.append(candidate)
        if self.bad.get(candidate) == "prepare":
            raise RuntimeError("compile failed")
        return candidate

    def measure(self, candidate):
        self.measured.append(candidate)
        how = self.bad.get(candidate)
        if how == "raise":
            raise RuntimeError("launch failed")
        if how == "wrong":
            raise ValueError("wrong result: max abs error 3.0 at element 17")
        if how == "inf":
            return Timing(math.inf, math.inf, math.inf, 10)
        if how == "nan":
            return Timing(math.nan, 1.0, 1.0, 10)
        if how == "garbage":
            return "fast"
        t = self.times(candidate)
        return Timing(t, 0.9 * t, 1.1 * t, 10)


def small_space():
    return {"nccl": [None], "torch_one_shot": [None],
            "triton_one_shot": all_reduce_space("one_shot", 4096, 4, 2)[:8],
            "triton_two_shot": all_reduce_space("two_shot", 65536, 4, 2)[:12]}


def test_fastest_valid_candidate_wins_and_results_sorted():
    space = small_space()
    ev = FakeEvaluate()
    out = tune(PROBLEM, space, ev, GRID)
    everything = build_candidates(space)
    expected = min(everything, key=fake_time)
    assert out.best is not None and out.best.candidate == expected
    assert out.best.timing.median_us == pytest.approx(fake_time(expected))
    scores = [r.score for r in out.results]
    assert scores == sorted(scores) and len(out.results) == len(everything)
    assert out.baseline is not None and out.baseline.candidate == Candidate("nccl")
    assert out.aborted is None and out.strategies == {"triton_one_shot": "grid", "triton_two_shot": "grid"}


@pytest.mark.parametrize("how", ["prepare", "raise", "wrong", "inf", "nan", "garbage"])
def test_bad_candidates_never_win(how):
    space = small_space()
    ranked = sorted(build_candidates(space), key=fake_time)
    bad = {ranked[0]: how, ranked[1]: how}  # the two fastest fail
    ev = FakeEvaluate(bad=bad)
    out = tune(PROBLEM, space, ev, GRID)
    assert out.best.candidate == ranked[2]
    failed = [r for r in out.results if r.candidate in bad]
    assert len(failed) == 2 and all(not r.ok and r.score == math.inf and r.error for r in failed)
    assert out.results[-2:] == failed or set(map(id, out.results[-2:])) == set(map(id, failed))
    if how == "prepare":
        assert all(c not in bad for c in ev.measured)  # a failed prepare is never launched
        assert all("prepare failed on rank(s) [0]" == r.error for r in failed)
        assert "compile failed" in failed[0].detail


def test_all_fail_gives_no_best():
    space = {"nccl": [None], "triton_one_shot": all_reduce_space("one_shot", 4096, 4, 2)[:3]}
    ev = FakeEvaluate(bad={c: "raise" for c in build_candidates(space)})
    out = tune(PROBLEM, space, ev, GRID)
    assert out.best is None and out.baseline is not None and not out.baseline.ok
    assert out.rows(mode="eager", hardware="x") == []


def test_plain_callable_form_and_timeout():
    space = {"nccl": [None], "triton_one_shot": all_reduce_space("one_shot", 4096, 4, 2)[:4]}
    slow = build_candidates(space)[1]

    def evaluate(candidate):
        if candidate == slow:
            time.sleep(0.6)  # past the timeout; it ends within the grace period
            return Timing(0.001, 0.001, 0.001, 1)
        return fake_time(candidate)  # a float is accepted as the median

    start = time.monotonic()
    out = tune(PROBLEM, space, evaluate, SearchSettings(strategy="grid", timeout_s=0.2, grace_s=5.0))
    assert time.monotonic() - start < 5
    result = next(r for r in out.results if r.candidate == slow)
    assert result.error.startswith("measure timed out") and out.best.candidate != slow
    assert out.aborted is None and len(out.results) == 5


def test_grid_visits_every_point_exactly_once_in_order():
    space = small_space()
    ev = FakeEvaluate()
    tune(PROBLEM, space, ev, GRID)
    assert ev.measured == build_candidates(space)  # baselines first, then backends by name
    assert len(set(ev.measured)) == len(ev.measured)


def _visits(seed, trials=20):
    ev = FakeEvaluate()
    tune(BIG_PROBLEM, {"nccl": [None], **BIG}, ev, optuna(trials, seed))
    return ev.measured


def test_tpe_is_reproducible_per_seed():
    first, again, other = _visits(1), _visits(1), _visits(2)
    assert first == again
    assert first != other
    assert len(first) == 1 + 2 * 20 and len(set(first)) == len(first)  # no duplicate evaluations


def test_baselines_always_evaluated_once_outside_the_budget():
    space = {"nccl": [None], "torch_one_shot": [None], "torch_two_shot": [None], **BIG}
    ev = FakeEvaluate()
    out = tune(BIG_PROBLEM, space, ev, optuna(trials=5, seed=0))
    baselines = [c for c in ev.measured if c.config is None]
    assert baselines == [Candidate("nccl"), Candidate("torch_one_shot"), Candidate("torch_two_shot")]
    assert ev.measured[:3] == baselines
    per_backend = {b: sum(1 for c in ev.measured if c.backend == b) for b in BIG}
    assert per_backend == {"triton_one_shot": 5, "triton_two_shot": 5}
    assert out.strategies == {"triton_one_shot": "optuna", "triton_two_shot": "optuna"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_optuna_finds_near_best_with_30_percent_of_trials(seed):
    # Observed over seeds 0..19 on this landscape: TPE with 30% of the space lands on the exact
    # optimum of every backend (0.00% off, 20/20); a random sample of the same size is within 3%
    # only 18/20 times (median 1.3%, worst 6.9%).
    ev = FakeEvaluate()
    trials = math.ceil(0.3 * min(len(space) for space in BIG.values()))  # 30 %, past the default cap
    out = tune(BIG_PROBLEM, {"nccl": [None], **BIG}, ev, optuna(trials, seed))
    for backend, space in BIG.items():
        truth = min(fake_time(Candidate(backend, c)) for c in space)
        found = out.best_by_backend()[backend].score
        evaluated = sum(1 for c in ev.measured if c.backend == backend)
        assert evaluated <= math.ceil(0.3 * len(space))
        assert found <= 1.03 * truth, (backend, found, truth)
    assert out.best.candidate.backend == "triton_two_shot"


def test_auto_strategy_and_default_budget():
    assert resolve_strategy("auto", 10) == "grid" and resolve_strategy("auto", 500) == "optuna"
    with pytest.raises(ValueError, match="strategy"):
        resolve_strategy("bayes", 10)
    assert default_trials(10) == 10 and default_trials(40) == 16 and default_trials(70) == 21
    assert default_trials(300) == 24  # capped: MAX_DEFAULT_TRIALS
    moe = moe_space(7168, 4096)  # 126 configs: over the grid threshold
    ev = FakeEvaluate(times=lambda c: 1.0 if c.config is None else float(c.config.block_n) / c.config.num_warps)
    shape = MoEShape(7168, 256, 8)
    out = tune(Problem.moe("dp_to_ep", shape, 8, world_size=8), {"triton_moe": moe, "nccl_all_to_all": [None]}, ev,
               SearchSettings(timeout_s=None))
    assert out.strategies == {"triton_moe": "optuna"} and out.baseline.candidate.backend == "nccl_all_to_all"
    assert len(ev.measured) == 1 + default_trials(len(moe))


def test_rows_one_per_backend_with_nccl_baseline():
    space = small_space()
    out = tune(PROBLEM, space, FakeEvaluate(), GRID)
    prov = {"gpu": "NVIDIA H200", "autosymm_version": "0.1.0", "torch_version": "2.6"}
    rows = out.rows(mode="graph", hardware="nvidia-h200-nvlink", provenance=prov)
    assert sorted(r["backend"] for r in rows) == ["nccl", "torch_one_shot", "triton_one_shot", "triton_two_shot"]
    assert [r["median_us"] for r in rows] == sorted(r["median_us"] for r in rows)  # fastest first
    for row in rows:
        assert row["nccl_us"] == 50.0 and row["speedup"] == pytest.approx(50.0 / row["median_us"])
        assert row["mode"] == "graph" and row["bucket"] == PROBLEM.bucket and row["world_size"] == 4
        assert row["gpu"] == "NVIDIA H200" and row["torch_version"] == "2.6" and row["shape"] == ""
    assert config_from_json(rows[0]["config"]) == out.best.candidate.config
    by_backend = {r["backend"]: r for r in rows}
    assert by_backend["nccl"]["config"] == "{}" and by_backend["nccl"]["speedup"] == pytest.approx(1.0)
    assert by_backend["triton_two_shot"]["trials"] == 12 and by_backend["triton_one_shot"]["trials"] == 8
    try:
        from autosymm.db.store import Row
    except Exception:  # db.py is written elsewhere; skip the round trip without it
        return
    assert all(Row(**r).backend == r["backend"] for r in rows)


def test_outcome_aborted_records_nothing():
    out = TuneOutcome(PROBLEM, None, [], None, aborted="hung")
    assert out.rows(mode="eager", hardware="x") == []


class ResettingEvaluate(FakeEvaluate):
    """FakeEvaluate with the optional ``reset`` hook: records when the tuner calls it."""

    def __init__(self, bad=None, reset_error=None):
        super().__init__(bad=bad)
        self.resets: list[Candidate] = []  # the candidate measured last before each reset
        self.reset_error = reset_error

    def reset(self):
        self.resets.append(self.measured[-1])
        if self.reset_error:
            raise RuntimeError(self.reset_error)


def test_reset_runs_after_each_failed_measurement_only():
    space = {"nccl": [None], "triton_one_shot": all_reduce_space("one_shot", 4096, 4, 2)[:6]}
    cands = build_candidates(space)
    bad = {cands[1]: "raise", cands[2]: "prepare", cands[3]: "wrong", cands[4]: "inf"}
    ev = ResettingEvaluate(bad)
    out = tune(PROBLEM, space, ev, GRID)
    # prepare failures launch nothing (no reset); every failed measurement is followed by one
    assert ev.resets == [cands[1], cands[3], cands[4]]
    assert out.aborted is None and out.best is not None and len(out.results) == len(cands)


def test_a_failing_reset_stops_the_search():
    space = {"nccl": [None], "triton_one_shot": all_reduce_space("one_shot", 4096, 4, 2)[:6]}
    cands = build_candidates(space)
    ev = ResettingEvaluate({cands[2]: "raise"}, reset_error="pads not writable")
    out = tune(PROBLEM, space, ev, GRID)
    assert out.aborted and "reset after it failed" in out.aborted and "pads not writable" in out.aborted
    assert out.best is None and len(out.results) == 3  # nothing measured after the failed reset

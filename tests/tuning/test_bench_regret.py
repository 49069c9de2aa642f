"""`autosymm bench --regret`: the points between a database's tuned ones, the three measures
(regret, winner flips, replay fidelity) and their report; the whole worker over 2 gloo ranks with
the stand-in backends and timings (autosymm.bench.stand_in: a GPU node's candidates, each
validated for real on gloo, timed by a made-up clock); the CLI's options (its workers replaced by
a recorder: no process starts there)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from _gloo import run_gloo

from autosymm import spec
from autosymm.bench import regret as regret_module
from autosymm.bench.regret import (RegretOptions, regret_points, replay_keys, spread, tuned_families,
                                   _callable as callable_point)
from autosymm.bench.regret_report import (FlipRow, RegretResult, RegretRow, ReplayRow, csv_rows, lines, regret_of,
                                          summary, tables, write_csv, write_json)
from autosymm.bench.stand_in import STAND_IN_CONFIGS, StandInBackend, stand_in_caps, stand_in_us
from autosymm.cli.main import main
from autosymm.db.read import open_sources
from autosymm.db.store import TuningDB, shipped_db_paths
from autosymm.problem import Problem
from autosymm.tuning import workers
from autosymm.tuning.outcome import Candidate

HW = "nvidia-h200-nvlink"
AR_BUCKETS, FUSED_TOKENS = (4096, 8192, 16384), (1, 4, 16)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    """A database of the shipped 2 x H200 rows at three all-reduce sizes and three token counts of
    the fused op (h4096), every backend's row, both modes."""
    shipped = TuningDB(shipped_db_paths()[0], readonly=True)
    rows = [r for r in shipped.rows(op="all_reduce") if r.bucket in AR_BUCKETS]
    rows += [r for r in shipped.rows(op="all_reduce_rmsnorm") if r.shape == "h4096" and r.bucket in FUSED_TOKENS]
    path = tmp_path_factory.mktemp("regret") / "tuned.sqlite"
    TuningDB(path).record_many(rows)
    return path


# ------------------------------------------------------------------------------ points (pure)


def test_points_lie_between_the_tuned_ones_with_odd_sizes_inside_the_range(db_path):
    families = tuned_families(open_sources(None, [db_path]), HW, 2)
    assert families == {("all_reduce", "bf16", ""): list(AR_BUCKETS),
                        ("all_reduce_rmsnorm", "bf16", "h4096"): list(FUSED_TOKENS)}
    points = regret_points(families, 2, {})
    assert [(p.op, p.bucket) for p in points] == [
        ("all_reduce", 6144), ("all_reduce", 6146), ("all_reduce", 12288),  # midpoints, and 6 KiB + 2 B
        ("all_reduce_rmsnorm", 2), ("all_reduce_rmsnorm", 10)]
    assert {p.shape_key for p in points if p.op == "all_reduce_rmsnorm"} == {"h4096"}
    assert tuned_families(open_sources(None, [db_path]), HW, 2, ["all_reduce"]).keys() == {("all_reduce", "bf16", "")}
    assert tuned_families(open_sources(None, [db_path]), HW, 8) == {}  # no rows at this world size


def test_asked_sizes_replace_an_units_points_and_the_limit_spreads_them(db_path):
    families = tuned_families(open_sources(None, [db_path]), HW, 2)
    points = regret_points(families, 2, {spec.TOKENS.sweep.flag: [3, 5, 7, 9, 11]}, limit=3)
    assert [(p.op, p.bucket) for p in points] == [
        ("all_reduce", 6144), ("all_reduce", 6146), ("all_reduce", 12288),
        ("all_reduce_rmsnorm", 3), ("all_reduce_rmsnorm", 7), ("all_reduce_rmsnorm", 11)]
    small = regret_points(families, 2, {}, limit=2, max_bytes=16384)  # the limit spreads what fits
    assert [(p.op, p.bucket) for p in small] == [("all_reduce", 6144), ("all_reduce", 12288),
                                                 ("all_reduce_rmsnorm", 2)]  # 10 tokens x h4096: 80 KiB
    keys = replay_keys(open_sources(None, [db_path]), HW, 2, None, 2, max_bytes=16384)
    assert [(p.op, p.bucket) for p, _ in keys] == [("all_reduce", 4096), ("all_reduce", 16384),
                                                   ("all_reduce_rmsnorm", 1)]
    assert spread(list(range(10)), 4) == [0, 3, 6, 9] and spread([1, 2], 5) == [1, 2] and spread([1, 2, 3], 1) == [1]
    assert spread([1, 2], None) == [1, 2]


def test_a_midpoint_no_call_can_have_moves_down_to_one_it_can():
    record = spec.get("all_reduce")
    assert callable_point(record, "fp32", 2, 4099, None).nbytes == 4096  # whole fp32 elements
    assert callable_point(record, "bf16", 2, 1, None) is None


def test_replay_keys_are_the_graph_rows_winners(db_path):
    keys = replay_keys(open_sources(None, [db_path]), HW, 2, None, None)
    assert [(p.op, p.bucket) for p, _ in keys] == [("all_reduce", b) for b in AR_BUCKETS] + [
        ("all_reduce_rmsnorm", t) for t in FUSED_TOKENS]
    assert all(row.mode == "graph" for _, row in keys)
    fastest = min((r for r in TuningDB(db_path).rows(op="all_reduce", mode="graph") if r.bucket == 4096),
                  key=lambda r: r.median_us)
    assert keys[0][1].backend == fastest.backend
    assert len(replay_keys(open_sources(None, [db_path]), HW, 2, ["all_reduce_rmsnorm"], 2)) == 2


# ------------------------------------------------------------------------------ report (pure)


def test_regret_is_chosen_over_the_faster_minus_one():
    assert regret_of(12.0, 10.0) == pytest.approx(0.2)
    assert regret_of(10.0, 10.0) == 0.0
    assert regret_of(9.5, 10.0) == 0.0  # re-timed, the dispatcher's pick was the faster: no regret
    assert regret_of(math.inf, 10.0) is None and regret_of(10.0, math.inf) is None and regret_of(0.0, 1.0) is None


def _result(stand_in: bool = False) -> RegretResult:
    result = RegretResult(HW, 2, stand_in, ["tuned.sqlite"])
    for i, (regret, mode) in enumerate([(0.0, "eager"), (0.1, "eager"), (0.3, "eager"), (0.05, "graph")]):
        same = regret == 0.0
        result.regret.append(RegretRow("all_reduce", f"{6 + i}KiB", mode, "a", "eager row at 4KiB", "why",
                                       "a" if same else "b", 10.0 * (1 + regret), 10.0, regret))
    result.regret.append(RegretRow("all_reduce", "9KiB", "graph", "a", "row at 8KiB", "why", note="exact tune failed"))
    result.flips = [FlipRow("all_reduce", "6KiB", "eager", "a", "a", 0.0), FlipRow("all_reduce", "7KiB", "eager", "a",
                                                                                   "b", 0.004)]
    result.replay = [ReplayRow("all_reduce", "4KiB", "a", "a", 5.0, 8, 5.5, 1.1),
                     ReplayRow("all_reduce", "8KiB", "a", "c", 5.0, 8, 4.5, 0.9),
                     ReplayRow("all_reduce_rmsnorm", "h4096 t=1", "a", "a", 5.0, 8, note="no public call")]
    return result


def test_the_summary_per_mode_the_flip_rate_and_the_replay_ratios():
    data = summary(_result())
    eager, graph = data["regret"]["eager"], data["regret"]["graph"]
    assert (eager["n"], eager["median"], eager["max"], eager["sizes"]) == (3, 0.1, 0.3, 3)
    assert eager["p90"] == pytest.approx(0.26) and eager["top1"] == pytest.approx(1 / 3)
    assert (graph["n"], graph["sizes"], graph["not_measured"], graph["median"]) == (1, 2, 1, 0.05)
    assert data["flips"] == {"keys": 2, "flipped": 1, "rate": 0.5}
    replay = data["replay"]
    assert (replay["n"], replay["keys"], replay["as_tuned"], replay["median"], replay["min"], replay["max"]) == (
        2, 3, 2, 1.0, 0.9, 1.1)
    text = "\n".join(lines(_result()))
    assert "eager: 3 of 3 sizes measured; regret median +10.0%, p90 +26.0%, max +30.0%, top-1 33%" in text
    assert "winner flips: 2 keys tuned twice, 1 flipped (50%)" in text
    assert "2 of 3 graph rows replayed, 2 served as tuned; replay / row median 1.000, min 0.900, max 1.100" in text
    regret_table, flip_table, replay_table = tables(_result())
    assert [row[-2] for row in regret_table[2]] == ["+0.0%", "+10.0%", "+30.0%", "+5.0%", "-"]
    assert [row[3:5] for row in flip_table[2]] == [["a", "b"]]  # only the flipped key
    assert replay_table[2][1][2] == "c (row: a)" and replay_table[2][1][5] == "0.900"


def test_a_stand_in_run_reports_what_ran_and_no_time(tmp_path):
    result = _result(stand_in=True)
    text = "\n".join(lines(result)) + json.dumps(tables(result))
    assert "stand-in timings on gloo ranks (--cpu)" in text and "no time, ratio or regret is printed" in text
    for number in ("10.00", "11.00", "+10.0%", "0.900", "1.100", "50%"):
        assert number not in text
    assert tables(result)[1][2] == []  # the stand-in's winners flip for no reason worth listing
    data = summary(result)
    assert data["stand_in"] and data["regret"]["eager"]["median"] is None and data["flips"]["rate"] is None
    assert data["regret"]["eager"]["n"] == 3 and data["replay"]["keys"] == 3  # counts stay
    write_csv(result, str(tmp_path / "r.csv"))
    write_json(result, str(tmp_path / "r.json"))
    with open(tmp_path / "r.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 + 2 + 3 and {r["measure"] for r in rows} == {"regret", "flip", "replay"}
    assert all(r[c] == "" for r in rows for c in ("chosen_us", "best_us", "regret", "ratio", "replay_us"))
    assert json.loads((tmp_path / "r.json").read_text())["regret"]["graph"]["max"] is None
    assert csv_rows(_result())[1]["regret"] == 0.1 and csv_rows(_result())[0]["note"] == "why"


# ------------------------------------------------------------------------------ stand-ins (pure)


def test_stand_ins_offer_what_a_hopper_node_offers_and_run_the_fallback():
    from autosymm.backends import get_backend

    problem = Problem.all_reduce(6144, "bf16", 2)
    caps = stand_in_caps(2)
    real = get_backend("triton_one_shot_push")
    standing = StandInBackend(real)
    assert standing.why_not(problem, caps) is None and real.why_not(problem, caps) is None
    assert standing.why_not(problem, stand_in_caps(2).__class__(world_size=2)) == "no symmetric workspace"
    space = standing.search_space(problem)
    assert 1 <= len(space) <= STAND_IN_CONFIGS and set(space) <= set(real.search_space(problem))
    assert not standing.needs.compiles_kernels and real.needs.compiles_kernels  # nothing precompiled in threads
    pick = Candidate("triton_one_shot_push", space[0])
    assert stand_in_us(pick, problem, "eager") == stand_in_us(pick, problem, "eager") > 0
    assert abs(stand_in_us(pick, problem, "eager", "a") / stand_in_us(pick, problem, "eager", "b") - 1) <= 0.02
    big = Problem.all_reduce(64 << 20, "bf16", 2)
    assert stand_in_us(pick, big, "eager") > 10 * stand_in_us(pick, problem, "eager")  # bandwidth-bound


# ------------------------------------------------------------------------------ the worker (gloo)


def _regret_ranks(rank, world_size, options):
    from autosymm.db import store

    store.shipped_db_paths = lambda: []  # the database under test alone (AUTOSYMM_DB)
    return regret_module.regret_job(rank, world_size, options)


@pytest.fixture(scope="module")
def stand_in_result(db_path):
    options = RegretOptions(points={spec.TOKENS.sweep.flag: [2, 10]}, stand_in=True, rounds=2)
    out = run_gloo(_regret_ranks, 2, options, env={"all": {"AUTOSYMM_DB": str(db_path)}}, deadline_s=240.0)
    assert out[1] is None  # rank 0 reports
    return out[0]


def test_regret_is_measured_at_every_point_and_mode_against_the_exact_tune(stand_in_result, db_path):
    result = stand_in_result
    assert (result.hardware, result.world_size, result.stand_in, result.sources) == (HW, 2, True, [str(db_path)])
    assert [(r.op, r.label, r.mode) for r in result.regret] == [
        (op, label, mode) for op, label in (("all_reduce", "6KiB"), ("all_reduce", "6.146kB"), ("all_reduce", "12KiB"),
                                            ("all_reduce_rmsnorm", "h4096 t=2"), ("all_reduce_rmsnorm", "h4096 t=10"))
        for mode in ("eager", "graph")]
    for row in result.regret:
        assert row.note == "" and row.best, row
        assert row.source.startswith("row at ") and "between tuned" in row.reason  # from the neighbours' rows
        assert not row.chosen.startswith("nccl ")  # the database's tuned picks, eligible on the stand-in node
        assert row.regret == pytest.approx(row.chosen_us / min(row.chosen_us, row.best_us) - 1)
        assert (row.regret == 0.0) == (row.chosen_us <= row.best_us)  # the dispatcher's pick re-timed faster: 0
        if row.chosen == row.best:
            assert row.regret == 0.0 and row.chosen_us == row.best_us  # one pick: not re-timed
    assert any(row.regret > 0 for row in result.regret)  # the database's picks are not the stand-in's winners


def test_every_exact_tune_is_tuned_again_and_its_winner_compared(stand_in_result):
    flips = stand_in_result.flips
    assert [(f.op, f.label, f.mode) for f in flips] == [(r.op, r.label, r.mode) for r in stand_in_result.regret]
    assert all(f.first == r.best for f, r in zip(flips, stand_in_result.regret))
    for flip in flips:
        assert flip.gap is None or (flip.gap == 0.0) != flip.flipped and 0.0 <= flip.gap <= 0.05, flip


def test_every_graph_row_is_replayed_through_the_public_call(stand_in_result):
    replay = stand_in_result.replay
    assert [(r.op, r.label) for r in replay] == [("all_reduce", "4KiB"), ("all_reduce", "8KiB"),
                                                 ("all_reduce", "16KiB")] + [
        ("all_reduce_rmsnorm", f"h4096 t={t}") for t in FUSED_TOKENS]
    for row in replay:
        assert row.note == "" and row.as_tuned and row.calls == 8, row  # the dispatcher runs the row's winner
        assert row.ratio == pytest.approx(row.replay_us / row.row_us) and row.replay_us > 0


# ------------------------------------------------------------------------------ the CLI


@pytest.fixture
def handed(monkeypatch):
    """What `bench --regret` hands run_workers: (fn, nproc, options, cpu); answered by _result."""
    calls = []

    def fake(fn, nproc, options, cpu=False):
        calls.append((fn, nproc, options, cpu))
        return _result(stand_in=cpu)

    monkeypatch.setattr(workers, "run_workers", fake)
    return calls


def test_cpu_runs_the_plumbing_on_two_gloo_ranks_and_prints_no_time(runner, handed, tmp_path):
    csv_path, json_path = tmp_path / "regret.csv", tmp_path / "regret.json"
    result = runner.invoke(main, ["bench", "--regret", "--cpu", "--ops", "all_reduce", "--sizes", "5000,6146",
                                  "--modes", "graph", "--csv", str(csv_path), "--json-summary", str(json_path)],
                           terminal_width=250)
    assert result.exit_code == 0, result.output
    (fn, nproc, options, cpu), = handed
    assert fn is regret_module.regret_job and nproc == 2 and cpu and options.stand_in
    assert options.ops == ["all_reduce"] and options.modes == ("graph",) and options.limit == 2
    assert options.points == {spec.BYTES.sweep.flag: [5000, 6146]}
    assert "stand-in timings on gloo ranks (--cpu)" in result.output and "regret between tuned points" in result.output
    assert "10.00" not in result.output and "%" not in result.output.replace("(they would", "")
    assert json.loads(json_path.read_text())["stand_in"] and csv_path.read_text().startswith("measure,op,label")


def test_on_gpus_the_database_under_test_is_read_first(runner, handed, monkeypatch, db_path):
    import os

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = runner.invoke(main, ["bench", "--regret", "--db", str(db_path), "--limit", "4", "--rounds", "5",
                                  "--replay-calls", "16"], terminal_width=250)
    assert result.exit_code == 0, result.output
    (_, nproc, options, cpu), = handed
    assert nproc is None and not cpu and options.ops is None and options.points == {}
    assert (options.limit, options.rounds, options.calls, options.modes) == (4, 5, 16, ("eager", "graph"))
    assert os.environ["AUTOSYMM_DB"] == str(db_path)  # the workers' runtime reads it first
    assert "regret median +10.0%" in result.output and "+30.0%" in result.output


def test_without_gpus_regret_says_what_runs_here(runner, handed):
    result = runner.invoke(main, ["bench", "--regret"])
    assert result.exit_code == 1 and "needs CUDA GPUs" in result.output and "--cpu runs its plumbing" in result.output
    assert not handed


@pytest.mark.parametrize("args, message", [
    (["--cpu"], "--cpu only go(es) with --regret"),
    (["--rounds", "2", "--limit", "3"], "--rounds, --limit only go(es) with --regret"),
    (["--regret", "--plot", "x.png"], "--plot cannot be given with --regret"),
    (["--regret", "--shapes", "deepseek-v3"], "--shapes cannot be given with --regret"),
    (["--regret", "--ops", "all_reduce,nope"], "nope"),
    (["--regret", "--modes", "replay"], "replay"),
    (["--regret", "--cpu", "--tokens", "0"], "--tokens"),
])
def test_regret_usage_errors(runner, handed, args, message):
    result = runner.invoke(main, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
    assert not handed

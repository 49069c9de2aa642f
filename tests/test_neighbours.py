"""autosymm.runtime.neighbours: tuned points around a call and the modelled time of their rows there."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db.store import Row
from autosymm.runtime.neighbours import (candidates, floors_of, growth, modelled_us, moe_ratios, nearest_moe_point,
                                         points_around)
from autosymm.problem import MoEShape, Problem

HW = "nvidia-h200-nvlink"


def _row(bucket, us, config=None, backend=None, dtype="bf16", op="all_reduce", shape=""):
    backend = backend or ("nccl" if config is None else "triton_moe" if isinstance(config, MoEConfig)
                          else f"triton_{config.algorithm}")
    return Row(hardware=HW, world_size=2, op=op, dtype=dtype, bucket=bucket, backend=backend, median_us=us,
               shape=shape, mode="graph", config=config)


@given(st.integers(1, 1 << 30), st.sets(st.integers(1, 1 << 30), max_size=12))
def test_points_around_are_the_size_or_its_tuned_neighbours(size, tuned):
    tuned = sorted(tuned)
    points = points_around(size, tuned)
    assert set(points) <= set(tuned) and list(points) == sorted(points)
    if size in tuned:
        assert points == (size,)
    else:
        below, above = [t for t in tuned if t < size], [t for t in tuned if t > size]
        assert points == tuple(([max(below)] if below else []) + ([min(above)] if above else []))


def test_rounds_drive_a_triton_configs_growth():
    config = AllReduceConfig("one_shot_push", 16384, 132, 32)  # 4 MiB of bf16: 128 chunks, one round
    row = _row(4 << 20, 18.87, config)
    assert growth(row, Problem.all_reduce(4 << 20)) == 1.0
    assert growth(row, Problem.all_reduce(3_000_000)) == 1.0  # still one round: the 4 MiB time
    assert growth(row, Problem.all_reduce(1 << 20)) == 1.0
    assert growth(row, Problem.all_reduce(5 << 20)) == 2.0  # 160 chunks on 132 programs
    two_shot = AllReduceConfig("two_shot", 16384, 64, 32)  # per rank half: 64 chunks at 4 MiB
    assert growth(_row(4 << 20, 20.0, two_shot), Problem.all_reduce(4 << 20, world_size=2)) == 1.0
    assert growth(_row(4 << 20, 20.0, two_shot), Problem.all_reduce((4 << 20) + 2, world_size=2)) == 2.0


def test_a_larger_call_grows_at_least_with_its_bytes():
    config = AllReduceConfig("one_shot", 8192, 132, 32)
    row = _row(1 << 20, 9.0, config)  # 64 chunks: one round, and still one round at 1.5 MiB
    assert growth(row, Problem.all_reduce(3 << 19)) == 1.5
    assert growth(_row(1 << 20, 16.0), Problem.all_reduce(3 << 19)) == 1.5  # NCCL: the bytes
    assert growth(_row(1 << 20, 16.0), Problem.all_reduce(1 << 19)) == 0.5


def test_the_call_dtype_counts_its_own_elements():
    config = AllReduceConfig("one_shot", 1024, 1, 4)
    bf16_row = _row(8192, 5.0, config)  # 4096 bf16 elements: 4 rounds
    assert growth(bf16_row, Problem.all_reduce(8192, "fp32")) == 0.5  # 2048 fp32 elements: 2 rounds


def test_modelled_time_keeps_the_floor_and_scales_the_rest():
    row = _row(1 << 20, 16.0)
    assert modelled_us(row, Problem.all_reduce(1 << 20), 11.0) == 16.0
    assert modelled_us(row, Problem.all_reduce(2 << 20), 11.0) == pytest.approx(11.0 + 5.0 * 2)
    assert modelled_us(row, Problem.all_reduce(2 << 20), 20.0) == 16.0  # a floor above the row: all fixed


def test_floors_are_the_line_through_the_two_smallest_sizes_at_zero():
    rows = [_row(4096, 4.6, AllReduceConfig("one_shot_push", 2048, 1, 16)),
            _row(8192, 5.0, AllReduceConfig("one_shot_push", 1024, 4, 8)),
            _row(1 << 20, 8.92, AllReduceConfig("one_shot_push", 8192, 64, 16)),
            _row(4096, 11.0), _row(8192, 10.0), _row(1 << 20, 16.0),  # NCCL: noise at the small end
            _row(1 << 20, 9.0, AllReduceConfig("one_shot", 8192, 64, 16))]  # one size only
    floors = floors_of(rows)
    assert floors["triton_one_shot_push"] == pytest.approx(2 * 4.6 - 5.0)
    assert floors["nccl"] == pytest.approx(0.95 * 10.0) and floors["triton_one_shot"] == pytest.approx(0.95 * 9.0)
    one_round_more = AllReduceConfig("one_shot_push", 2048, 1, 16)  # the 4 KiB config makes 2 rounds at 6 KiB
    at_6k = modelled_us(rows[0], Problem.all_reduce(6144), floors["triton_one_shot_push"])
    assert at_6k == pytest.approx(4.2 + 0.4 * 2) and rows[0].config_obj == one_round_more
    flat = floors_of([_row(4096, 4.6, one_round_more), _row(8192, 4.75, one_round_more)])
    assert flat["triton_one_shot_push"] == pytest.approx(0.95 * 4.6)  # 4.45 at 0 bytes: above the bound


def test_candidates_interpolate_a_config_tuned_on_both_sides_and_rank_by_modelled_time():
    push = AllReduceConfig("one_shot_push", 16384, 132, 32)
    rows = [("a", _row(2 << 20, 28.0)), ("a", _row(4 << 20, 36.0)),
            ("a", _row(2 << 20, 12.0, push)), ("b", _row(4 << 20, 19.0, push))]
    problem = Problem.all_reduce(3 << 20)
    ranked = candidates(problem, rows, floors_of(row for _, row in rows))
    assert [(c.row.backend, c.interpolated) for c in ranked] == [("triton_one_shot_push", True), ("nccl", True)]
    assert ranked[0].modelled_us == pytest.approx(15.5) and ranked[0].source == "a"
    assert ranked[1].modelled_us == pytest.approx(32.0)


def test_ties_prefer_the_point_nearest_the_call():
    low, high = AllReduceConfig("one_shot", 1024, 1, 4), AllReduceConfig("one_shot", 2048, 1, 4)
    rows = [("x", _row(4096, 5.0, low)), ("x", _row(8192, 5.0, high))]
    ranked = candidates(Problem.all_reduce(4100), rows, {"triton_one_shot": 5.0})
    assert ranked[0].row.bucket == 4096 and ranked[0].modelled_us == ranked[1].modelled_us == 5.0


def test_nearest_moe_point_by_bytes_per_row_and_rows_per_rank():
    problem = Problem.moe("dp_to_ep", MoEShape(5120, 160, 6), 300)
    points = [("d7168_e256_k8", 256), ("d4096_e8_k2", 1024), ("d4096_e8_k2", 64)]
    assert nearest_moe_point(problem, points) == ("d4096_e8_k2", 1024)
    assert moe_ratios(problem, "d4096_e8_k2", 1024) == pytest.approx((1.25, 1800 / 2048))
    assert nearest_moe_point(problem, []) is None
    # a tie (same distance) goes to the smaller shape key, then tokens: the same on every rank
    tie = Problem.moe("dp_to_ep", MoEShape(4096, 8, 2), 100)
    assert nearest_moe_point(tie, [("d4096_e8_k2", 200), ("d4096_e8_k2", 50)]) == ("d4096_e8_k2", 50)


def test_moe_growth_is_the_bytes_moved():
    row = _row(1024, 30.0, MoEConfig(4096, 16, 4, 264), op="dp_to_ep", shape="d4096_e8_k2")
    problem = Problem.moe("dp_to_ep", MoEShape(5120, 160, 6), 300)
    assert growth(row, problem) == pytest.approx(1.25 * 1800 / 2048)

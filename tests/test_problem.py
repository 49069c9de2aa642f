"""autosymm.problem: buckets, size parsing and Problem validation (properties with hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autosymm.problem import (MODEL_SHAPES, MoEShape, Problem, format_bytes, next_pow2, parse_bytes, octave_points,
                              parse_range, parse_size_range)

_BIG = 1 << 50  # 1 PiB: beyond any all-reduce


def is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# ------------------------------------------------------------------------------ buckets


@given(st.integers(1, _BIG))
def test_next_pow2(n):
    p = next_pow2(n)
    assert is_pow2(p) and n <= p < 2 * n


@given(st.integers(0, 1 << 40), st.sampled_from(["bf16", "fp16", "fp32"]), st.integers(1, 8))
def test_problem_bucket_is_the_exact_size(nbytes, dtype, world_size):
    problem = Problem.all_reduce(nbytes, dtype, world_size)
    assert problem.bucket == max(1, nbytes) and problem.shape_key == ""


def test_sizes_between_powers_of_two_are_their_own_buckets():
    """A tune at 3 MB and one at 4 MiB are two rows, not one bucket's (autosymm.runtime.dispatch reads them)."""
    assert Problem.all_reduce(3_000_000).bucket == 3_000_000 and Problem.all_reduce(6146).bucket == 6146
    assert Problem.all_reduce(0).bucket == 1  # a database bucket is >= 1
    assert Problem.moe("dp_to_ep", MODEL_SHAPES["deepseek-v3"], 3000).bucket == 3000


@given(st.sampled_from(sorted(MODEL_SHAPES.values(), key=lambda s: s.key)), st.integers(1, 1 << 16),
       st.sampled_from(["dp_to_ep", "ep_to_dp"]))
def test_moe_problem_bucket_and_bytes(shape, n_tokens, op):
    problem = Problem.moe(op, shape, n_tokens, dtype="fp32", world_size=4)
    assert problem.bucket == n_tokens
    assert problem.shape_key == shape.key
    assert problem.nbytes == n_tokens * shape.d_model * 4


# ------------------------------------------------------------------------------ sizes as text

# SI units are decimal (issue 23: 'kb' and 'GB' used to read as 1024 and 2^30), IEC ones binary;
# 'K', 'M', 'G' alone are refused as ambiguous (tests/test_units.py).
_UNITS = [("", 1), ("B", 1), ("KiB", 1024), ("kb", 1000), ("MB", 10**6), ("MiB", 1 << 20),
          ("mib", 1 << 20), ("GiB", 1 << 30), ("GB", 10**9)]


@given(st.integers(0, 1 << 20), st.sampled_from(_UNITS), st.sampled_from(["", " "]))
def test_parse_bytes_units(count, unit, space):
    name, scale = unit
    assert parse_bytes(f" {count}{space}{name} ") == count * scale


def test_parse_bytes_examples():
    assert parse_bytes("16KiB") == 16384
    assert parse_bytes("1MiB") == 1048576
    assert parse_bytes("1.5MiB") == 1572864
    assert parse_bytes(4096) == 4096


@pytest.mark.parametrize("text", ["", "KiB", "abc", "12XB", "1.2.3", "4 KiB B", "nan"])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["-4KiB", "-1", "1e999"])
def test_parse_bytes_rejects_negative_and_infinite(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.mark.parametrize("nbytes, text", [(0, "0B"), (1023, "1023B"), (4096, "4KiB"), (1572864, "1.5MiB"),
                                          (1 << 30, "1GiB"), (3 << 40, "3072GiB")])
def test_format_bytes_examples(nbytes, text):
    assert format_bytes(nbytes) == text


@given(st.integers(1, 1023), st.sampled_from([1, 1024, 1 << 20, 1 << 30]))
def test_format_bytes_round_trips_whole_units(count, scale):
    assert parse_bytes(format_bytes(count * scale)) == count * scale


@given(st.integers(0, 1 << 45))
def test_format_bytes_is_close(nbytes):
    assert abs(parse_bytes(format_bytes(nbytes)) - nbytes) <= nbytes * 1e-5 + 1  # 6 significant digits


@given(st.integers(1, 1 << 40), st.integers(1, 1 << 40))
def test_parse_size_range_is_the_powers_of_two_between(a, b):
    low, high = sorted((a, b))
    sizes = parse_size_range(f"{low}:{high}")
    assert all(is_pow2(s) and low <= s <= high for s in sizes)
    assert all(later == 2 * earlier for earlier, later in zip(sizes, sizes[1:]))
    if sizes:
        assert sizes[0] == next_pow2(low) and sizes[-1] * 2 > high
    else:
        assert next_pow2(low) > high


@given(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=6))
def test_parse_size_list_keeps_order(sizes):
    assert parse_size_range(",".join(map(str, sizes))) == sizes


@given(st.integers(1, 1 << 40), st.integers(1, 1 << 40), st.sampled_from([1, 2, 4, 8]))
def test_octave_points_refine_the_powers_of_two(a, b, per_octave):
    low, high = sorted((a, b))
    points = octave_points(low, high, per_octave)
    assert points == sorted(set(points)) and all(low <= p <= high for p in points)
    assert set(octave_points(low, high, 1)) <= set(points)  # the powers of two stay
    for p in points:  # each point is p2 * (1 + j / N), rounded down, for its octave's power of two p2
        base = next_pow2(p + 1) // 2
        assert (p - base) * per_octave % base == 0


def test_parse_size_range_examples():
    assert parse_size_range("4KiB:64KiB") == [4096, 8192, 16384, 32768, 65536]
    assert parse_size_range("4KiB:32KiB:2") == [4096, 6144, 8192, 12288, 16384, 24576, 32768]
    assert parse_size_range("4KiB:8KiB:4") == [4096, 5120, 6144, 7168, 8192]
    assert len(parse_size_range("4KiB:256MiB:2")) == 33
    assert parse_size_range("1MiB,4MiB") == [1 << 20, 4 << 20]
    assert parse_size_range("6146,3000000") == [6146, 3_000_000]
    assert parse_range("1:8192:2") == (1, 8192, 2) and parse_range("4KiB:1MiB", parse_bytes) == (4096, 1 << 20, 1)
    with pytest.raises(ValueError, match="points per octave"):
        parse_size_range("4KiB:64KiB:3")
    for bad in ("64KiB:4KiB", "0:4KiB", "4KiB:zz", "1:2:3:4", "4KiB:8KiB:x"):
        with pytest.raises(ValueError):
            parse_size_range(bad)


@pytest.mark.parametrize("text", ["-1,2", "", ","])
def test_parse_size_range_rejects_negative_or_empty(text):
    with pytest.raises(ValueError):
        parse_size_range(text)


# ------------------------------------------------------------------------------ validation


@given(st.integers(1, 1 << 16), st.integers(1, 512).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, e))))
def test_moe_shape_key_round_trip(d_model, experts):
    shape = MoEShape(d_model, *experts)
    assert MoEShape.from_key(shape.key) == shape


@pytest.mark.parametrize("args", [(0, 8, 2), (4096, 0, 1), (4096, 8, 0), (4096, 8, 9)])
def test_moe_shape_validation(args):
    with pytest.raises(ValueError):
        MoEShape(*args)


@pytest.mark.parametrize("key", ["", "d1_e2", "d1_e2_k1_x5", "d01_e2_k1"])
def test_moe_shape_from_bad_key(key):
    with pytest.raises(ValueError):
        MoEShape.from_key(key)


@pytest.mark.parametrize("kwargs, message", [
    (dict(op="broadcast", dtype="bf16", world_size=2), "op='broadcast'"),
    (dict(op="all_reduce", dtype="int9", world_size=2), "dtype='int9'"),
    (dict(op="all_reduce", dtype="bf16", world_size=0), "world_size=0"),
    (dict(op="all_reduce", dtype="bf16", world_size=2.0), "world_size=2.0"),
    (dict(op="all_reduce", dtype="bf16", world_size=2, nbytes=-1), "nbytes=-1"),
    (dict(op="dp_to_ep", dtype="bf16", world_size=2, n_tokens_local=4), "MoEShape"),
    (dict(op="ep_to_dp", dtype="bf16", world_size=2, shape=MoEShape(64, 8, 2)), "n_tokens_local"),
])
def test_problem_validation_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Problem(**kwargs)


def test_problem_helpers():
    problem = Problem.all_reduce(3 * 4096, "fp16", 8)
    assert problem.elem_bytes == 2 and problem.numel == 6144
    assert "all_reduce fp16 ws=8 12KiB" == problem.describe()
    moe = Problem.moe("dp_to_ep", MODEL_SHAPES["deepseek-v3"], 100)
    assert "d7168_e256_k8" in moe.describe() and "tokens/rank=100" in moe.describe()


def test_a_moe_problem_with_an_unknown_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="dtype='int8'"):
        Problem.moe("dp_to_ep", MoEShape(64, 8, 2), 4, "int8")


def test_any_world_size_is_a_problem_that_only_nccl_serves_beyond_the_kernels():
    from autosymm.backends import Capabilities, get_backend
    from autosymm.runtime.dispatch import decide

    problem = Problem.all_reduce(1 << 20, "bf16", 16)  # two 8-GPU nodes
    caps = Capabilities.of(16, region_bytes=(1 << 30, 1 << 30))
    assert "world size 16 > 8" in get_backend("triton_one_shot").why_not(problem, caps, "eager")
    assert decide(problem, "eager", caps, [], "nvidia-h200-nvlink").backend == "nccl"
    moe = Problem.moe("dp_to_ep", MoEShape(1024, 64, 4), 16, "bf16", 16)
    assert get_backend("triton_moe").why_not(moe, caps, "eager") is not None
    assert decide(moe, "eager", caps, [], "nvidia-h200-nvlink").backend == "nccl_all_to_all"

"""Every all-reduce kernel compiles for Hopper (sm_90) on the CPU, and its PTX has what matters.

triton.compile(ASTSource, GPUTarget("cuda", 90, 32)) runs in subprocesses without
TRITON_INTERPRET (under the interpreter ``@triton.jit`` yields functions that cannot be
compiled), two at a time; each returns the PTX features the tests check.
"""

from __future__ import annotations

import re

import pytest
from _sm90 import compile_in_subprocesses, compile_ptx, ptx_features

# (kernel, dtype, world_size, block, warps, zero_copy, aligned, x_aligned[, double_buffer[, tail]])
CASES = [
    ("one_shot", "bf16", 2, 1024, 4, False, True, True),
    ("one_shot", "fp16", 4, 4096, 8, False, True, True),
    ("one_shot", "fp32", 8, 16384, 32, False, True, True),
    ("one_shot", "bf16", 8, 2048, 4, True, True, True),
    ("one_shot", "fp16", 2, 1024, 4, True, False, False),
    ("one_shot", "bf16", 4, 8192, 16, False, True, False),
    ("two_shot", "bf16", 8, 4096, 8, False, True, True),
    ("two_shot", "fp16", 2, 1024, 4, False, True, True),
    ("two_shot", "fp32", 4, 8192, 16, True, True, True),
    ("multimem", "bf16", 8, 4096, 8, False, True, True),
    ("multimem", "fp16", 4, 2048, 4, False, True, True),
    ("multimem", "fp32", 2, 16384, 32, True, True, True),
    # double-buffered one-shot: twins of CASES[0], [2] and [5] with DOUBLE_BUFFER=True
    ("one_shot", "bf16", 2, 1024, 4, False, True, True, True),
    ("one_shot", "fp32", 8, 16384, 32, False, True, True, True),
    ("one_shot", "bf16", 4, 8192, 16, False, True, False, True),
    # push one-shot (no zero-copy variant: x is only read locally), single and double buffered
    ("one_shot_push", "bf16", 2, 4096, 8, False, True, True),
    ("one_shot_push", "fp16", 4, 1024, 4, False, True, False),
    ("one_shot_push", "fp32", 8, 16384, 32, False, True, True),
    ("one_shot_push", "bf16", 2, 4096, 8, False, True, True, True),
    ("one_shot_push", "fp32", 8, 16384, 32, False, True, True, True),
]
DOUBLE_TWINS = {12: 0, 13: 2, 14: 5, 18: 15, 19: 17}  # double-buffered case -> its single-buffer twin
# TAIL (numel a multiple of 16 bytes' worth of elements): twins of CASES[0], [15], [17], [18]
CASES += [
    ("one_shot", "bf16", 2, 1024, 4, False, True, True, False, 8),
    ("one_shot_push", "bf16", 2, 4096, 8, False, True, True, False, 8),
    ("one_shot_push", "fp32", 8, 16384, 32, False, True, True, False, 4),
    ("one_shot_push", "bf16", 2, 4096, 8, False, True, True, True, 8),
]
TAIL_TWINS = {20: 0, 21: 15, 22: 17, 23: 18}  # TAIL case -> its TAIL=1 twin


def _case(i):
    """CASES[i] with the double_buffer flag filled in."""
    case = CASES[i]
    return (*case, False, 1)[:10] if len(case) == 8 else (*case, 1)[:10]

VEC_TYPE = {"bf16": "acc::f32.v4.bf16x2", "fp16": "acc::f32.v4.f16x2", "fp32": "v4.f32"}


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] for sm_90, return {i: features}."""

    from autosymm.kernels.all_reduce import _one_shot_all_reduce, _two_shot_all_reduce
    from autosymm.kernels.push_all_reduce import _push_one_shot_all_reduce

    out = {}
    for i in indices:
        kernel, dtype, world_size, block, warps, zero_copy, aligned, x_aligned, double_buffer, tail = _case(i)
        signature = {"x_ptr": f"*{dtype}", "region_ptrs": "*i64", "signal_ptrs": "*i64", "numel": "i32",
                     "stage_offset": "i64"}
        constexprs = dict(RANK=world_size - 1, WORLD_SIZE=world_size, BLOCK=block, ZERO_COPY=zero_copy,
                          ALIGNED=aligned)
        fn = _one_shot_all_reduce
        if kernel == "one_shot":
            signature.update(half_bytes="i64")
            constexprs.update(DOUBLE_BUFFER=double_buffer, TAIL=tail)
        elif kernel == "one_shot_push":
            fn = _push_one_shot_all_reduce
            signature.update(slot_bytes="i64", half_bytes="i64")
            del constexprs["ZERO_COPY"]
            constexprs.update(DOUBLE_BUFFER=double_buffer, TAIL=tail)
        else:
            fn = _two_shot_all_reduce
            signature.update(seg_vecs="i32", mc_base="i64")
            constexprs.update(MULTIMEM=kernel == "multimem", PHASE=0)
        ptx = compile_ptx(fn, signature, constexprs, (0, 1, 2) if x_aligned else (1, 2), warps)
        out[i] = ptx_features(ptx)
        out[i]["count_ins"] = len(re.findall(r"(?:red|atom)\.global\.gpu\.release\.add", ptx))
    return out


@pytest.fixture(scope="module")
def features():
    return compile_in_subprocesses("test_compile_all_reduce", len(CASES))


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c[:5])) + ("-zc" if c[5] else "")
                                                         + ("-db" if _case(i)[8] else "")
                                                         + (f"-tail{_case(i)[9]}" if _case(i)[9] > 1 else "")
                                                         for i, c in enumerate(CASES)])
def test_compiles_for_sm90(features, case):
    kernel, dtype, world_size, block, warps, zero_copy, aligned, x_aligned, double_buffer, _ = _case(case)
    got = features[case]
    # all kernels here signal twice in the code (ZERO_COPY one-shot: once per round), except the
    # double-buffered ones: no end barrier, and the staged two-shots: a third, end barrier after
    # the copy-out (a peer's next push one-shot writes our stage before any barrier of its own).
    # The push one-shot waits in two places (in its pipelined loop and after it) for its one
    # per-chunk signal. A signal is ONE vector release over every peer's slot (one fence), a
    # wait ONE vector acquire poll of every peer's slot (first, on the slow path's first re-poll,
    # in its bounded loop).
    n_barriers = 1 if double_buffer else 3 if kernel in ("two_shot", "multimem") and not zero_copy else 2
    n_waits = n_barriers + (kernel == "one_shot_push")
    assert got["signals"] == n_barriers, "one vector release signal per barrier"
    assert got["acquire_polls"] == 3 * n_waits, got
    # bounded waits: each wait's loop compares against MAX_POLLS and can count a give-up; so can
    # the double buffer's wait for its grid (the epoch's publish)
    assert got["poll_limit"] and got["error_adds"] == n_waits + double_buffer, got
    # the double buffer's epoch: one early gpu-scope release count; no acq_rel arrival and no
    # exchange (nothing at the kernel's end); nothing else has them
    assert got["count_ins"] == double_buffer, got
    assert (got["arrivals"], got["counter_resets"]) == (0, 0), got
    if kernel == "multimem":
        assert got["ld_reduce"] and set(got["ld_reduce"]) == {VEC_TYPE[dtype]}
        assert got["multimem_st"] >= 1
        assert got["proxy_fences"] == 4
    else:
        assert not got["ld_reduce"] and got["proxy_fences"] == 0
    if aligned and kernel != "multimem":
        # full chunks: a 128-bit load from every rank's stage (scalar ones only in the tail path)
        assert got["peer_v4_loads"] >= world_size
    if not aligned:
        assert got["peer_v4_loads"] == 0, "an unaligned stage must not be read with 128-bit loads"
    if x_aligned and not (kernel == "multimem" and zero_copy):  # that one only stores via multimem
        assert got["v4_stores"] >= 1
    if kernel == "one_shot_push" and x_aligned:
        assert got["v4_stores"] >= world_size, "128-bit pushes into every peer's slot, and the sum's store"


@pytest.mark.parametrize("double, single", sorted(DOUBLE_TWINS.items()))
def test_double_buffer_drops_one_cross_gpu_wait(features, double, single):
    """The double-buffered kernel is its single-buffer twin minus the end barrier: one release
    signal, one bounded wait (its acquire polls and its give-up add) fewer; plus the epoch's wait
    for its own grid (a give-up add, gpu scope)."""
    with_db, without = features[double], features[single]
    assert without["signals"] - with_db["signals"] == 1
    assert without["error_adds"] - (with_db["error_adds"] - 1) == 1
    assert without["acquire_polls"] - with_db["acquire_polls"] == 3  # first poll, slow re-poll, the loop's
    for key in ("peer_v4_loads", "v4_stores", "peer_scalar_loads"):
        assert with_db[key] == without[key], key  # the data path is unchanged


@pytest.mark.parametrize("tail_case, twin", sorted(TAIL_TWINS.items()))
def test_a_ragged_chunk_keeps_16_byte_accesses_when_numel_is_whole_vectors(features, tail_case, twin):
    """Masked tail chunk: with TAIL the masks are uniform over 16 bytes, so no peer load and no
    store is scalar (each would be one NVLink transaction per element); without, they are."""
    tail, plain = features[tail_case], features[twin]
    assert plain["peer_scalar_loads"] + plain["scalar_stores"] > 0
    assert tail["peer_scalar_loads"] == 0 and tail["scalar_stores"] == 0, tail
    assert tail["peer_v4_loads"] + tail["v4_stores"] > plain["peer_v4_loads"] + plain["v4_stores"]

"""The reduce-scatter kernel compiles for Hopper (sm_90) on the CPU, and its PTX has what matters:
two barriers with bounded waits, 128-bit loads from peers' (padded) stages, kept in a
segment's ragged last chunk. Compiled in subprocesses without TRITON_INTERPRET (tests/_sm90.py).
"""

from __future__ import annotations

import pytest
from _sm90 import compile_in_subprocesses, compile_ptx, ptx_features

# (dtype, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even)
CASES = [
    ("bf16", 2, 1024, 4, False, True, True, True, True),
    ("fp16", 3, 4096, 8, False, True, True, True, False),
    ("fp32", 8, 16384, 32, False, True, True, True, True),
    ("bf16", 4, 2048, 4, False, True, False, False, True),  # ragged segments: only the stage is aligned
    ("bf16", 8, 8192, 16, True, True, True, True, True),
    ("fp16", 2, 1024, 4, True, False, False, True, False),  # zero-copy with ragged segments: nothing aligned
    ("fp32", 5, 4096, 8, True, True, True, True, False),
]
#: the push kernel (no zero-copy variant): (dtype, world_size, block, warps, seg_aligned, x_aligned, even)
PUSH_CASES = [
    ("bf16", 2, 1024, 4, True, True, True),
    ("fp16", 3, 4096, 8, False, True, False),
    ("fp32", 8, 16384, 32, True, True, False),
    ("bf16", 4, 2048, 4, True, False, True),
]


ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] (then PUSH_CASES) for sm_90, return {i: features}."""
    from autosymm.kernels.reduce_scatter import _reduce_scatter, _reduce_scatter_push

    out = {}
    for i in indices:
        push = i >= len(CASES)
        if push:
            dtype, world_size, block, warps, seg_aligned, x_aligned, even = PUSH_CASES[i - len(CASES)]
        else:
            dtype, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even = CASES[i]
        signature = {"out_ptr": f"*{dtype}", "in_ptr": f"*{dtype}", "region_ptrs": "*i64", "signal_ptrs": "*i64",
                     "bounds_ptr": "*i32", "rank": "i32", "seg": "i32", "stage_seg": "i32", "stage_offset": "i64"}
        constexprs = dict(WORLD_SIZE=world_size, BLOCK=block, ALIGNED=True, SEG_ALIGNED=seg_aligned, EVEN=even)
        if push:
            signature = {("slot" if k == "stage_seg" else k): v for k, v in signature.items()}
        else:
            constexprs.update(ZERO_COPY=zero_copy, ALIGNED=aligned)
        fn = _reduce_scatter_push if push else _reduce_scatter
        ptx = compile_ptx(fn, signature, constexprs, (0, 1, 2, 3, 4) if x_aligned else (2, 3, 4), warps)
        out[i] = ptx_features(ptx)
    return out


@pytest.fixture(scope="module")
def features():
    return compile_in_subprocesses("test_compile_reduce_scatter", len(CASES) + len(PUSH_CASES))


def _id(case):
    dtype, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even = case
    return (f"{dtype}-ws{world_size}-b{block}-w{warps}" + ("-zc" if zero_copy else "") + ("-al" if aligned else "")
            + ("-seg" if seg_aligned else "") + ("-even" if even else "-table"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_compiles_for_sm90(features, case):
    dtype, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even = CASES[case]
    got = features[case]
    # The rank is a run-time argument: a barrier's signal and wait are vector operations over the
    # rank indices, this rank's own masked off at run time: one signal (one fence) and one bounded
    # wait (its first poll, its slow path's first re-poll, its loop) per barrier.
    assert got["signals"] == 2, "two barriers (start, end), one vector release signal each"
    assert got["acquire_polls"] == 2 * 3
    assert got["poll_limit"] and got["error_adds"] == 2, got  # bounded waits
    assert not got["ld_reduce"] and got["proxy_fences"] == 0 and got["arrivals"] == 0
    # Every rank's stage (this rank's own included: no branch on the run-time rank) is read with
    # .cg loads, in a full chunk and in the whole vectors of the last one (masks uniform over 16
    # bytes keep them 128-bit): 2 * world_size loads per 16 bytes a thread holds; the staged
    # copy-in adds as many when the input's segments are aligned.
    vecs = block * ELEM_BYTES[dtype] // (warps * 32 * 16)
    if aligned:
        copy_in = 0 if zero_copy or not (seg_aligned and x_aligned) else 2 * world_size
        assert got["peer_v4_loads"] == (2 * world_size + copy_in) * vecs, got
    else:
        assert got["peer_v4_loads"] == 0, "an unaligned stage must not be read with 128-bit loads"
    if x_aligned and (aligned or not zero_copy):
        assert got["v4_stores"] >= 2 * vecs, "the sum's stores (full and last chunk) are 128-bit"
    if aligned and (zero_copy or seg_aligned and x_aligned):
        # the ragged tail (< 16 bytes) is the only scalar path: one load per rank and segment
        assert got["peer_scalar_loads"] <= 2 * world_size, got


@pytest.mark.parametrize("case", range(len(PUSH_CASES)),
                         ids=[f"{c[0]}-ws{c[1]}-b{c[2]}-w{c[3]}" + ("-seg" if c[4] else "") + ("-x" if c[5] else "")
                              + ("-even" if c[6] else "-table") for c in PUSH_CASES])
def test_push_compiles_for_sm90(features, case):
    """Two barriers; 128-bit stores into every rank's slot (the stage is aligned) and 128-bit
    local loads of the slots, full chunks and a last chunk's whole vectors alike."""
    dtype, world_size, block, warps, seg_aligned, x_aligned, even = PUSH_CASES[case]
    got = features[len(CASES) + case]
    assert got["signals"] == 2 and got["error_adds"] == 2 and got["poll_limit"], got
    vecs = block * ELEM_BYTES[dtype] // (warps * 32 * 16)
    assert got["peer_v4_loads"] >= 2 * world_size * vecs, "the slots' sum reads 128 bits at a time"
    if seg_aligned and x_aligned:
        # pushes of every segment (full and last chunk) into a slot, plus the sum's stores
        assert got["v4_stores"] == (2 * world_size + 2) * vecs, got
        assert got["peer_scalar_loads"] <= 2 * world_size, "scalar loads in the < 16-byte tails only"
    else:
        assert got["v4_stores"] >= 2 * world_size * vecs, "the remote pushes stay 128-bit (aligned slots)"

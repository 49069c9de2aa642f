"""The all-gather kernels (push, pull) compile for Hopper (sm_90) on the CPU, and their PTX has
what matters: two barriers with bounded waits, 128-bit copies (remote ones whenever the stage is
aligned, whatever the shard sizes), kept in a shard's ragged last chunk, bytes only in the < 16
byte tail. Compiled in subprocesses without TRITON_INTERPRET (tests/_sm90.py).
"""

from __future__ import annotations

import re

import pytest
from _sm90 import compile_in_subprocesses, compile_ptx, ptx_features

# (kernel, world_size, block bytes, warps, zero_copy, aligned, seg_aligned, x_aligned, even)
CASES = [
    ("pull", 2, 2048, 4, False, True, True, True, True),
    ("pull", 3, 8192, 8, False, True, False, True, False),  # ragged shards: the stage stays aligned
    ("pull", 8, 65536, 32, True, True, True, True, True),
    ("pull", 4, 2048, 4, False, False, False, False, False),  # nothing aligned: bytes
    ("push", 2, 2048, 4, False, True, True, True, True),
    ("push", 5, 16384, 16, False, True, False, True, False),
    ("push", 8, 32768, 32, True, True, True, True, True),
    ("push", 4, 4096, 8, True, False, False, True, False),
]


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] for sm_90, return {i: features}."""
    from autosymm.kernels.all_gather import _all_gather_pull, _all_gather_push

    out = {}
    for i in indices:
        kernel, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even = CASES[i]
        signature = {"out_ptr": "*u8", "in_ptr": "*u8", "region_ptrs": "*i64", "signal_ptrs": "*i64",
                     "bounds_ptr": "*i32", "rank": "i32", "seg": "i32", "stage_seg": "i32", "stage_offset": "i64"}
        constexprs = dict(WORLD_SIZE=world_size, BLOCK=block, ZERO_COPY=zero_copy, ALIGNED=aligned,
                          SEG_ALIGNED=seg_aligned, EVEN=even)
        fn = _all_gather_push if kernel == "push" else _all_gather_pull
        ptx = compile_ptx(fn, signature, constexprs, (0, 1, 2, 3, 4) if x_aligned else (2, 3, 4), warps)
        out[i] = {**ptx_features(ptx), "local_v4_loads": len(re.findall(r"ld\.global\.v4\.b32", ptx)),
                  "byte_loads": len(re.findall(r"ld\.global(?:\.cg)?\.(?:b8|u8) ", ptx)),
                  "byte_stores": len(re.findall(r"st\.global\.(?:b8|u8) ", ptx))}
    return out


@pytest.fixture(scope="module")
def features():
    return compile_in_subprocesses("test_compile_all_gather", len(CASES))


def _id(case):
    kernel, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even = case
    return (f"{kernel}-ws{world_size}-b{block}-w{warps}" + ("-zc" if zero_copy else "") + ("-al" if aligned else "")
            + ("-seg" if seg_aligned else "") + ("-even" if even else "-table"))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_id(c) for c in CASES])
def test_compiles_for_sm90(features, case):
    kernel, world_size, block, warps, zero_copy, aligned, seg_aligned, x_aligned, even = CASES[case]
    got = features[case]
    # The rank is a run-time argument: a barrier's signal and wait are vector operations over the
    # rank indices, this rank's own masked off at run time. Two barriers in every variant, each
    # one vector signal and one bounded wait (first poll, slow path's first re-poll, loop).
    assert got["signals"] == 2
    assert got["acquire_polls"] == 2 * 3
    assert got["poll_limit"] and got["error_adds"] == 2, got
    assert not got["ld_reduce"] and got["proxy_fences"] == 0 and got["arrivals"] == 0
    vecs = block // (warps * 32 * 16)  # 16-byte vectors a thread moves per chunk
    staged = 0 if zero_copy else 1
    peers = world_size - 1
    # Remote accesses: a full chunk and the whole vectors of the last one, per peer; 128-bit
    # whenever the stage is aligned (padded stage starts), whatever the shards' sizes.
    if aligned:
        remote = got["peer_v4_loads"] if kernel == "pull" else got["v4_stores"]
        assert remote >= 2 * peers * vecs, got
    if aligned and seg_aligned and x_aligned:
        if kernel == "pull":  # copy-in, then the own shard and every peer's
            assert got["peer_v4_loads"] == (2 * world_size + 2 * staged) * vecs, got
            assert got["v4_stores"] == (2 * world_size + 2 * staged) * vecs, got
        else:  # the pushes (own output + every peer), then the copy-out
            assert got["local_v4_loads"] == 2 * vecs, got
            assert got["v4_stores"] == (2 * world_size + 2 * peers * staged) * vecs, got
            assert got["peer_v4_loads"] == 2 * peers * staged * vecs, got
        # bytes only in the < 16-byte tails: one access per shard copy
        assert got["byte_loads"] <= world_size + 1 and got["byte_stores"] <= world_size + 1, got
    if not (aligned or x_aligned):
        assert got["peer_v4_loads"] + got["local_v4_loads"] + got["v4_stores"] == 0, "nothing aligned: bytes"

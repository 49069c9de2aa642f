"""The fused all-reduce + RMSNorm kernels compile for Hopper (sm_90) on the CPU, with 128-bit
peer loads and stores, their barriers, bounded waits and (double buffer) epoch arrivals.

Compiled in subprocesses without TRITON_INTERPRET (tests/_sm90.py)."""

from __future__ import annotations

import pytest

from _sm90 import compile_in_subprocesses, compile_ptx, ptx_features

# (kernel, dtype, world_size, hidden, block, warps, rows, double_buffer, x/residual/weight/out 16-byte
# aligned, row split): rows equal to BLOCK and shorter (masked columns), every world size, each
# variant, split rows (parts wholly and partly past HIDDEN: 5120 of 8192 in 8 parts of 1024).
CASES = [
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, False, True, 1),
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, True, True, 1),
    ("one_shot", "fp16", 4, 5120, 8192, 8, 2, False, True, 1),
    ("one_shot_push", "bf16", 2, 4096, 4096, 4, 1, False, True, 1),
    ("one_shot_push", "bf16", 8, 7168, 8192, 32, 4, True, True, 1),
    ("two_shot", "bf16", 2, 8192, 8192, 16, 2, False, True, 1),
    ("two_shot", "fp32", 4, 4104, 8192, 16, 1, False, False, 1),
    ("one_shot_push", "bf16", 2, 8192, 8192, 4, 1, True, True, 8),
    ("one_shot", "fp16", 4, 5120, 8192, 4, 1, False, True, 8),
    ("one_shot_push", "bf16", 8, 7168, 8192, 8, 1, False, False, 2),
]


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] for sm_90, return {i: features}."""

    from autosymm.kernels.fused_rmsnorm import _one_shot_all_reduce_rmsnorm, _two_shot_all_reduce_rmsnorm

    out = {}
    for i in indices:
        kernel, dtype, world_size, hidden, block, warps, rows, double, aligned, split = CASES[i]
        signature = {"x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                     "region_ptrs": "*i64", "signal_ptrs": "*i64", "n_rows": "i32", "eps": "fp32",
                     "stage_offset": "i64"}
        constexprs = dict(RANK=world_size - 1, WORLD_SIZE=world_size, HIDDEN=hidden, BLOCK=block, ROWS=rows)
        if kernel == "two_shot":
            fn = _two_shot_all_reduce_rmsnorm
            signature.update(out_offset="i64")
            constexprs.update(PHASE=0)
        else:
            fn = _one_shot_all_reduce_rmsnorm
            signature.update(counts_ptr="*i32", partials_ptr="*fp32", stash_ptr="*fp32", slot_bytes="i64",
                             half_bytes="i64")
            constexprs.update(SPLIT=split, PUSH=kernel == "one_shot_push", DOUBLE_BUFFER=double)
        scratch = (6, 7, 8) if kernel != "two_shot" else ()  # the workspace's: always aligned
        aligned_args = ((0, 1, 2, 3, 4, 5) if aligned else (4, 5)) + scratch
        out[i] = ptx_features(compile_ptx(fn, signature, constexprs, aligned_args, warps))
    return out


@pytest.fixture(scope="module")
def features():
    return compile_in_subprocesses("test_compile_fused_rmsnorm", len(CASES))


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c[:7])) + ("-db" if c[7] else "")
                                                         + (f"-split{c[9]}" if c[9] > 1 else "") for c in CASES])
def test_compiles_for_sm90(features, case):
    kernel, dtype, world_size, hidden, block, warps, rows, double, aligned, split = CASES[case]
    got = features[case]
    peers = world_size - 1
    n_barriers = {"two_shot": 3}.get(kernel, 1 if double else 2)
    assert got["signals"] == n_barriers * peers, "one release signal per peer per barrier"
    assert got["poll_limit"] and got["error_adds"] == n_barriers * peers, "every wait is bounded"
    # the epoch's arrival and reset (double buffer), a row's arrival and reset (split rows)
    assert (got["arrivals"], got["counter_resets"]) == ((double + (split > 1),) * 2)
    assert not got["ld_reduce"] and got["proxy_fences"] == 0
    if kernel != "one_shot_push":  # stages are aligned whatever the tensors are
        assert got["peer_v4_loads"] >= world_size, "128-bit loads from every rank's stage"
    if aligned:
        assert got["v4_stores"] >= 1

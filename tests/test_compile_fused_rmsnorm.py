"""The fused all-reduce + RMSNorm kernels compile for Hopper (sm_90) on the CPU, with 128-bit
peer loads and stores, their barriers (one vector signal and one vector poll per barrier), bounded
waits, (double buffer) the epoch's early release count and the last program's acquire polls, (the
Lamport variant) no barrier at all but volatile 128-bit polls; and
their epilogue variants (no residual, Gemma, fp8, fp8 per token, nvfp4) with the e4m3 ``cvt``,
IEEE divisions and (nvfp4) the nibble packing.

Compiled in subprocesses without TRITON_INTERPRET (tests/_sm90.py)."""

from __future__ import annotations

import re

import pytest

from _sm90 import compile_in_subprocesses, compile_ptx, ptx_features

# (kernel, dtype, world_size, hidden, block, warps, rows, double_buffer, x/residual/weight/out 16-byte
# aligned, row split, epilogue key): rows equal to BLOCK and shorter (masked columns), every world
# size, each variant, split rows (parts wholly and partly past HIDDEN: 5120 of 8192 in 8 parts of
# 1024); then each epilogue on the one-shots, the two-shot and split rows (case 10 is case 0
# without the residual).
CASES = [
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, False, True, 1, ""),
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, True, True, 1, ""),
    ("one_shot", "fp16", 4, 5120, 8192, 8, 2, False, True, 1, ""),
    ("one_shot_push", "bf16", 2, 4096, 4096, 4, 1, False, True, 1, ""),
    ("one_shot_push", "bf16", 8, 7168, 8192, 32, 4, True, True, 1, ""),
    ("two_shot", "bf16", 2, 8192, 8192, 16, 2, False, True, 1, ""),
    ("two_shot", "fp32", 4, 4104, 8192, 16, 1, False, False, 1, ""),
    ("one_shot_push", "bf16", 2, 8192, 8192, 4, 1, True, True, 8, ""),
    ("one_shot", "fp16", 4, 5120, 8192, 4, 1, False, True, 8, ""),
    ("one_shot_push", "bf16", 8, 7168, 8192, 8, 1, False, False, 2, ""),
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, False, True, 1, "rms"),
    ("one_shot_push", "bf16", 4, 4096, 4096, 4, 1, False, True, 1, "add_gemma"),
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, False, True, 1, "add_rms_fp8"),
    ("two_shot", "fp16", 4, 8192, 8192, 16, 1, False, True, 1, "add_rms_fp8_per_token"),
    ("one_shot", "bf16", 2, 8192, 8192, 4, 1, True, True, 8, "rms_fp8_per_token"),
    ("one_shot", "bf16", 2, 8192, 8192, 16, 1, False, True, 1, "add_rms_nvfp4"),
    ("two_shot", "bf16", 8, 7168, 8192, 16, 1, False, True, 1, "gemma_nvfp4"),
    ("one_shot_push", "fp16", 4, 5120, 8192, 4, 1, True, True, 8, "add_rms_nvfp4"),
    # the Lamport exchange: whole rows (18, 19), split rows (20), an epilogue with its quantization (21)
    ("lamport", "bf16", 2, 8192, 8192, 16, 1, False, True, 1, ""),
    ("lamport", "bf16", 8, 4096, 4096, 8, 2, False, True, 1, ""),
    ("lamport", "bf16", 4, 8192, 8192, 4, 1, False, True, 4, ""),
    ("lamport", "fp16", 2, 8192, 8192, 16, 1, False, True, 1, "add_rms_fp8"),
    # the Lamport wait's per-thread spin (world size 2, SPINS): whole rows, split rows, a hidden
    # shorter than BLOCK (masked columns), fp32 words
    ("lamport", "bf16", 2, 8192, 8192, 16, 1, False, True, 1, ""),
    ("lamport", "bf16", 2, 8192, 8192, 4, 1, False, True, 4, ""),
    ("lamport", "fp16", 2, 4096, 4096, 8, 2, False, True, 1, "add_rms_fp8"),
    ("lamport", "fp32", 2, 5120, 8192, 4, 1, False, False, 8, ""),
    # one rank (a one-GPU group): no peer to wait for
    ("lamport", "bf16", 1, 4096, 4096, 8, 1, False, True, 1, ""),
]
#: The SPIN constexpr of the cases that spin (autosymm.kernels.lamport_all_reduce.spin_pack of a
#: thread's elements), by case index.
SPINS = {22: 8, 23: 8, 24: 8, 25: 4}
#: Pointer types of the out / scales arguments by quant (the launcher passes out for unused ones).
OUT_TYPES = {None: (None, None), "fp8": ("*fp8e4nv", "*fp8e4nv"), "fp8_per_token": ("*fp8e4nv", "*fp32"),
             "nvfp4": ("*u8", "*fp8e4nv")}


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] for sm_90, return {i: features}."""

    from autosymm.epilogue import Epilogue
    from autosymm.kernels.fused_rmsnorm import _one_shot_all_reduce_rmsnorm, _two_shot_all_reduce_rmsnorm

    out = {}
    for i in indices:
        kernel, dtype, world_size, hidden, block, warps, rows, double, aligned, split, key = CASES[i]
        epilogue = Epilogue.of_key(key)
        out_type, scales_type = OUT_TYPES[epilogue.quant]
        signature = {"x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "w_ptr": f"*{dtype}",
                     "out_ptr": out_type or f"*{dtype}", "scale_ptr": "*fp32",
                     "scales_ptr": scales_type or out_type or f"*{dtype}", "region_ptrs": "*i64",
                     "signal_ptrs": "*i64", "n_rows": "i32", "eps": "fp32", "stage_offset": "i64"}
        constexprs = dict(RANK=world_size - 1, WORLD_SIZE=world_size, HIDDEN=hidden, BLOCK=block, ROWS=rows)
        if kernel == "two_shot":
            fn = _two_shot_all_reduce_rmsnorm
            signature.update(out_offset="i64")
            constexprs.update(PHASE=0)
        else:
            fn = _one_shot_all_reduce_rmsnorm
            signature.update(counts_ptr="*i32", partials_ptr="*fp32", stash_ptr="*fp32", header_ptr="*i32",
                             slot_bytes="i64", half_bytes="i64")
            constexprs.update(SPLIT=split, PUSH=kernel != "one_shot", DOUBLE_BUFFER=double, LAMPORT=kernel == "lamport",
                              SPIN=SPINS.get(i, 0))
        constexprs.update(HAS_RESIDUAL=epilogue.residual, GEMMA=epilogue.gemma, QUANT=epilogue.quant_code)
        # the signature's order is the kernel's: its pointers are 0..5, region and signal 6, 7, the
        # scratch and the Lamport header 8..11
        signature = {name: signature[name] for name in fn.arg_names if name in signature}
        scratch = (8, 9, 10, 11) if kernel != "two_shot" else ()  # the workspace's: always aligned
        aligned_args = ((0, 1, 2, 3, 4, 5, 6, 7) if aligned else (6, 7)) + scratch
        ptx = compile_ptx(fn, signature, constexprs, aligned_args, warps)
        out[i] = ptx_features(ptx)
        out[i].update(count_ins=len(re.findall(r"(?:red|atom)\.global\.gpu\.release\.add", ptx)),
                      volatile_v4=len(re.findall(r"ld\.volatile\.global\.v4\.b32", ptx)),
                      spin_loops=len(re.findall(r"^LW_POLL:", ptx, re.M)))
    return out


@pytest.fixture(scope="module")
def features():
    return compile_in_subprocesses("test_compile_fused_rmsnorm", len(CASES))


def _case_id(i: int) -> str:
    c, spin = CASES[i], SPINS.get(i, 0)
    return "-".join(map(str, c[:7])) + ("-db" if c[7] else "") + (f"-split{c[9]}" if c[9] > 1 else "") + \
        (f"-{c[10]}" if c[10] else "") + (f"-spin{spin}" if spin else "")


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(i) for i in range(len(CASES))])
def test_compiles_for_sm90(features, case):
    kernel, dtype, world_size, hidden, block, warps, rows, double, aligned, split, key = CASES[case]
    got = features[case]
    n_barriers = {"two_shot": 3, "lamport": 0}.get(kernel, 1 if double else 2)
    # one vector release signal (every peer's slot, one fence) per barrier
    assert got["signals"] == n_barriers, "one vector release signal per barrier"
    # every wait is bounded: a give-up add per barrier; per Lamport poll site (one per row path)
    # and the rotation's or the epoch's wait for the grid (publish)
    rotation = kernel == "lamport" or double
    # the spin: a give-up add per instance (SPIN words of a thread's tile each), none per CTA
    instances = rows * block // split // (warps * 32) // SPINS[case] if case in SPINS else 0
    assert got["spin_loops"] == instances, got
    waits = instances or (kernel == "lamport")
    assert got["poll_limit"] and got["error_adds"] == n_barriers + waits + rotation, got
    # the rotation or the epoch: one early gpu-scope release count (no acq_rel arrival, no exchange
    # at the end); a split row's arrival and reset
    assert got["count_ins"] == rotation, got
    assert (got["arrivals"], got["counter_resets"]) == ((int(split > 1),) * 2), got
    assert not got["ld_reduce"] and got["proxy_fences"] == 0
    if kernel == "lamport":  # no barrier: the words are their own flags, polled 16 bytes at a time
        assert got["acquire_polls"] == 0 and (got["volatile_v4"] >= 1) == (world_size > 1), got  # one rank: no peer
    elif kernel != "one_shot_push":  # stages are aligned whatever the tensors are
        assert got["peer_v4_loads"] >= world_size, "128-bit loads from every rank's stage"
    if aligned:
        assert got["v4_stores"] >= 1


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[10]],
                         ids=[_case_id(i) for i, c in enumerate(CASES) if c[10]])
def test_epilogue_variants_compile_their_quantization(features, case):
    from autosymm.epilogue import Epilogue

    _, _, _, _, block, warps, *_ = CASES[case]
    quant, got = Epilogue.of_key(CASES[case][10]).quant, features[case]
    if quant is None:
        assert got["e4m3_cvts"] == 0 and got["div_rn"] == 0
        return
    assert got["e4m3_cvts"] >= 1, "fp32 -> e4m3 through cvt.rn.satfinite"
    # fp8: 1 / scale; per token: amax / 448 and y / scale_row; nvfp4: 1 / gs, 1 / (sf / gs)
    assert got["div_rn"] >= {"fp8": 1, "fp8_per_token": 2, "nvfp4": 2}[quant], "IEEE divisions, as torch's"
    if quant == "nvfp4":
        assert got["nibble_shifts"] >= 1 and got["byte_permutes"] >= 1, "two e2m1 codes packed a byte"
        if block // (warps * 32) == 16:  # a thread holds one block of 16 (more: its scales are stored together)
            assert got["byte_stores"] >= 1, "a block's scale stored as one byte"


def test_no_residual_drops_its_loads_and_stores(features):
    """Case 10 is case 0 without the residual: fewer 128-bit stores (no residual written back),
    the same 128-bit peer loads."""
    assert CASES[10][:10] == CASES[0][:10]
    assert features[10]["v4_stores"] < features[0]["v4_stores"]
    assert features[10]["peer_v4_loads"] == features[0]["peer_v4_loads"]

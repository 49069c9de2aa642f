"""The MoE split-planning kernel (autosymm.kernels.moe_splits) compiles for Hopper (sm_90) on the
CPU, every pass, both ops, world sizes 1-8, every index dtype; no program waits for another (no
atomics, no polls), so the passes need no co-residency."""

from __future__ import annotations

import re

import pytest
from _sm90 import compile_in_subprocesses

# (op, world_size, k, expt_indx type, gate/topk type, pass)
CASES = [
    ("dp_to_ep", 2, 8, "i32", "i32", 2), ("dp_to_ep", 8, 6, "i64", "i64", 0), ("dp_to_ep", 3, 4, "i16", "i32", 1),
    ("ep_to_dp", 2, 8, "i32", "i32", 2), ("ep_to_dp", 8, 8, "i32", "i64", 1), ("ep_to_dp", 5, 2, "i16", "i16", 0),
    ("dp_to_ep", 1, 1, "i32", "i32", 2),
]


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] for sm_90 as nccl_all_to_all.DeviceSplits launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from autosymm.backends.nccl_all_to_all import SPLIT_BLOCK, SPLIT_GRID, SPLIT_WARPS
    from autosymm.kernels.moe_splits import _moe_splits
    from autosymm.problem import next_pow2

    out = {}
    for i in indices:
        op, world_size, k, expt_type, indx_type, step = CASES[i]
        constexprs = dict(RANK=world_size - 1, WORLD_SIZE=world_size, N_EXPTS_ACT=k, DP_TO_EP=op == "dp_to_ep",
                          KEYS=next_pow2(world_size), BLOCK=SPLIT_BLOCK, GRID=1 if step == 2 else SPLIT_GRID,
                          PASS=step)
        types = {"expt_indx_ptr": f"*{expt_type}", "indx_ptr": f"*{indx_type}", "owner_ptr": "*i32",
                 "block_counts_ptr": "*i32", "send_rows_ptr": "*i64", "recv_rows_ptr": "*i64", "counts_ptr": "*i32",
                 "n_pairs_local": "i32", "n_expts_tot": "i32", "chunk": "i32"}
        signature = {name: types.get(name, "constexpr") for name in _moe_splits.arg_names}
        attrs = {(j,): [["tt.divisibility", 16]] for j, name in enumerate(_moe_splits.arg_names)
                 if types.get(name, "").startswith("*")}
        compiled = triton.compile(ASTSource(_moe_splits, signature, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": SPLIT_WARPS})
        ptx = compiled.asm["ptx"]
        out[i] = {"target": re.findall(r"\.target\s+(\w+)", ptx), "cubin_bytes": len(compiled.asm.get("cubin", b"")),
                  "atomics": sorted(set(re.findall(r"\b(?:atom|red)\.\S+", ptx))),
                  "stores": sorted(set(re.findall(r"\bst\.global(?:\.[a-z0-9]+)*", ptx)))}
    return out


@pytest.fixture(scope="module")
def compiled():
    return compile_in_subprocesses("test_compile_moe_splits", len(CASES))


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_compiles_for_sm90_without_cross_program_waits(compiled, case):
    facts = compiled[case]
    assert facts["target"] in (["sm_90"], ["sm_90a"]) and facts["cubin_bytes"] > 0, facts
    assert not facts["atomics"], facts
    assert facts["stores"], facts  # pass 0 its chunk's counts; passes 1, 2 the rows and split sizes

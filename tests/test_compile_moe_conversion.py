"""The MoE conversion kernels compile for Hopper (sm_90) on the CPU, with 128-bit accesses.

Under TRITON_INTERPRET=1 (the CPU suite) every @triton.jit function, triton's own standard
library included, is an interpreted function and cannot be compiled; so the compile servers of
``_sm90`` (the interpreter off) compile every case and report what the PTX holds.
"""

from __future__ import annotations

import re

import pytest
from _sm90 import compile_in_subprocesses

# dtype, top-k, world size, d_model, block_n, rows, warps, fused barrier, expt_indx type
SPREAD = [
    ("bf16", 8, 8, 7168, 1024, 1, 4, True, "i32"),
    ("bf16", 6, 3, 200, 256, 3, 2, False, "i16"),
    ("fp16", 1, 1, 2880, 4096, 4, 16, True, "i64"),
    ("fp32", 4, 4, 2048, 512, 2, 4, False, "i32"),
    ("fp32", 2, 5, 77, 256, 1, 8, True, "i32"),
    ("bf16", 32, 8, 4096, 2048, 64, 8, True, "i32"),
]
ALIGNED = [("bf16", 8, 8, 7168, 1024, 2, 4, True, "i32"), ("fp16", 8, 8, 200, 1024, 2, 4, True, "i32"),
           ("fp32", 8, 8, 2880, 1024, 2, 4, True, "i32")]
ODD = [("bf16", 2, 2, 7167, 256, 1, 1, False, "i32")]
OPS = ("dp_to_ep", "ep_to_dp")
CASES = [(op, case) for op in OPS for case in SPREAD + ALIGNED + ODD]  # and, at index len(CASES), the barrier


def _case_id(op, case) -> str:
    return op + "-" + "-".join(map(str, case))


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a compile server: compile CASES[i] (i == len(CASES): the barrier kernel) for
    sm_90; {i: PTX facts}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from autosymm.backends.triton_moe import _vec
    from autosymm.kernels.moe_conversion import _convert_dp_to_ep, _convert_ep_to_dp

    kernels = {"dp_to_ep": _convert_dp_to_ep, "ep_to_dp": _convert_ep_to_dp}
    out = {}
    for i in indices:
        if i == len(CASES):
            out[i] = _barrier_facts()
            continue
        op, (dtype, k, world_size, d_model, block_n, rows, warps, fused, index_type) = CASES[i]
        fn = kernels[op]
        types = {"dst_ptrs": "*i64", "expt_owner_ptr": "*i32", "signal_ptrs": "*i64", "gate_indx_ptr": "*i32",
                 "topk_indx_ptr": "*i32", "n_tokens_local": "i32", "n_expts_tot": "i32", "d_vecs": "i32",
                 "src_ptr": f"*{dtype}", "expt_indx_ptr": f"*{index_type}"}
        vec = _vec(d_model, {"bf16": 2, "fp16": 2, "fp32": 4}[dtype])
        constexprs = dict(N_EXPTS_ACT=k, RANK=world_size - 1, WORLD_SIZE=world_size, VEC=vec, BLOCK_N=block_n,
                          ROWS=rows, ROWS_PAD=triton.next_power_of_2(rows), FUSED_BARRIER=fused)
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        # What a launch with torch-allocated (16-byte aligned) tensors specialises on.
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if types.get(name, "").startswith("*")}
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps})
        ptx = kernel.asm["ptx"]
        out[i] = {
            "target": re.findall(r"\.target\s+(\w+)", ptx),
            "global": sorted(set(re.findall(r"\b(?:ld|st)\.global(?:\.[a-z0-9]+)*", ptx))),
            "atomics": sorted(set(re.findall(r"\b(?:atom|red)\.global(?:\.[a-z0-9_]+)*", ptx))),
            "cubin_bytes": len(kernel.asm.get("cubin", b"")),
            **_wait_facts(ptx),
        }
    return out


def _barrier_facts() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from autosymm.kernels.barrier import _barrier_kernel

    kernel = triton.compile(ASTSource(_barrier_kernel, {"signal_ptrs": "*i64", "RANK": "constexpr",
                                                        "WORLD_SIZE": "constexpr"}, dict(RANK=1, WORLD_SIZE=2)),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    return {"atomics": sorted(set(re.findall(r"\b(?:atom|red)\.global(?:\.[a-z0-9_]+)*", kernel.asm["ptx"]))),
            "cubin_bytes": len(kernel.asm.get("cubin", b"")), **_wait_facts(kernel.asm["ptx"])}


def _wait_facts(ptx: str) -> dict:
    """The bounded wait of autosymm.kernels.barrier: acquire polls, the poll-limit compare, the
    relaxed add on the error slot (and its fail-fast read)."""
    from autosymm.kernels.barrier import MAX_POLLS

    limit = int(MAX_POLLS.value)
    return {
        "acquire_polls": len(re.findall(r"ld\.global\.sys\.acquire|atom\.global\.sys\.acquire", ptx)),
        "poll_limit": bool(re.search(rf"setp\.\w+\.[us]32\s+%p\d+, %r\d+, (?:{limit}|{limit - 1});", ptx)),
        "error_adds": len(re.findall(r"(?:red|atom)\.global\.gpu\.relaxed\.add", ptx)),
    }


@pytest.fixture(scope="module")
def compiled():
    """{case id or "_barrier_kernel": PTX facts}."""
    facts = compile_in_subprocesses("test_compile_moe_conversion", len(CASES) + 1)
    return {(_case_id(*CASES[i]) if i < len(CASES) else "_barrier_kernel"): f for i, f in facts.items()}


@pytest.mark.parametrize("case", SPREAD, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("op", OPS)
def test_compiles_for_sm90(compiled, op, case):
    facts = compiled[_case_id(op, case)]
    assert facts["target"] in (["sm_90"], ["sm_90a"]) and facts["cubin_bytes"] > 0
    world_size, fused = case[2], case[7]
    atomics = set(facts["atomics"])
    if fused and world_size > 1:
        # arrival counter acq_rel.sys, peer signals release.sys (autosymm.kernels.moe_conversion docstring)
        assert "atom.global.sys.acq_rel.add.u32" in atomics, atomics
        assert {"red.global.sys.release.add.u32", "atom.global.sys.release.add.u32"} & atomics, atomics
        # the bounded wait: acquire polls, a loop bounded by MAX_POLLS, one error-slot add
        assert facts["acquire_polls"] >= 1 and facts["poll_limit"], facts
        assert facts["error_adds"] == 1, facts  # one vector wait over every peer
    else:
        assert not atomics, atomics  # the end barrier is a separate kernel (or none at world size 1)


@pytest.mark.parametrize("case", ALIGNED, ids=lambda c: f"{c[0]}-d{c[3]}")
@pytest.mark.parametrize("op", OPS)
def test_aligned_rows_use_128_bit_accesses(compiled, op, case):
    accesses = set(compiled[_case_id(op, case)]["global"])
    assert "ld.global.v4.b32" in accesses and "st.global.v4.b32" in accesses, accesses
    # Every store is a 16-byte row store: no narrower data store is left.
    assert {a for a in accesses if a.startswith("st.global")} == {"st.global.v4.b32"}, accesses


@pytest.mark.parametrize("op", OPS)
def test_odd_d_model_compiles_with_element_accesses(compiled, op):
    accesses = set(compiled[_case_id(op, ODD[0])]["global"])
    assert "st.global.b16" in accesses and "st.global.v4.b32" not in accesses, accesses


def test_barrier_kernel_compiles_with_a_bounded_wait(compiled):
    facts = compiled["_barrier_kernel"]
    assert facts["cubin_bytes"] > 0
    assert "red.global.sys.release.add.u32" in facts["atomics"] or "atom.global.sys.release.add.u32" in facts["atomics"]
    assert facts["acquire_polls"] >= 1 and facts["poll_limit"] and facts["error_adds"] == 1, facts

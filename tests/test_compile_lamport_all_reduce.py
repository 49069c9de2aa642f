"""The Lamport one-shot compiles for Hopper (sm_90) on the CPU, and its PTX has what matters:
volatile polls (16-byte where aligned), every peer polled in one pass, no barrier (no system-scope
signal, poll or fence), bounded waits counted in the error slot, the rotation as one gpu-scope
release count and the last program's acquire polls and plain stores (no acq_rel arrival, no
exchange: nothing at the kernel's end), and 16-byte stores (pushes, re-arm, sum) wherever the
element count is whole 16-byte vectors. With SPIN (world size 2): the per-thread spin's inline PTX
assembles (ptxas makes a cubin) for every dtype and pack size, re-polls single words, counts a
give-up per instance, and leaves no CTA reduction on the wait (the fast path's barriers are the
rotation's alone).
"""

from __future__ import annotations

import re

import pytest
from _sm90 import compile_in_subprocesses, compile_ptx, ptx_features

# (dtype, world_size, block, warps, x_aligned, tail, spin): SPIN is spin_pack's for the tile
CASES = [
    ("bf16", 2, 1024, 4, True, 8, 0),
    ("fp16", 4, 2048, 4, True, 8, 0),
    ("fp32", 8, 4096, 8, True, 4, 0),
    ("bf16", 3, 1024, 4, True, 1, 0),
    ("fp32", 8, 4096, 8, False, 4, 0),
    # the per-thread spin (world size 2): every pack size of 16- and 32-bit words, ragged and unaligned
    ("bf16", 2, 1024, 4, True, 8, 8),
    ("fp16", 2, 4096, 16, True, 8, 8),
    ("bf16", 2, 1024, 8, True, 8, 4),
    ("fp16", 2, 256, 4, True, 1, 2),
    ("bf16", 2, 1024, 32, True, 8, 1),
    ("fp32", 2, 1024, 4, True, 4, 4),
    ("fp32", 2, 256, 4, False, 4, 2),
    ("fp32", 2, 1024, 32, True, 1, 1),
    ("bf16", 1, 1024, 4, True, 8, 0),  # one rank (a one-GPU group): no peer to wait for
]
#: Elements a thread holds (BLOCK / threads) by case, and whether they make a 16-byte vector.
ELEMS = [c[2] // (32 * c[3]) for c in CASES]
WIDE = [e * (4 if c[0] == "fp32" else 2) >= 16 for e, c in zip(ELEMS, CASES)]


def _compile_cases(indices: list[int]) -> dict:
    """Runs in a subprocess: compile CASES[i] for sm_90, return {i: features}."""
    from autosymm.kernels.lamport_all_reduce import _lamport_all_reduce

    out = {}
    for i in indices:
        dtype, world_size, block, warps, x_aligned, tail, spin = CASES[i]
        signature = {"x_ptr": f"*{dtype}", "region_ptrs": "*i64", "signal_ptrs": "*i64", "header_ptr": "*i32",
                     "numel": "i32", "slot_bytes": "i64"}
        constexprs = dict(RANK=world_size - 1, WORLD_SIZE=world_size, BLOCK=block, TAIL=tail, PHASE=0, SPIN=spin)
        ptx = compile_ptx(_lamport_all_reduce, signature, constexprs, (0, 1, 2, 3) if x_aligned else (1, 2, 3), warps)
        features = ptx_features(ptx)
        features.update(
            volatile_v4=len(re.findall(r"ld\.volatile\.global\.v4\.b32", ptx)),
            volatile_scalar=len(re.findall(r"ld\.volatile\.global\.(?:b16|b32) ", ptx)),
            first_polls=len(re.findall(r"^\s*(?:@%p\d+ )?ld\.volatile\.global", ptx, re.M)),
            fences=len(re.findall(r"\bfence\.|\bmembar\.", ptx)),
            count_ins=len(re.findall(r"(?:red|atom)\.global\.gpu\.release\.add", ptx)),
            publish_polls=len(re.findall(r"(?:ld|atom)\.global\.gpu\.acquire", ptx)),
            spin_loops=len(re.findall(r"^LW_POLL:", ptx, re.M)),
            spin_reloads=len(re.findall(r"@%lw_q ld\.volatile\.global\.u(?:16|32) ", ptx)),
            spin_give_ups=len(re.findall(r"@%lw_m red\.global\.gpu\.relaxed\.add\.u32", ptx)),
            cta_barriers=len(re.findall(r"\bbar\.sync\b", ptx)),
        )
        out[i] = features
    return out


@pytest.fixture(scope="module")
def features():
    return compile_in_subprocesses("test_compile_lamport_all_reduce", len(CASES))


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_compiles_for_sm90(features, case):
    dtype, world_size, block, warps, x_aligned, tail, spin = CASES[case]
    got = features[case]
    # the spin's instances: per chunk path (full, ragged), one per SPIN words a thread holds
    instances = 2 * ELEMS[case] // spin if spin else 0
    assert (got["spin_loops"], got["spin_reloads"], got["spin_give_ups"]) == (instances, instances * spin, instances)
    peers = world_size - 1
    # no barrier anywhere: the data is its own arrival mark
    assert got["signals"] == 0 and got["acquire_polls"] == 0 and got["fences"] == 0, got
    # every peer's slot is polled with volatile loads, first, on the slow path's first re-poll and
    # in the bounded loop, in the full and the ragged chunk's path; 16 bytes each where the count
    # is whole vectors
    assert got["first_polls"] >= 2 * peers, got
    if WIDE[case]:
        assert got["volatile_v4"] >= 2 * peers, got
    if tail > 1 and WIDE[case]:
        assert got["volatile_scalar"] == 0, got
    # bounded: compared against MAX_POLLS; a give-up is one relaxed add per wait site (the full
    # and the ragged chunk's pass over every peer, or each spin instance, and the rotation's wait
    # for the grid)
    assert got["poll_limit"] and got["error_adds"] == 1 + (instances or 2), got
    # the rotation: one gpu-scope release count, the last program's acquire polls, plain stores;
    # no acq_rel arrival or exchange left at the kernel's end
    assert got["count_ins"] == 1 and got["publish_polls"] >= 1, got
    assert (got["arrivals"], got["counter_resets"]) == (0, 0), got
    # 16-byte pushes into every peer's slot, re-arm of every slot, the sum's store
    if WIDE[case]:
        assert got["v4_stores"] >= 2 * peers + 1, got
    if tail > 1 and WIDE[case]:
        assert got["scalar_stores"] == 0, got


def test_the_spin_leaves_no_cta_reduction_on_the_wait(features):
    """SPIN's wait has no CTA barrier: the case with SPIN has only the rotation's barriers, the
    same case without it (case 0) a reduction per chunk path on top."""
    spin = CASES.index(("bf16", 2, 1024, 4, True, 8, 8))
    assert CASES[0][:6] == CASES[spin][:6]
    assert features[spin]["cta_barriers"] < features[0]["cta_barriers"], (features[spin], features[0])


def test_a_ragged_count_costs_scalar_polls(features):
    """The TAIL=1 case (any element count) polls its ragged chunk per element; the TAIL cases
    never do (the host passes TAIL whenever numel is whole 16-byte vectors)."""
    ragged = [i for i, c in enumerate(CASES) if c[5] == 1]
    assert ragged and all(features[i]["volatile_scalar"] > 0 for i in ragged)

"""Helpers of the MoE tests: run every simulated rank's conversion in one process (interpreter).

The conversion kernels only write to peers, so the ranks can run one after another; their end
barrier waits are pre-satisfied: each rank's slot [program][peer] gets one signal before the
run. Afterwards every such slot must hold exactly that one signal again (its own wait consumed
the preset, the peer's real signal arrived) and the arrival counter [program][rank] must be 0:
that checks that every rank signalled every peer exactly once and reset its counter.
"""

from __future__ import annotations

import torch

from autosymm.backends.triton_moe import launch
from autosymm.geometry import MOE_SIGNAL_SLOT, SIGNAL_CHANNEL, SIGNAL_SLOTS_PER_RANK, dst_rows, moe_buffer

SLOTS_PER_PROGRAM = 8


def _slots(ws, op: str) -> torch.Tensor:
    """int32 view of this rank's 8 slots of ``op``'s end-barrier program in 'moe_end'."""
    start = SIGNAL_CHANNEL["moe_end"] * SIGNAL_SLOTS_PER_RANK + MOE_SIGNAL_SLOT[op] * SLOTS_PER_PROGRAM
    return ws.buffer[: 4 * (start + SLOTS_PER_PROGRAM)].view(torch.int32)[start:]


def presatisfy(workspaces, op: str) -> None:
    for ws in workspaces:
        slots = _slots(ws, op)
        for peer in range(ws.world_size):
            if peer != ws.rank:
                slots[peer] += 1


def check_and_clear(workspaces, op: str) -> None:
    for ws in workspaces:
        slots = _slots(ws, op)
        expected = [int(p != ws.rank and ws.world_size > 1) for p in range(SLOTS_PER_PROGRAM)]
        expected[ws.world_size:] = [0] * (SLOTS_PER_PROGRAM - ws.world_size)
        assert slots.tolist() == expected, f"rank {ws.rank} {op} signal slots {slots.tolist()} != {expected}"
        slots.zero_()


def dst_views(workspaces, op: str, n_tokens_local: int, k: int, d_model: int, dtype) -> list[torch.Tensor]:
    rows = dst_rows(op, n_tokens_local, k, len(workspaces))
    offset = moe_buffer(op, workspaces[0].capacity("moe"), len(workspaces))[0]
    return [ws.local_view("moe", (rows, d_model), dtype, offset) for ws in workspaces]


def poison(tensors, seed: int = 1) -> list[torch.Tensor]:
    """Fill every tensor with random bytes (NaNs included); return copies of what they hold."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return [t.clone() for t in tensors]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (so NaN poison compares exactly)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got, want, what: str = "") -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        same = bits(g) == bits(w)
        if not bool(same.all()):
            rows = torch.nonzero(~same.all(dim=1)).flatten().tolist()
            raise AssertionError(f"{what} rank {rank}: {len(rows)} rows differ, first {rows[:8]}")


def run_all_ranks(op, workspaces, config, srcs, assignment, expt_indx, indx, *, fused_barrier=None):
    """Launch ``op`` on every simulated rank with pre-satisfied barriers; check the pads after."""
    presatisfy(workspaces, op)
    for ws, src in zip(workspaces, srcs):
        launch(op, ws, config, src, assignment.expt_owner, expt_indx, indx, fused_barrier=fused_barrier)
    check_and_clear(workspaces, op)

"""autosymm.geometry: the one place for alignment, slots, stage sizes and workspace regions."""

import pytest

from autosymm import geometry as g
from autosymm.workspace.symm import simulated_workspaces


def test_regions_are_reserved_by_name_in_order_on_aligned_offsets():
    layout = g.workspace_layout(1000, 3000, 5000)
    names = list(layout.regions)
    assert names == [g.SIGNAL_REGION, g.ALL_REDUCE_REGION, g.MOE_REGION, g.DOUBLE_BUFFER_REGION, g.FUSED_STASH_REGION,
                     g.LAMPORT_REGION]
    end = 0
    for region in layout.regions.values():
        assert region.offset == end and region.offset % g.ALIGN == 0 and region.nbytes % g.ALIGN == 0
        end = region.offset + region.nbytes
    assert layout.total_bytes == end
    assert layout.regions[g.DOUBLE_BUFFER_REGION].nbytes == 2 * g.align(5000)
    assert layout.regions[g.FUSED_STASH_REGION].nbytes == g.FUSED_STASH_BYTES
    assert layout.regions[g.LAMPORT_REGION].nbytes == g.LAMPORT_BYTES
    assert list(g.workspace_layout(1000, 3000).regions)[-3:] == [g.MOE_REGION, g.FUSED_STASH_REGION, g.LAMPORT_REGION]
    with pytest.raises(ValueError, match="reserved already"):
        layout.reserve(g.MOE_REGION, 1)


def test_the_workspace_uses_the_layout():
    ws = simulated_workspaces(2, all_reduce_bytes=4096, moe_bytes=8192, double_buffer_bytes=1024)[0]
    assert ws.regions == g.workspace_layout(4096, 8192, 1024).regions
    assert ws.buffer.numel() == ws.layout.total_bytes


@pytest.mark.parametrize("nbytes", [1, 255, 256, 257, 4096, 3 * 1024**2 + 2])
@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_stage_sizes(nbytes, world_size):
    assert g.push_slot_bytes(nbytes) % g.ALIGN == 0 and 0 <= g.push_slot_bytes(nbytes) - nbytes < g.ALIGN
    assert g.push_stage_bytes(nbytes, world_size) == (world_size - 1) * g.push_slot_bytes(nbytes)
    assert g.tensor_stage_bytes(nbytes, world_size) == nbytes
    assert g.rows_and_out_stage_bytes(nbytes, world_size) == 2 * g.align(nbytes) >= 2 * nbytes
    capacity = 1 << 24
    assert g.stage_offset(capacity, nbytes) % g.ALIGN == 0 and g.stage_offset(capacity, nbytes) + nbytes <= capacity
    largest = g.max_push_input_bytes(capacity, world_size)
    assert g.push_stage_bytes(largest, world_size) <= capacity
    assert g.push_stage_bytes(largest + 1, world_size) > capacity


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_moe_region_holds_both_buffers(world_size):
    n_tokens, k, row_bytes = 1000, 8, 7168 * 2
    region = g.moe_region_bytes(n_tokens, k, row_bytes, world_size)
    for op in ("dp_to_ep", "ep_to_dp"):
        offset, nbytes = g.moe_buffer(op, region, world_size)
        assert offset % g.ALIGN == 0 and offset + nbytes <= region
        assert g.dst_rows(op, n_tokens, k, world_size) * row_bytes <= nbytes
    ep_offset, ep_bytes = g.moe_buffer("ep_to_dp", region, world_size)
    assert ep_offset + ep_bytes <= g.moe_buffer("dp_to_ep", region, world_size)[0], "disjoint"

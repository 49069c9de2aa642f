"""Configs, segments and stage sizes of the reduce-scatter and all-gather kernels
(autosymm.backends.rs_ag_layout): pure arithmetic, checked against hand-worked layouts."""

import pytest

from autosymm.backends.rs_ag_layout import even_counts, push_slot_units, segments, stage_bytes, stage_units
from autosymm.configs import AllGatherConfig, ReduceScatterConfig


def test_equal_segments_pad_the_stage_to_16_bytes():
    layout = segments([5, 5, 5], vec=8, padded=True)  # bf16: 8 elements make 16 bytes
    assert layout.starts == (0, 5, 10, 15) and layout.counts == (5, 5, 5) and layout.total == 15
    assert layout.stage_starts == (0, 8, 16)
    assert (layout.even, layout.seg, layout.stage_seg, layout.seg_aligned) == (True, 5, 8, False)
    assert stage_units(layout, own_shard_only=False) == 21  # the last segment needs no padding
    assert layout.table() == [0, 5, 10, 15, 0, 8, 16]


def test_zero_copy_segments_are_the_user_tensor_itself():
    layout = segments([3, 0, 9], vec=4, padded=False)
    assert layout.stage_starts == (0, 3, 3) and not layout.even and (layout.seg, layout.stage_seg) == (0, 0)
    assert stage_units(layout, own_shard_only=True) == 9  # the all-gather pull stages its largest shard


def test_aligned_segments():
    assert segments([16, 32, 0], vec=16, padded=True).seg_aligned
    assert not segments([16, 31, 1], vec=16, padded=True).seg_aligned


@pytest.mark.parametrize("counts", [[], [3, -1]])
def test_bad_counts_are_refused(counts):
    with pytest.raises(ValueError, match="one non-negative count per rank"):
        segments(counts, 8, True)


def test_push_slots_hold_the_largest_segment_on_16_bytes():
    assert push_slot_units([5, 0, 17], vec=8) == 24 and push_slot_units([16, 16], vec=4) == 16
    counts = even_counts(1001, 7)
    assert 7 * push_slot_units(counts, 8) * 2 <= stage_bytes(False, 1001 * 2, 7)


def test_even_counts():
    assert even_counts(12, 3) == [4, 4, 4]
    with pytest.raises(ValueError, match="input of 13 units does not split into 3 equal shards"):
        even_counts(13, 3, "input")


def test_stage_bytes_bound_every_even_layout():
    for nbytes, world_size in [(2 * 7 * 3, 3), (4096, 8), (2 * 1001 * 2, 2)]:
        counts = even_counts(nbytes // 2, world_size)
        need = stage_units(segments(counts, 8, True), False) * 2
        assert need <= stage_bytes(False, nbytes, world_size)
        assert stage_bytes(True, nbytes, world_size) >= nbytes // world_size
    assert stage_bytes(False, 4096, 8) == 4096 and stage_bytes(True, 4096, 8) == 512


def test_configs_reject_illegal_combinations():
    assert ReduceScatterConfig("pull", 1024, 8, 4).block_size == 1024
    with pytest.raises(ValueError, match=r"algorithm='multimem' is not one of \('pull', 'push'\)"):
        ReduceScatterConfig("multimem", 1024, 8, 4)
    with pytest.raises(ValueError, match=r"block_size=64 must be a power of two in 128..65536 \(bytes"):
        AllGatherConfig("push", 64, 8, 4)
    with pytest.raises(ValueError, match="block_size=1000"):
        ReduceScatterConfig("pull", 1000, 8, 4)
    with pytest.raises(ValueError, match="num_blocks=0"):
        AllGatherConfig("pull", 1024, 0, 4)
    with pytest.raises(ValueError, match="num_warps=3"):
        AllGatherConfig("pull", 1024, 1, 3)
    with pytest.raises(ValueError, match="must be an int"):
        AllGatherConfig("pull", 1024.0, 1, 4)
    config = AllGatherConfig("pull", 4096, 8, 4)
    assert (config.algorithm, config.block_size, config.num_blocks, config.num_warps) == ("pull", 4096, 8, 4)
    # configs key plan caches: equal fields of one op are one key, another op's never
    assert config != AllGatherConfig("push", 4096, 8, 4) and config != ReduceScatterConfig("pull", 4096, 8, 4)
    keys = {ReduceScatterConfig("pull", 4096, 8, 4): 1, ReduceScatterConfig("pull", 4096, 4, 4): 2}
    assert keys[ReduceScatterConfig("pull", 4096, 8, 4)] == 1 and len(keys) == 2

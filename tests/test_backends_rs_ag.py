"""The reduce-scatter and all-gather launchers (autosymm.backends.triton_rs_ag) on simulated
ranks under the interpreter: where they stage (the top of the region: the test pre-stages
there, so a stage anywhere else reads poison), zero-copy for Workspace.empty tensors, in-place
calls, per-rank counts, and the errors that name the bad tensor or setting.
"""

import pytest
import torch

from autosymm import spec
from autosymm.backends.base import BackendError
from autosymm.backends.rs_ag_layout import push_slot_units, segments, stage_units
from autosymm.configs import AllGatherConfig, ReduceScatterConfig
from autosymm.backends.triton_rs_ag import (AllGatherLauncher, ReduceScatterLauncher, all_gather_space,
                                            reduce_scatter_space, triton_all_gather_pull, triton_all_gather_push,
                                            triton_reduce_scatter_pull, triton_reduce_scatter_push)
from autosymm.geometry import ALIGN, align

from _all_reduce_sim import preset, requires_interpreter
from _rs_ag_sim import (check_pads, prestage_all_gather, prestage_push_slots, prestage_reduce_scatter, random_values,
                        reference_sum, vec_of, workspaces)

pytestmark = requires_interpreter

RS_CONFIG = ReduceScatterConfig("pull", 128, 2, 4)
RS_PUSH_CONFIG = ReduceScatterConfig("push", 128, 2, 4)


def _top(ws, need_bytes):
    return ws.capacity("all_reduce") - align(need_bytes, ALIGN)


def _rs_run(wss, ins, outs, counts=None, zero_copy=False, config=RS_CONFIG):
    """Each rank's launcher in turn, with the stage pre-staged where a staged launcher must put it."""
    dtype, elem = ins[0].dtype, ins[0].element_size()
    per_rank = counts or [ins[0].numel() // len(wss)] * len(wss)
    layout = segments(per_rank, vec_of(dtype), padded=not zero_copy)
    if config.algorithm == "push":
        slot = push_slot_units(per_rank, vec_of(dtype))
        prestage_push_slots(wss, ins, layout, slot, _top(wss[0], len(wss) * slot * elem))
    elif not zero_copy:
        prestage_reduce_scatter(wss, ins, layout, _top(wss[0], stage_units(layout, False) * elem))
    expected = preset([ws.buffer for ws in wss], config.num_blocks, 2)
    launchers = [ReduceScatterLauncher(config, ws, dtype) for ws in wss]
    results = [launch(out, x, counts) for launch, out, x in zip(launchers, outs, ins)]
    assert all(r is out for r, out in zip(results, outs)), "the launcher returns its output"
    check_pads(wss, expected)
    total = reference_sum(ins, dtype)
    starts = layout.starts
    return [total[starts[r]:starts[r + 1]] for r in range(len(wss))]


@pytest.mark.parametrize("config", [RS_CONFIG, RS_PUSH_CONFIG], ids=["pull", "push"])
@pytest.mark.parametrize("world_size, dtype, counts", [(3, torch.bfloat16, None), (4, torch.float32, [7, 0, 300, 21]),
                                                       (2, torch.float16, None)])
def test_reduce_scatter_launcher_stages_at_the_top_of_the_region(world_size, dtype, counts, config):
    wss = workspaces(world_size)
    total = sum(counts) if counts else 301 * world_size
    ins = [random_values(total, dtype, seed=r) for r in range(world_size)]
    outs = [torch.empty((counts or [301] * world_size)[r], dtype=dtype) for r in range(world_size)]
    want = _rs_run(wss, ins, outs, counts, config=config)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))


def test_reduce_scatter_launcher_zero_copy_and_in_place():
    """An input from Workspace.empty is the stage; the output may be its own segment."""
    world_size, dtype, seg = 3, torch.bfloat16, 200
    wss = workspaces(world_size)
    ins = [ws.empty((world_size * seg,), dtype) for ws in wss]
    for r, x in enumerate(ins):
        x.copy_(random_values(world_size * seg, dtype, seed=r + 4))
    before = [x.clone() for x in ins]
    outs = [torch.empty(seg, dtype=dtype) for _ in wss]
    want = _rs_run(wss, ins, outs, zero_copy=True)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    assert all(torch.equal(x, b) for x, b in zip(ins, before))
    # in place: rank r's output is segment r of its (staged) input
    wss = workspaces(world_size)
    ins = [b.clone() for b in before]
    outs = [x[r * seg:(r + 1) * seg] for r, x in enumerate(ins)]
    want = _rs_run(wss, [x.clone() for x in before], [torch.empty(seg, dtype=dtype) for _ in wss])
    wss = workspaces(world_size)
    _rs_run(wss, ins, outs)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))


def _ag_run(wss, shards, outs, algorithm, counts=None, zero_copy=False):
    config = AllGatherConfig(algorithm, 256, 3, 4)
    push = algorithm == "push"
    elem = shards[0].element_size()
    layout = segments([s.numel() * elem for s in shards], 16, padded=push and not zero_copy)
    if not zero_copy:
        offset = _top(wss[0], stage_units(layout, not push))
        prestage_all_gather(wss, [s.reshape(-1).view(torch.uint8) for s in shards], layout, offset, push)
    expected = preset([ws.buffer for ws in wss], config.num_blocks, 2)
    launchers = [AllGatherLauncher(algorithm, config, ws) for ws in wss]
    results = [launch(out, shard, counts) for launch, out, shard in zip(launchers, outs, shards)]
    assert all(r is out for r, out in zip(results, outs))
    check_pads(wss, expected)


@pytest.mark.parametrize("algorithm", ["push", "pull"])
@pytest.mark.parametrize("world_size, dtype, counts", [(2, torch.int64, None), (3, torch.bfloat16, [5, 0, 130]),
                                                       (4, torch.int8, None)])
def test_all_gather_launcher_any_dtype_and_counts(world_size, dtype, counts, algorithm):
    wss = workspaces(world_size)
    per_rank = counts or [77] * world_size
    shards = [random_values(c, dtype, seed=r) for r, c in enumerate(per_rank)]
    outs = [torch.empty(sum(per_rank), dtype=dtype) for _ in wss]
    _ag_run(wss, shards, outs, algorithm, counts)
    assert all(torch.equal(o, torch.cat(shards)) for o in outs)


@pytest.mark.parametrize("algorithm", ["push", "pull"])
def test_all_gather_launcher_zero_copy(algorithm):
    """push: outputs from Workspace.empty (peers write into them); pull: inputs from it."""
    world_size, dtype, shard = 3, torch.int32, 50
    wss = workspaces(world_size)
    values = [random_values(shard, dtype, seed=r) for r in range(world_size)]
    if algorithm == "push":
        outs = [ws.empty((world_size, shard), dtype) for ws in wss]
        shards = values
    else:
        outs = [torch.empty(world_size, shard, dtype=dtype) for _ in wss]
        shards = [ws.empty((shard,), dtype) for ws in wss]
        for s, v in zip(shards, values):
            s.copy_(v)
    _ag_run(wss, shards, outs, algorithm, zero_copy=True)
    assert all(torch.equal(o.reshape(-1), torch.cat(values)) for o in outs)


@pytest.mark.parametrize("algorithm", ["push", "pull"])
def test_all_gather_launcher_in_place(algorithm):
    """The input may be this rank's own shard of the output."""
    world_size, shard = 2, 33
    wss = workspaces(world_size)
    values = [random_values(shard, torch.float16, seed=r) for r in range(world_size)]
    outs = [torch.zeros(world_size * shard, dtype=torch.float16) for _ in wss]
    for r, out in enumerate(outs):
        out[r * shard:(r + 1) * shard] = values[r]
    _ag_run(wss, [out[r * shard:(r + 1) * shard] for r, out in enumerate(outs)], outs, algorithm)
    assert all(torch.equal(o, torch.cat(values)) for o in outs)


# -- errors ---------------------------------------------------------------------------------------

def test_errors_name_the_bad_tensor():
    ws = workspaces(2)[0]
    rs = ReduceScatterLauncher(RS_CONFIG, ws, torch.bfloat16)
    ag = AllGatherLauncher("pull", AllGatherConfig("pull", 256, 3, 4), ws)
    bf = torch.bfloat16
    with pytest.raises(BackendError, match=r"input dtype torch.float32 \(prepared for torch.bfloat16\)"):
        rs(torch.empty(5, dtype=bf), torch.empty(10))
    with pytest.raises(BackendError, match="does not split into 2 equal shards"):
        rs(torch.empty(5, dtype=bf), torch.empty(11, dtype=bf))
    with pytest.raises(BackendError, match="must hold rank 0's 4 elements"):
        rs(torch.empty(5, dtype=bf), torch.empty(9, dtype=bf), [4, 5])
    with pytest.raises(BackendError, match=r"per-rank counts \[4, 4\] must be 2 non-negative counts summing"):
        rs(torch.empty(4, dtype=bf), torch.empty(9, dtype=bf), [4, 4])
    with pytest.raises(BackendError, match="strides"):
        rs(torch.empty(5, dtype=bf), torch.empty(10, 2, dtype=bf).t())
    with pytest.raises(BackendError, match="differs from input dtype"):
        ag(torch.empty(10, dtype=torch.int32), torch.empty(5, dtype=torch.int16))
    with pytest.raises(BackendError, match="must be rank 0's 5 elements"):
        ag(torch.empty(10, dtype=torch.int32), torch.empty(4, dtype=torch.int32))
    out = torch.empty(10, dtype=bf)
    with pytest.raises(BackendError, match="overlaps"):
        rs(out[1:6], out)  # not rank 0's own segment


def test_a_stage_that_would_reach_empty_tensors_or_a_straddling_tensor_is_refused():
    ws = workspaces(2, region_bytes=1 << 12)[0]
    rs = ReduceScatterLauncher(RS_CONFIG, ws, torch.float32)
    ws.empty((700,), torch.float32)  # 2816 of 4096 bytes handed out
    with pytest.raises(BackendError, match="would overwrite the 2816 bytes handed out by autosymm.empty"):
        rs(torch.empty(200), torch.empty(400))
    edge = ws.buffer[ws.regions["all_reduce"].offset + 4096 - 64:][:128].view(torch.float32)  # 64 bytes in, 64 out
    with pytest.raises(BackendError, match="straddles the edge of the all-reduce region"):
        rs(torch.empty(16), edge)


# -- backends and spaces ------------------------------------------------------------------------

def test_backends_declare_what_they_need():
    backends = (triton_reduce_scatter_pull, triton_reduce_scatter_push, triton_all_gather_push, triton_all_gather_pull)
    assert [b.name for b in backends] == ["triton_reduce_scatter_pull", "triton_reduce_scatter_push",
                                          "triton_all_gather_push", "triton_all_gather_pull"]
    served = [[r.name for r in spec.ALL if b.serves(r)] for b in backends]  # the ops whose specs list it
    assert served == [["reduce_scatter"], ["reduce_scatter"], ["all_gather"], ["all_gather"]]
    for backend in backends:
        assert backend.needs.workspace_region == "all_reduce" and backend.needs.intra_node
        assert backend.needs.compiles_kernels and not backend.needs.multicast


@pytest.mark.parametrize("algorithm", ["pull", "push"])
@pytest.mark.parametrize("numel, world_size, elem_bytes", [(1, 2, 2), (4099, 3, 4), (1 << 22, 8, 2)])
def test_reduce_scatter_space_is_valid_and_not_redundant(numel, world_size, elem_bytes, algorithm):
    space = reduce_scatter_space(algorithm, numel, world_size, elem_bytes)
    assert all(c.algorithm == algorithm for c in space)
    assert space and len(set(space)) == len(space)
    segment = -(-numel // world_size)
    for config in space:
        chunks = -(-segment // config.block_size)
        assert config.num_blocks < chunks or config == min(
            (c for c in space if (c.block_size, c.num_warps) == (config.block_size, config.num_warps)
             and c.num_blocks >= chunks), key=lambda c: c.num_blocks), "only one grid covering every chunk"


@pytest.mark.parametrize("algorithm", ["push", "pull"])
def test_all_gather_space_gives_every_thread_a_vector(algorithm):
    space = all_gather_space(algorithm, 1 << 20, 4)
    assert space and all(c.algorithm == algorithm for c in space)
    assert all(c.block_size // (c.num_warps * 32) >= 16 or c.num_warps == 4 for c in space)

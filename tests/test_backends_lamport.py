"""Backend ``triton_lamport``: its record, eligibility, search space, config checks, the Lamport
region, and its launches (recorded, and a bound launch with int addresses)."""

import dataclasses

import pytest
import torch

from autosymm import spec
from autosymm.backends import backend_names, get_backend
from autosymm.backends.base import BackendError, Capabilities, RunContext
from autosymm.backends.triton_all_reduce import ALGORITHMS, largest_stage_bytes
from autosymm.backends.triton_lamport import triton_lamport
from autosymm.configs import AllReduceConfig, config_from_json, config_to_json
from autosymm.geometry import (LAMPORT_BYTES, LAMPORT_HEADER_BYTES, LAMPORT_REGION, LAMPORT_SLOT_BYTES,
                               MAX_WORLD_SIZE, workspace_layout)
from autosymm.problem import Problem
from autosymm.workspace.symm import simulated_workspaces

CAPS = Capabilities(world_size=4, all_reduce_bytes=1 << 20, moe_bytes=1 << 20, intra_node=True)


@pytest.fixture
def recorded_launches(monkeypatch):
    """Launches recorded instead of run: (constexprs, grid, args) per call; the second call of a
    variant goes through its ``direct`` launch."""
    import autosymm.backends.triton_lamport as module

    calls = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            self.fn, self.grid, self.constexprs, self.options, self.direct = fn, grid, constexprs, options, None

        def __call__(self, *args):
            calls.append(("slow", self.constexprs, self.grid, args))
            self.direct = lambda *a: calls.append(("direct", self.constexprs, self.grid, a))

    monkeypatch.setattr(module, "LeanLauncher", FakeLean)
    return calls


def _launcher(world_size=4, dtype="bf16", nbytes=4096, config=AllReduceConfig("lamport", 1024, 4, 4), rank=1):
    wss = simulated_workspaces(world_size, all_reduce_bytes=1 << 12, moe_bytes=256, double_buffer_bytes=0)
    problem = Problem.all_reduce(nbytes, dtype, world_size)
    return wss, triton_lamport.prepare(problem, config, RunContext(workspace=wss[rank]))


def test_record_and_registry():
    record = ALGORITHMS["lamport"]
    assert record.stage_bytes(LAMPORT_SLOT_BYTES, 8) == 0  # nothing staged in the all-reduce region
    assert not (record.double_buffer or record.splits_by_rank or record.multicast)
    assert largest_stage_bytes(1000, 4) == 3 * 1024  # the push one-shot's stage still bounds the region
    assert "triton_lamport" in backend_names() and get_backend("triton_lamport") is triton_lamport
    assert triton_lamport.name == "triton_lamport"
    assert [r.name for r in spec.ALL if triton_lamport.serves(r)] == ["all_reduce"]
    assert triton_lamport.needs.graph_capturable


def test_config_checks_and_json():
    config = AllReduceConfig("lamport", 2048, 8, 8)
    assert config.record is ALGORITHMS["lamport"]
    assert config_from_json(config_to_json(config)) == config
    with pytest.raises(ValueError, match="double_buffer=True is only for"):
        AllReduceConfig("lamport", 2048, 8, 8, double_buffer=True)
    with pytest.raises(ValueError, match="num_blocks"):
        AllReduceConfig("lamport", 2048, 0, 8)
    spin = AllReduceConfig("lamport", 2048, 8, 8, spin=True)
    assert config_from_json(config_to_json(spin)) == spin and '"spin": true' in config_to_json(spin)
    assert "spin" not in config_to_json(config)  # absent at its default: older rows read as before
    with pytest.raises(ValueError, match="spin=True is only for the Lamport"):
        AllReduceConfig("one_shot_push", 2048, 8, 8, spin=True)
    with pytest.raises(ValueError, match="must be a bool"):
        AllReduceConfig("lamport", 2048, 8, 8, spin=1)


@pytest.mark.parametrize("problem, caps, reason", [
    (Problem.all_reduce(LAMPORT_SLOT_BYTES, "bf16", 4), CAPS, None),
    (Problem.all_reduce(6, "fp16", 8), Capabilities(world_size=8, all_reduce_bytes=1 << 20, intra_node=True), None),
    (Problem.all_reduce(1000, "fp32", 2), CAPS, None),
    (Problem.all_reduce(LAMPORT_SLOT_BYTES + 2, "bf16", 4), CAPS, "Lamport one-shot's 262144-byte slots"),
    (Problem.all_reduce(4096, "bf16", 16), Capabilities(world_size=16, all_reduce_bytes=1 << 20, intra_node=True),
     "world size 16 > 8"),
    (Problem.all_reduce(4096, "bf16", 4), Capabilities(world_size=4), "no symmetric workspace"),
    (Problem.all_reduce(4096, "bf16", 4), Capabilities(world_size=4, all_reduce_bytes=1 << 20, intra_node=False),
     "nodes"),
])
def test_why_not(problem, caps, reason):
    got = triton_lamport.why_not(problem, caps)
    assert got is None if reason is None else (got is not None and reason in got), got
    assert triton_lamport.why_not(problem, caps, "graph") == got  # graph-capturable: the index is on the device


@pytest.mark.parametrize("nbytes, dtype, world_size", [(6, "fp16", 4), (4096, "bf16", 2), (LAMPORT_SLOT_BYTES, "fp32", 8)])
def test_search_space(nbytes, dtype, world_size):
    space = triton_lamport.search_space(Problem.all_reduce(nbytes, dtype, world_size))
    assert space and len(space) == len(set(space))
    assert all(c.algorithm == "lamport" and not c.double_buffer for c in space)
    # world size 2: every config again with the per-thread spin, after the CTA-uniform ones
    plain = [c for c in space if not c.spin]
    assert space[:len(plain)] == plain
    twins = [dataclasses.replace(c, spin=True) for c in plain] if world_size == 2 else []
    assert [c for c in space if c.spin] == twins


@pytest.mark.parametrize("world_size, interpreted, want", [(2, False, 8), (2, True, 0), (4, False, 0)])
def test_spin_constexpr(recorded_launches, monkeypatch, world_size, interpreted, want):
    """SPIN is spin_pack of a thread's elements with a spin config at world size 2 on a GPU; 0 (the
    CTA-uniform wait) under the interpreter and at other world sizes; 0 without spin."""
    import autosymm.backends.launch as launch

    monkeypatch.setattr(launch, "interpreter_active", lambda: interpreted)
    _, launcher = _launcher(world_size=world_size, config=AllReduceConfig("lamport", 1024, 4, 4, spin=True))
    launcher(torch.zeros(1024, dtype=torch.bfloat16))
    assert recorded_launches[-1][1]["SPIN"] == want  # 1024 bf16 over 128 threads: 8 a thread, 16 bytes
    _, launcher = _launcher(world_size=world_size)
    launcher(torch.zeros(1024, dtype=torch.bfloat16))
    assert recorded_launches[-1][1]["SPIN"] == 0


@pytest.mark.parametrize("elems, elem_bytes, want", [(8, 2, 8), (16, 2, 8), (4, 2, 4), (2, 2, 2), (1, 2, 1), (6, 2, 2),
                                                     (8, 4, 4), (2, 4, 2), (3, 4, 1), (0, 2, 1), (64, 4, 4)])
def test_spin_pack(elems, elem_bytes, want):
    from autosymm.kernels.lamport_all_reduce import spin_pack

    assert spin_pack(elems, elem_bytes) == want


@pytest.mark.parametrize("pack, bits", [(1, 16), (8, 16), (4, 32)])
def test_spin_asm_structure(pack, bits):
    """The spin's PTX: one block (registers and labels scoped, so a kernel holds many), the fast
    path one branch past the loop, each word re-polled alone (volatile, predicated on still being
    the sentinel), the loop bounded by the limit operand (already reached when the error count
    is non-zero), a give-up counted once per instance; operands numbered as _spin passes them."""
    import re

    from autosymm.kernels.lamport_all_reduce import _spin_asm

    asm = _spin_asm(pack, bits)
    lines = asm.splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and asm.count("{") == 1
    assert lines.index("@!%lw_m bra LW_DONE;") < lines.index("LW_POLL:") < lines.index("LW_DONE:")
    reloads = re.findall(rf"@%lw_q ld\.volatile\.global\.u{bits} \$(\d+), \[\$(\d+)\];", asm)
    assert [(int(o), int(a)) for o, a in reloads] == [(i, 2 * pack + i) for i in range(pack)]
    assert f"setp.ne.u32 %lw_q, ${3 * pack}, 0;" in asm and f"selp.u32 %lw_n, ${4 * pack}, 0, %lw_q;" in asm
    assert f"setp.ge.u32 %lw_q, %lw_n, ${4 * pack};" in asm
    assert lines[-2] == f"@%lw_m red.global.gpu.relaxed.add.u32 [${5 * pack}], 1;"
    assert "bar." not in asm and "fence" not in asm  # nothing CTA-wide, no fence


def test_region_is_reserved_and_sized_for_every_world_size():
    layout = workspace_layout(1 << 12, 1 << 12, 1 << 12)
    region = layout.regions[LAMPORT_REGION]
    assert list(layout.regions)[-1] == LAMPORT_REGION and region.nbytes == LAMPORT_BYTES
    assert LAMPORT_BYTES == LAMPORT_HEADER_BYTES + 3 * (MAX_WORLD_SIZE - 1) * LAMPORT_SLOT_BYTES
    assert region.offset % 256 == 0 and LAMPORT_SLOT_BYTES % 256 == 0


def test_launches_and_binds(recorded_launches):
    wss, launcher = _launcher(world_size=4, dtype="bf16")
    x = torch.zeros(1001, dtype=torch.bfloat16)
    launcher(x)
    launcher(x)
    (kind0, constexprs, grid, slow), (kind1, _, _, direct) = recorded_launches
    assert (kind0, kind1) == ("slow", "direct") and grid == (4,)
    assert constexprs == dict(RANK=1, WORLD_SIZE=4, BLOCK=1024, TAIL=1, PHASE=0, SPIN=0)
    assert slow[0] is x and slow[1] is launcher.region_ptrs and slow[2] is launcher.signal_ptrs
    assert slow[3] is launcher.header and direct[3] == launcher.header.data_ptr()  # this rank's header
    assert slow[4:] == direct[4:] == (1001, LAMPORT_SLOT_BYTES)  # the same slot stride every call
    region = wss[0].regions[LAMPORT_REGION]
    assert launcher.region_ptrs.tolist() == [int(ws.buffer.data_ptr()) + region.offset for ws in wss]
    assert direct[:3] == (x.data_ptr(), launcher.region_ptrs.data_ptr(), launcher.signal_ptrs.data_ptr())
    bound = launcher.bind(x)
    bound()
    assert recorded_launches[-1][3] == direct
    launcher(torch.zeros(1024, dtype=torch.bfloat16))  # whole 16-byte vectors: TAIL
    assert recorded_launches[-1][1]["TAIL"] == 8


def test_bind_before_a_launch_and_nothing_to_launch(recorded_launches):
    _, launcher = _launcher(world_size=2)
    assert launcher.bind(torch.zeros(16, dtype=torch.bfloat16)) is None  # not bound yet
    assert launcher.bind(torch.zeros(0, dtype=torch.bfloat16)) is None
    assert not recorded_launches


def test_prepare_errors():
    wss = simulated_workspaces(2, all_reduce_bytes=1 << 12, moe_bytes=256, double_buffer_bytes=0)
    ctx = RunContext(workspace=wss[0])
    with pytest.raises(BackendError, match="262144"):
        triton_lamport.prepare(Problem.all_reduce(LAMPORT_SLOT_BYTES + 2, "bf16", 2),
                               AllReduceConfig("lamport", 1024, 1, 4), ctx)
    with pytest.raises(BackendError, match="algorithm='lamport'"):
        triton_lamport.prepare(Problem.all_reduce(4096, "bf16", 2), AllReduceConfig("one_shot", 1024, 1, 4), ctx)
    with pytest.raises(BackendError, match="needs a symmetric workspace"):
        triton_lamport.prepare(Problem.all_reduce(4096, "bf16", 2), AllReduceConfig("lamport", 1024, 1, 4),
                               RunContext())

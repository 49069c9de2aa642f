"""All-reduce backends: support table, search spaces, input errors, launchers end to end.

Launchers run under the Triton interpreter on simulated workspaces (tests/_all_reduce_sim).
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from autosymm import spec
from autosymm.backends import launch as launch_mod
from autosymm.backends.base import BackendError, Capabilities, RunContext
from autosymm.backends.launch import LeanLauncher
from autosymm.backends.nccl_all_reduce import nccl
from autosymm.backends.torch_symm import _TorchLauncher, torch_one_shot, torch_two_shot
from autosymm.backends.triton_all_reduce import (ALGORITHMS, PULL_DOUBLE_BUFFER_MAX_BYTES, all_reduce_space,
                                                 triton_multimem, triton_one_shot, triton_one_shot_push,
                                                 triton_two_shot)
from autosymm.configs import AllReduceConfig
from autosymm.problem import MoEShape, Problem
from autosymm.geometry import (ALL_REDUCE_EPOCH_SLOT, DOUBLE_BUFFER_HALF_BYTES, DOUBLE_BUFFER_REGION, segment_vecs,
                               stage_offset)
from autosymm.workspace.symm import simulated_workspaces

from _all_reduce_sim import (arrivals, assert_close_to_sum, epoch, half_view, pads, preset, random_inputs,
                             requires_interpreter, snapshot_workspace)

CAPS = Capabilities(world_size=4, all_reduce_bytes=1 << 20, has_multicast=True, intra_node=True,
                    torch_symm_ops=True, compute_capability=(9, 0))
TRITON = (triton_one_shot, triton_one_shot_push, triton_two_shot, triton_multimem)
ALL = TRITON + (torch_one_shot, torch_two_shot, nccl)


def _problem(nbytes=16384, dtype="bf16", world_size=4):
    return Problem.all_reduce(nbytes, dtype, world_size)


# --------------------------------------------------------------------------------------------
# What is supported
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, problem, caps, reason", [
    (triton_one_shot, _problem(), CAPS, None),
    (triton_two_shot, _problem(dtype="fp16"), CAPS, None),
    (triton_multimem, _problem(dtype="fp32"), CAPS, None),
    (triton_one_shot, _problem(nbytes=(1 << 20) + 2), CAPS, "exceed"),
    (triton_one_shot_push, _problem(nbytes=1365 * 256), CAPS, None),  # 3 slots fit the 1 MiB region
    (triton_one_shot_push, _problem(nbytes=1366 * 256), CAPS, "1049088-byte stage exceeds"),
    (triton_two_shot, _problem(), Capabilities(world_size=4), "no symmetric workspace"),
    (triton_one_shot, _problem(), Capabilities(world_size=4, all_reduce_bytes=1 << 20, intra_node=False), "nodes"),
    (triton_multimem, _problem(), Capabilities(world_size=4, all_reduce_bytes=1 << 20, compute_capability=(9, 0)),
     "no multicast"),
    (triton_multimem, _problem(), Capabilities(world_size=4, all_reduce_bytes=1 << 20, has_multicast=True,
                                               compute_capability=(8, 0)), "sm_90"),
    (triton_one_shot, Problem.moe("dp_to_ep", MoEShape(64, 8, 2), 4), CAPS, "does not serve dp_to_ep"),
    (torch_one_shot, _problem(), CAPS, None),
    (torch_two_shot, _problem(dtype="fp32"), CAPS, None),
    (torch_one_shot, _problem(dtype="fp16"), CAPS, "dtype fp16"),
    (torch_two_shot, _problem(), Capabilities(world_size=4, torch_symm_ops=False), "unavailable"),
    (torch_one_shot, _problem(nbytes=1000), CAPS, "multiple of 16"),
    (torch_two_shot, _problem(nbytes=16 * 4 * 3 + 16), CAPS, "multiple of 64"),
    (torch_one_shot, _problem(), Capabilities(world_size=4, torch_symm_ops=True, intra_node=False), "nodes"),
    (nccl, _problem(nbytes=6, dtype="fp16"), Capabilities(world_size=4), None),
    (nccl, Problem.moe("ep_to_dp", MoEShape(64, 8, 2), 4), CAPS, "does not serve ep_to_dp"),
])
def test_why_not(backend, problem, caps, reason):
    got = backend.why_not(problem, caps)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_names_and_ops():
    assert [b.name for b in ALL] == ["triton_one_shot", "triton_one_shot_push", "triton_two_shot", "triton_multimem",
                                     "torch_one_shot", "torch_two_shot", "nccl"]
    assert all([r.name for r in spec.ALL if b.serves(r)] == ["all_reduce"] for b in ALL)  # the ops whose specs list it


#: (widest BLOCK, most programs at the narrowest BLOCK, double buffering offered) of each
#: algorithm's space per call: a BLOCK at most twice a rank's share of the data (the one-shots
#: reduce all of it, the two-shots 1/world_size; at least 1024 elements), no more programs than the first count covering
#: its BLOCK-wide chunks, double buffering for the one-shots where the call is latency-bound.
SPACE_SHAPES = {
    (4096, "bf16", 2): {"one_shot": (4096, 2, True), "one_shot_push": (4096, 2, True),
                        "two_shot": (2048, 1, False), "multimem": (2048, 1, False)},
    # 1 MiB: still the pull one-shot's; the push one-shot's 7 slots of it exceed a 4 MiB half
    (1 << 20, "fp32", 8): {"one_shot": (32768, 256, True), "one_shot_push": (32768, 256, False),
                           "two_shot": (32768, 32, False), "multimem": (32768, 32, False)},
    (6, "fp16", 4): {"one_shot": (2048, 1, True), "one_shot_push": (2048, 1, True),
                     "two_shot": (2048, 1, False), "multimem": (2048, 1, False)},
}


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("nbytes, dtype, world_size", list(SPACE_SHAPES))
def test_triton_search_space(backend, nbytes, dtype, world_size):
    """A backend's space: distinct configs of its own algorithm, sized to the call (SPACE_SHAPES); multimem keeps its v4 operations whole (16 bytes a thread
    but at the fewest warps), the others 8."""
    problem = _problem(nbytes, dtype, world_size)
    space = backend.search_space(problem)
    assert space and len(space) == len(set(space))
    assert all(isinstance(c, AllReduceConfig) and c.algorithm == backend.algorithm for c in space)
    widest, programs, double = SPACE_SHAPES[nbytes, dtype, world_size][backend.algorithm]
    narrowest = min(c.block_size for c in space)
    assert (max(c.block_size for c in space), max(c.num_blocks for c in space if c.block_size == narrowest),
            any(c.double_buffer for c in space)) == (widest, programs, double)
    min_bytes = 16 if backend is triton_multimem else 8
    assert all(c.block_size * problem.elem_bytes // c.threads >= min_bytes or c.num_warps == 4 for c in space)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("numel", [1, 2048, 8191, 1 << 20, 1 << 27])
def test_all_reduce_space_valid_and_not_redundant(algorithm, numel):
    space = all_reduce_space(algorithm, numel, world_size=4, elem_bytes=2)
    assert space and len(space) == len(set(space))
    per_program = -(-numel // 4) if algorithm in ("two_shot", "multimem") else numel
    by_shape: dict = {}
    for config in space:
        assert config.algorithm == algorithm
        by_shape.setdefault((config.block_size, config.num_warps, config.double_buffer), []).append(config.num_blocks)
    for (block_size, _, _), counts in by_shape.items():
        chunks = -(-per_program // block_size)
        # at most one count covers all chunks: more programs would only idle
        assert sum(c >= chunks for c in counts) <= 1, (block_size, counts)


def test_all_reduce_space_grows_with_size():
    small = all_reduce_space("one_shot", 2048, 2, 2)
    large = all_reduce_space("one_shot", 1 << 26, 2, 2)
    assert len(small) < len(large)
    assert max(c.num_blocks for c in small) <= 2
    assert max(c.num_blocks for c in large) == 256


@pytest.mark.parametrize("world_size, elem_bytes", [(2, 2), (8, 4)])
def test_double_buffer_only_for_small_one_shot(world_size, elem_bytes):
    for algorithm in ALGORITHMS:
        for nbytes in (4096, 65536, PULL_DOUBLE_BUFFER_MAX_BYTES, 2 * PULL_DOUBLE_BUFFER_MAX_BYTES,
                       DOUBLE_BUFFER_HALF_BYTES, 2 * DOUBLE_BUFFER_HALF_BYTES):
            space = all_reduce_space(algorithm, nbytes // elem_bytes, world_size, elem_bytes)
            on = [c for c in space if c.double_buffer]
            off = [c for c in space if not c.double_buffer]
            offered = {"one_shot": nbytes <= PULL_DOUBLE_BUFFER_MAX_BYTES,  # the pull one-shot: latency-bound sizes
                       "one_shot_push": (world_size - 1) * nbytes <= DOUBLE_BUFFER_HALF_BYTES}  # its slots fit a half
            if offered.get(algorithm, False):
                # every single-buffer config once more with double buffering, appended (space[0] unchanged)
                assert on == [dataclasses.replace(c, double_buffer=True) for c in off]
                assert space == off + on
            else:
                assert not on


@pytest.mark.parametrize("backend", [torch_one_shot, torch_two_shot, nccl])
def test_configless_search_space(backend):
    assert backend.search_space(_problem()) == [None]


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _launcher(backend, world_size=2, dtype="bf16", nbytes=4096, rank=0, region=1 << 16, **config):
    wss = simulated_workspaces(world_size, all_reduce_bytes=region, moe_bytes=256)
    cfg = AllReduceConfig(backend.algorithm, config.get("block", 256), config.get("programs", 2), config.get("warps", 4))
    return wss, backend.prepare(_problem(nbytes, dtype, world_size), cfg, RunContext(workspace=wss[rank]))


@pytest.mark.parametrize("make_x, match", [
    (lambda: torch.zeros(8, dtype=torch.float16), r"dtype torch.float16 \(prepared for torch.bfloat16\)"),
    (lambda: torch.zeros(8, 4, dtype=torch.bfloat16).t(), r"\(4, 8\).*strides \(1, 4\)"),
    (lambda: torch.zeros(40000, dtype=torch.bfloat16), r"\(40000,\).*80000 bytes; at most 65536"),
])
def test_bad_input_errors(make_x, match):
    _, launcher = _launcher(triton_one_shot)
    with pytest.raises(BackendError, match=match):
        launcher(make_x())


def test_tensor_straddling_the_region_is_refused():
    wss, launcher = _launcher(triton_one_shot)
    region = wss[0].regions["all_reduce"]
    end = region.offset + region.nbytes
    x = wss[0].buffer[end - 64:end + 64].view(torch.bfloat16)
    with pytest.raises(BackendError, match="straddles"):
        launcher(x)


def test_cpu_tensor_for_a_cuda_workspace():
    (ws,) = simulated_workspaces(1, all_reduce_bytes=4096, moe_bytes=256)
    cuda_ws = SimpleNamespace(  # what the launcher reads of a workspace, claiming a CUDA device
        device=torch.device("cuda", 0), world_size=2, rank=0, capacity=ws.capacity, buffer=ws.buffer,
        regions=ws.regions, region_ptrs=ws.region_ptrs, signal_ptrs=ws.signal_ptrs, multicast_ptr=0,
        has_multicast=False)
    launcher = triton_two_shot.prepare(_problem(world_size=2), AllReduceConfig("two_shot", 1024, 1, 4),
                                       RunContext(workspace=cuda_ws))
    with pytest.raises(BackendError, match=r"device cpu \(the workspace is on cuda:0\)"):
        launcher(torch.zeros(16, dtype=torch.bfloat16))


def test_prepare_errors():
    (ws,) = simulated_workspaces(1, all_reduce_bytes=4096, moe_bytes=256)
    ctx = RunContext(workspace=ws)
    with pytest.raises(BackendError, match="needs a symmetric workspace"):
        triton_one_shot.prepare(_problem(world_size=1), AllReduceConfig("one_shot", 1024, 1, 4), RunContext())
    with pytest.raises(BackendError, match="algorithm='one_shot'"):
        triton_one_shot.prepare(_problem(world_size=1), AllReduceConfig("two_shot", 1024, 1, 4), ctx)
    with pytest.raises(BackendError, match="world size 1"):
        triton_one_shot.prepare(_problem(world_size=2), AllReduceConfig("one_shot", 1024, 1, 4), ctx)
    with pytest.raises(BackendError, match="multicast"):
        triton_multimem.prepare(_problem(world_size=1), AllReduceConfig("multimem", 1024, 1, 4), ctx)


def test_torch_launcher_input_errors():
    launcher = _TorchLauncher("two_shot", "g", torch.zeros(1024, dtype=torch.bfloat16), world_size=4)
    with pytest.raises(BackendError, match=r"\(3, 5\) torch.float32 on cpu"):
        launcher(torch.zeros(3, 5))
    with pytest.raises(BackendError, match="multiple of 64 bytes and at most 2048"):
        launcher(torch.zeros(40, dtype=torch.bfloat16))
    with pytest.raises(BackendError, match="multiple of 64 bytes and at most 2048"):
        launcher(torch.zeros(2048, dtype=torch.bfloat16))
    assert launcher(torch.zeros(0, dtype=torch.bfloat16)).numel() == 0


def test_nccl_launcher_calls_all_reduce(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda x, op=None, group=None: calls.append((x, op, group)))
    group = object()
    x = torch.ones(4)
    assert nccl.prepare(_problem(), None, RunContext(group=group))(x) is x
    assert calls == [(x, torch.distributed.ReduceOp.SUM, group)]


# --------------------------------------------------------------------------------------------
# Launchers end to end (interpreter)
# --------------------------------------------------------------------------------------------

@requires_interpreter
@pytest.mark.parametrize("world_size, dtype, numel", [(2, torch.bfloat16, 1000), (4, torch.float32, 4099),
                                                      (4, torch.float16, 7)])
def test_one_shot_launcher(world_size, dtype, numel):
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    wss = simulated_workspaces(world_size, all_reduce_bytes=1 << 16, moe_bytes=256)
    cfg = AllReduceConfig("one_shot", 256, 3, 4)
    problem = _problem(1 << 15, name, world_size)  # a bucket larger than the call: any size that fits
    launchers = [triton_one_shot.prepare(problem, cfg, RunContext(workspace=ws)) for ws in wss]
    inputs = random_inputs(world_size, numel, dtype, seed=11)
    nbytes = numel * inputs[0].element_size()
    for ws, values in zip(wss, inputs):  # ranks run in turn: pre-stage where the launcher stages
        ws.local_view("all_reduce", (numel,), dtype, stage_offset(ws.capacity("all_reduce"), nbytes)).copy_(values)
    expected = preset([ws.buffer for ws in wss], 3, 2)
    xs = [v.clone() for v in inputs]
    for launcher, x in zip(launchers, xs):
        assert launcher(x) is x
    for x, ws, want in zip(xs, wss, expected):
        assert_close_to_sum(x, inputs, dtype)
        assert torch.equal(pads(ws.buffer), want)


@requires_interpreter
def test_one_shot_launcher_zero_copy():
    world_size, numel = 4, 1500
    wss = simulated_workspaces(world_size, all_reduce_bytes=1 << 16, moe_bytes=256)
    for ws in wss:
        ws.empty((100,), torch.bfloat16)  # an earlier live tensor: x is at a non-zero offset
    xs = [ws.empty((numel,), torch.bfloat16) for ws in wss]
    inputs = random_inputs(world_size, numel, torch.bfloat16, seed=5)
    for x, values in zip(xs, inputs):
        x.copy_(values)
    cfg = AllReduceConfig("one_shot", 512, 2, 4)  # 3 chunks: program 0 has 2 rounds, program 1 one
    for ws in wss:
        view = pads(ws.buffer)
        view[0, :world_size], view[1, :world_size] = 3, 2
        view[:, ws.rank] = 0
    snapshots = [snapshot_workspace(wss, r) for r in range(world_size)]
    for ws, x in zip(snapshots, xs):
        triton_one_shot.prepare(_problem(numel * 2, "bf16", world_size), cfg, RunContext(workspace=ws))(x)
    for x in xs:
        assert_close_to_sum(x, inputs, torch.bfloat16)
    assert all(int(pads(ws.buffer).count_nonzero()) == 0 for ws in wss)


@requires_interpreter
@pytest.mark.parametrize("zero_copy", [False, True])
def test_two_shot_launcher_by_phase(zero_copy):
    world_size, numel, dtype = 4, 3001, torch.float16
    wss = simulated_workspaces(world_size, all_reduce_bytes=1 << 16, moe_bytes=256)
    cfg = AllReduceConfig("two_shot", 256, 2, 4)
    launchers = [triton_two_shot.prepare(_problem(8192, "fp16", world_size), cfg, RunContext(workspace=ws))
                 for ws in wss]
    inputs = random_inputs(world_size, numel, dtype, seed=2)
    xs = [ws.empty((numel,), dtype) if zero_copy else torch.empty(numel, dtype=dtype) for ws in wss]
    for x, values in zip(xs, inputs):
        x.copy_(values)
    expected = preset([ws.buffer for ws in wss], 2, 2 if zero_copy else 3)  # staged: + the end barrier
    for phase in (1, 2, 3):
        for launcher, x in zip(launchers, xs):
            launcher.run(x, phase=phase)
    for x, ws, want in zip(xs, wss, expected):
        assert_close_to_sum(x, inputs, dtype)
        assert torch.equal(pads(ws.buffer), want)


@requires_interpreter
@pytest.mark.parametrize("backend", [triton_one_shot, triton_two_shot])
def test_world_size_one_and_empty_tensors_need_no_launch(backend):
    (ws,), launcher = _launcher(backend, world_size=1)
    x = torch.randn(100).to(torch.bfloat16)
    before = x.clone()
    assert launcher(x) is x and torch.equal(x, before)
    _, launcher = _launcher(backend, world_size=2)
    empty = torch.empty(0, dtype=torch.bfloat16)
    assert launcher(empty) is empty
    assert launcher.workspace.buffer.count_nonzero() == 0  # no signal was sent


# --------------------------------------------------------------------------------------------
# LeanLauncher
# --------------------------------------------------------------------------------------------

class _FakeCompiled:
    """What LeanLauncher uses of a triton CompiledKernel."""

    def __init__(self):
        self.runs, self.runner_calls = [], []
        self.function, self.packed_metadata = "function", "metadata"

    def run(self, *args):
        self.runs.append(args)

    def __getitem__(self, grid):
        return lambda *args: self.runner_calls.append((grid, args))


class _FakeKernel:
    arg_names = ["x", "n", "A", "B"]

    def __init__(self):
        self.slow_calls = []
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setattr(launch_mod, "interpreter_active", lambda: False)
    monkeypatch.setattr(launch_mod, "_stream_source", lambda: ((lambda device: f"stream{device}"), 3))


def test_lean_launcher_fast_path(no_interpreter):
    kernel = _FakeKernel()
    lean = LeanLauncher(kernel, (5,), {"B": 2, "A": 1}, num_warps=4)
    assert lean.fast and not lean.is_bound
    lean("x0", 10)
    assert kernel.slow_calls == [((5, 1, 1), ("x0", 10), {"B": 2, "A": 1, "num_warps": 4})]
    assert lean.is_bound
    lean("x1", 11)  # straight to CompiledKernel.run: current stream, constexprs in signature order
    assert kernel.compiled.runs == [(5, 1, 1, "stream3", "function", "metadata", None, None, None, "x1", 11, 1, 2)]
    import triton

    def hook(*args):
        pass

    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        lean("x2", 12)  # a launch hook is registered: through CompiledKernel[grid], which feeds it
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert kernel.compiled.runner_calls == [((5, 1, 1), ("x2", 12, 1, 2))]
    lean("x3", 13)
    assert len(kernel.compiled.runs) == 2 and len(kernel.slow_calls) == 1


def test_lean_launcher_falls_back(monkeypatch):
    monkeypatch.setattr(launch_mod, "interpreter_active", lambda: True)
    kernel = _FakeKernel()
    lean = LeanLauncher(kernel, (1,), {"A": 1, "B": 2})
    assert not lean.fast
    for _ in range(3):
        lean("x", 1)
    assert len(kernel.slow_calls) == 3 and not kernel.compiled.runs
    monkeypatch.setattr(launch_mod, "interpreter_active", lambda: False)
    kernel = _FakeKernel()
    kernel.compiled = None  # e.g. a triton whose launch returns nothing usable
    lean = LeanLauncher(kernel, (1,), {"A": 1, "B": 2})
    lean("x", 1)
    lean("x", 1)
    assert len(kernel.slow_calls) == 2 and not lean.is_bound
    assert not LeanLauncher(kernel, (1,), {"A": 1}).fast  # constexprs must be the trailing params
    kernel = _FakeKernel()
    monkeypatch.setattr(launch_mod, "_stream_source", lambda: 1 / 0)  # no usable driver
    lean = LeanLauncher(kernel, (1,), {"A": 1, "B": 2})
    lean("x", 1)
    lean("x", 1)
    assert len(kernel.slow_calls) == 2 and not lean.is_bound


@pytest.mark.parametrize("backend", [triton_one_shot, triton_two_shot])
def test_bound_launches_pass_int_addresses(backend, monkeypatch):
    """After the first launch, a launcher calls the bound kernel with int addresses, same sizes."""
    import autosymm.backends.triton_all_reduce as tar

    calls = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            self.direct = None

        def __call__(self, *args):
            calls.append(("slow", args))
            self.direct = lambda *a: calls.append(("direct", a))

    monkeypatch.setattr(tar, "LeanLauncher", FakeLean)
    wss, launcher = _launcher(backend, world_size=4, dtype="fp16")
    x = torch.zeros(1001, dtype=torch.float16)
    launcher(x)
    launcher(x)
    (kind0, slow), (kind1, direct) = calls
    assert (kind0, kind1) == ("slow", "direct")
    assert slow[0] is x and slow[1] is launcher.region_ptrs and slow[2] is launcher.signal_ptrs
    assert direct[:3] == (x.data_ptr(), launcher.region_ptrs.data_ptr(), launcher.signal_ptrs.data_ptr())
    assert slow[3:] == direct[3:]
    offset = stage_offset(wss[0].capacity("all_reduce"), 2002)
    if backend is triton_one_shot:
        assert direct[3:] == (1001, offset, 0)  # no double buffering: the half size is 0 (ignored)
    else:
        assert direct[3:] == (1001, offset, segment_vecs(1001, 4, 2), 0)


def test_staging_never_overwrites_empty_tensors():
    wss, launcher = _launcher(triton_one_shot)  # 64 KiB region
    wss[0].empty((20000,), torch.bfloat16)  # 40000 bytes from the bottom
    with pytest.raises(BackendError, match="overwrite the 40192 bytes handed out by autosymm.empty"):
        launcher(torch.zeros(16000, dtype=torch.bfloat16))  # 32000 bytes staged from the top: they would meet


# --------------------------------------------------------------------------------------------
# Double buffering: which kernel a call takes, and calls end to end
# --------------------------------------------------------------------------------------------

@pytest.fixture
def recorded_launches(monkeypatch):
    """Launches recorded instead of run: (constexprs, args) per call."""
    import autosymm.backends.triton_all_reduce as tar

    calls = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            self.constexprs, self.direct = constexprs, None

        def __call__(self, *args):
            calls.append((self.constexprs, args))

    monkeypatch.setattr(tar, "LeanLauncher", FakeLean)
    return calls


def _double_launcher(world_size=2, half=4096, region=1 << 16, rank=0):
    wss = simulated_workspaces(world_size, all_reduce_bytes=region, moe_bytes=256, double_buffer_bytes=half)
    cfg = AllReduceConfig("one_shot", 256, 2, 4, double_buffer=True)
    return wss, triton_one_shot.prepare(_problem(4096, "bf16", world_size), cfg, RunContext(workspace=wss[rank]))


def test_double_buffer_takes_the_halves_up_to_their_size(recorded_launches):
    wss, launcher = _double_launcher(half=4096)
    ws = wss[0]
    double_offset = ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset
    launcher(torch.zeros(2048, dtype=torch.bfloat16))  # 4096 bytes: fits a half
    launcher(torch.zeros(2049, dtype=torch.bfloat16))  # one element more: single buffer, end barrier
    ws.empty((64,), torch.bfloat16)
    launcher(ws.empty((100,), torch.bfloat16))  # zero-copy: in place, as without double buffering
    (fits, args_fits), (big, args_big), (zc, args_zc) = recorded_launches
    assert fits["DOUBLE_BUFFER"] and not fits["ZERO_COPY"]
    assert args_fits[3:] == (2048, double_offset, 4096)
    assert not big["DOUBLE_BUFFER"] and not big["ZERO_COPY"]
    assert args_big[3:] == (2049, stage_offset(ws.capacity("all_reduce"), 4098), 4096)
    assert not zc["DOUBLE_BUFFER"] and zc["ZERO_COPY"] and args_zc[3:] == (100, 256, 4096)


def test_double_buffer_fallback_keeps_every_size_that_worked(recorded_launches):
    """The size limits are the single-buffer ones: a tensor too large for a half (or a workspace
    without the double-buffer region) is served by the single-buffer kernel, and the guard
    against empty()'s tensors only applies to that path's stage."""
    wss, launcher = _double_launcher(half=4096, region=1 << 16)
    launcher(torch.zeros(32768, dtype=torch.bfloat16))  # the whole all-reduce region
    assert not recorded_launches[-1][0]["DOUBLE_BUFFER"]
    with pytest.raises(BackendError, match="at most 65536 fit"):
        launcher(torch.zeros(32769, dtype=torch.bfloat16))
    wss[0].empty((30000,), torch.bfloat16)  # 60000 bytes handed out from the bottom of the region
    launcher(torch.zeros(2048, dtype=torch.bfloat16))  # double-buffered: not in the all-reduce region
    assert recorded_launches[-1][0]["DOUBLE_BUFFER"]
    with pytest.raises(BackendError, match="overwrite the 60160 bytes"):
        launcher(torch.zeros(4000, dtype=torch.bfloat16))  # single buffer: would reach empty()'s tensors
    (ws,) = simulated_workspaces(1, all_reduce_bytes=4096, moe_bytes=256, double_buffer_bytes=0)
    assert ws.double_buffer_half_bytes == 0 and DOUBLE_BUFFER_REGION not in ws.regions
    no_region = SimpleNamespace(**{k: getattr(wss[0], k) for k in (
        "device", "rank", "capacity", "buffer", "regions", "region_ptrs", "signal_ptrs", "multicast_ptr",
        "empty_bytes")}, world_size=2, double_buffer_half_bytes=0)
    launcher = triton_one_shot.prepare(_problem(4096, "bf16", 2), AllReduceConfig("one_shot", 256, 2, 4, True),
                                       RunContext(workspace=no_region))
    launcher(torch.zeros(16, dtype=torch.bfloat16))
    assert not recorded_launches[-1][0]["DOUBLE_BUFFER"]


def test_a_tensor_inside_the_double_buffer_is_refused(recorded_launches):
    wss, launcher = _double_launcher(half=4096)
    x = wss[0].local_view(DOUBLE_BUFFER_REGION, (100,), torch.bfloat16, 4096)
    with pytest.raises(BackendError, match="lies in the all-reduce double buffer"):
        launcher(x)
    assert not recorded_launches


@requires_interpreter
def test_double_buffer_launchers_alternate_halves_across_configs():
    """Back-to-back calls through launchers of different double-buffered configs (grids) and a
    single-buffer fallback in between: the sums are right, each double-buffered call stages in
    the half its epoch picks, the epoch counts only those calls."""
    world_size, dtype = 3, torch.float16
    wss = simulated_workspaces(world_size, all_reduce_bytes=1 << 15, moe_bytes=256, double_buffer_bytes=4096)
    problem = _problem(4096, "fp16", world_size)
    configs = [AllReduceConfig("one_shot", 256, 3, 4, True), AllReduceConfig("one_shot", 512, 1, 4, True)]
    launchers = {c: [triton_one_shot.prepare(problem, c, RunContext(workspace=ws)) for ws in wss] for c in configs}
    # (config, numel, double-buffered?): 2049 fp16 elements do not fit a 4096-byte half
    calls = [(configs[0], 1000, True), (configs[1], 2049, False), (configs[1], 2048, True), (configs[0], 7, True)]
    n_double = 0
    for k, (config, numel, double) in enumerate(calls):
        inputs = random_inputs(world_size, numel, dtype, seed=k)
        parity = n_double % 2
        for ws, values in zip(wss, inputs):  # ranks run in turn: pre-stage where each will stage
            if double:
                half_view(ws, parity, numel, dtype).copy_(values)
            else:
                offset = stage_offset(ws.capacity("all_reduce"), numel * 2)
                ws.local_view("all_reduce", (numel,), dtype, offset).copy_(values)
        expected = preset([ws.buffer for ws in wss], config.num_blocks, 1 if double else 2)
        xs = [v.clone() for v in inputs]
        for launcher, x in zip(launchers[config], xs):
            assert launcher(x) is x
        n_double += double
        for x, ws, want in zip(xs, wss, expected):
            assert_close_to_sum(x, inputs, dtype)
            assert epoch(ws) == ws.double_buffer_epoch() == n_double and arrivals(ws) == 0
            want[ALL_REDUCE_EPOCH_SLOT, ws.rank] = n_double
            assert torch.equal(pads(ws.buffer), want)
    wss[0].reset_signals()
    assert epoch(wss[0]) == 0, "reset_signals zeroes the epoch with the pads"


@pytest.mark.parametrize("backend, dtype, numel, tail", [
    (triton_one_shot, torch.bfloat16, 1000, 8), (triton_one_shot, torch.bfloat16, 1001, 1),
    (triton_one_shot, torch.float32, 1000, 4), (triton_one_shot_push, torch.bfloat16, 4104, 8),
    (triton_one_shot_push, torch.float16, 4099, 1), (triton_two_shot, torch.bfloat16, 1000, 1)])
def test_the_one_shots_are_told_a_numel_of_whole_16_byte_vectors(backend, dtype, numel, tail):
    """The variant key's last field is the kernels' TAIL: 16 bytes' worth of elements when numel
    is a multiple of it (masked tails keep 128-bit accesses), else 1; the two-shot has its own."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    ws = simulated_workspaces(2, all_reduce_bytes=1 << 16, moe_bytes=256)[0]
    config = next(iter(backend.search_space(_problem(1 << 14, name, 2))))
    launcher = backend.prepare(_problem(1 << 14, name, 2), config, RunContext(workspace=ws))
    key, _, sizes = launcher._plan(torch.zeros(numel, dtype=dtype), 0)
    assert key[-1] == tail and sizes[0] == numel

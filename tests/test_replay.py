"""autosymm.runtime.replay: which calls get a plan, when a graph is captured, the LRU cap, the opt-out,
and bound launches of the Triton all-reduce launcher (fake graphs and launches on the CPU)."""

from types import SimpleNamespace

import pytest
import torch

from autosymm.runtime import replay
from autosymm.backends.base import BackendError, RunContext
from autosymm.backends.triton_all_reduce import triton_one_shot, triton_one_shot_push, triton_two_shot
from autosymm.configs import AllReduceConfig
from autosymm.runtime.dispatch import Decision
from autosymm.problem import Problem
from autosymm.workspace.symm import simulated_workspaces

EAGER = Decision("triton_one_shot", None, "test", mode="eager")


class FakeLauncher:
    """Records calls: ("call", addr) through the checks, ("bound", addr) of a bound launch."""

    def __init__(self, device="cpu"):
        self.workspace = SimpleNamespace(device=torch.device(device), empty_bytes=0)
        self.log = []

    def __call__(self, x):
        if x.dtype is not torch.bfloat16:
            raise BackendError(f"dtype {x.dtype}")
        self.log.append(("call", x.data_ptr()))
        return x

    def bind(self, x):
        if x.dtype is not torch.bfloat16:
            raise BackendError(f"dtype {x.dtype}")
        addr = x.data_ptr()
        return lambda: self.log.append(("bound", addr))


class FakeGraph:
    def __init__(self, launch, log):
        self.launch, self.log = launch, log

    def replay(self):
        self.log.append("replay")
        self.launch()


def _wrapped(max_graphs=4, capture_after=2, fail=False):
    launcher = FakeLauncher()
    captured = []

    def capture(launch, device):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured.append(device)
        return FakeGraph(launch, launcher.log)  # capturing records, it does not run the launch

    return launcher, captured, replay.wrap_eager(launcher, EAGER, capture=capture, max_graphs=max_graphs,
                                                 capture_after=capture_after)


def test_a_repeated_address_is_captured_then_replayed():
    launcher, captured, wrapped = _wrapped()
    x = torch.zeros(64, dtype=torch.bfloat16)
    addr = x.data_ptr()
    assert wrapped(x) is x and launcher.log == [("call", addr)]  # first call: the launcher, checked
    assert wrapped(x) is x and len(captured) == 1  # second: captured, then replayed once
    assert launcher.log[1:] == ["replay", ("bound", addr)]
    wrapped(x)
    assert launcher.log[3:] == ["replay", ("bound", addr)] and len(captured) == 1 and wrapped.captures == 1
    y = torch.zeros(64, dtype=torch.bfloat16)  # another address starts over
    wrapped(y)
    assert launcher.log[-1] == ("call", y.data_ptr()) and len(captured) == 1


def test_capture_after_one_captures_at_once():
    launcher, captured, wrapped = _wrapped(capture_after=1)
    x = torch.zeros(8, dtype=torch.bfloat16)
    wrapped(x)
    assert captured and launcher.log == ["replay", ("bound", x.data_ptr())]


def test_graphs_are_capped_least_recently_used_first():
    launcher, captured, wrapped = _wrapped(max_graphs=2, capture_after=1)
    a, b, c = (torch.zeros(8, dtype=torch.bfloat16) for _ in range(3))
    wrapped(a), wrapped(b), wrapped(a)  # b is now the least recently used
    wrapped(c)
    assert len(captured) == 3 and wrapped.evictions == 1
    assert list(wrapped._plans) == [a.data_ptr(), c.data_ptr()]
    wrapped(a)
    assert len(captured) == 3  # still cached
    wrapped(b)
    assert len(captured) == 4 and b.data_ptr() in wrapped._plans


def test_thrashing_stops_captures_and_binds_instead():
    launcher, captured, wrapped = _wrapped(max_graphs=2, capture_after=1)
    tensors = [torch.zeros(8, dtype=torch.bfloat16) for _ in range(5)]
    for t in tensors[:4]:
        wrapped(t)
    assert len(captured) == 4 and wrapped.evictions == 2 and not wrapped.capturing
    wrapped(tensors[4])  # no graph: checked launch, then planned as its bound launch
    assert launcher.log[-1] == ("call", tensors[4].data_ptr())
    wrapped(tensors[4])  # planned: the bound launch alone
    assert launcher.log[-1] == ("bound", tensors[4].data_ptr()) and len(captured) == 4


def test_opt_out_env_binds_without_graphs(monkeypatch):
    monkeypatch.setenv("AUTOSYMM_EAGER_REPLAY", "0")
    assert not replay.replay_enabled()
    launcher = FakeLauncher()
    wrapped = replay.wrap_eager(launcher, EAGER, capture=lambda launch, device: pytest.fail("captured"))
    assert isinstance(wrapped, replay.EagerReplay) and not wrapped.capturing
    x = torch.zeros(8, dtype=torch.bfloat16)
    for _ in range(3):
        wrapped(x)
    addr = x.data_ptr()
    assert launcher.log == [("call", addr), ("call", addr), ("bound", addr)]  # bound after a repeat


def test_cpu_launchers_get_no_graphs_by_default(monkeypatch):
    monkeypatch.delenv("AUTOSYMM_EAGER_REPLAY", raising=False)
    assert replay.wrap_eager(FakeLauncher(), EAGER).capture is None
    assert replay.wrap_eager(FakeLauncher("cuda"), EAGER).capture is replay.capture_cuda_graph


def test_a_direct_launch_row_binds_without_graphs():
    """An eager row whose config says eager_launch='direct' (the kernel bounds its loop): bound
    launches, never a graph, however replay is set; the replayed row (the default) captures."""
    import dataclasses

    config = AllReduceConfig("one_shot", 256, 2, 4)
    direct = Decision("triton_one_shot", dataclasses.replace(config, eager_launch="direct"), "test", mode="eager")
    launcher = FakeLauncher()
    wrapped = replay.wrap_eager(launcher, direct, capture=lambda launch, device: pytest.fail("captured"))
    assert isinstance(wrapped, replay.EagerReplay) and wrapped.capture is None and not wrapped.capturing
    x = torch.zeros(8, dtype=torch.bfloat16)
    for _ in range(3):
        wrapped(x)
    assert launcher.log == [("call", x.data_ptr()), ("call", x.data_ptr()), ("bound", x.data_ptr())]
    replayed = Decision("triton_one_shot", config, "test", mode="eager")
    assert replay.wrap_eager(FakeLauncher("cuda"), replayed).capture is replay.capture_cuda_graph
    assert replay.wrap_eager(FakeLauncher("cuda"), direct).capture is None
    assert replay.eager_launch(direct.config) == "direct" and replay.eager_launch(None) == "replay"


@pytest.mark.parametrize("decision", [
    Decision("nccl", None, "test", mode="eager"),
    Decision("torch_two_shot", None, "test", mode="eager"),
    Decision("triton_one_shot", None, "test", mode="graph"),
])
def test_other_decisions_keep_their_launcher(decision):
    launcher = FakeLauncher()
    assert replay.wrap_eager(launcher, decision) is launcher


def test_launchers_without_bind_are_left_alone():
    def moe_launcher(src, assignment, expt_indx, indx):
        return src

    assert replay.wrap_eager(moe_launcher, Decision("triton_moe", None, "test", mode="eager")) is moe_launcher


def test_empty_bytes_change_drops_every_plan():
    launcher, captured, wrapped = _wrapped(capture_after=1)
    x = torch.zeros(8, dtype=torch.bfloat16)
    wrapped(x)
    launcher.workspace.empty_bytes = 4096  # autosymm.empty handed out more of the region
    wrapped(x)
    assert len(captured) == 2 and launcher.log[-2:] == ["replay", ("bound", x.data_ptr())]
    assert len(wrapped._plans) == 1


def test_failed_capture_turns_replay_off_and_still_launches(caplog):
    launcher, captured, wrapped = _wrapped(fail=True)
    x = torch.zeros(8, dtype=torch.bfloat16)
    wrapped(x)
    with caplog.at_level("WARNING", logger="autosymm"):
        wrapped(x)
    assert "eager replay off" in caplog.text and wrapped.capture is None
    assert launcher.log == [("call", x.data_ptr()), ("bound", x.data_ptr())]
    wrapped(x)
    assert launcher.log[-1] == ("bound", x.data_ptr())


def test_errors_of_the_launcher_reach_the_caller():
    launcher, captured, wrapped = _wrapped()
    bad = torch.zeros(8, dtype=torch.float16)
    for _ in range(3):
        with pytest.raises(BackendError, match="dtype"):
            wrapped(bad)
    assert not captured and not wrapped._plans


def test_a_tensor_on_another_device_goes_through_the_checks():
    launcher, captured, wrapped = _wrapped(capture_after=1)
    x = torch.zeros(8, dtype=torch.bfloat16)
    wrapped(x)
    wrapped.device_index = 0  # as if the launcher served cuda:0 and x were elsewhere
    wrapped(x)
    assert launcher.log[-1] == ("call", x.data_ptr()) and len(captured) == 1


def test_bad_settings():
    with pytest.raises(ValueError, match="max_graphs=0"):
        replay.EagerReplay(FakeLauncher(), None, max_graphs=0)


# --------------------------------------------------------------------------------------------
# The Triton all-reduce launcher's bound launch
# --------------------------------------------------------------------------------------------

@pytest.fixture
def direct_launches(monkeypatch):
    """LeanLaunchers that bind at once and record their direct launches."""
    import autosymm.backends.triton_all_reduce as tar

    calls = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            self.direct = None
            self.constexprs = constexprs

        def __call__(self, *args):
            self.direct = lambda *a: calls.append((self.constexprs, a))
            self.direct(args[0].data_ptr(), args[1].data_ptr(), args[2].data_ptr(), *args[3:])

    monkeypatch.setattr(tar, "LeanLauncher", FakeLean)
    return calls


@pytest.mark.parametrize("backend, double", [(triton_one_shot, False), (triton_one_shot, True),
                                             (triton_two_shot, False), (triton_one_shot_push, True)])
def test_bound_launch_is_the_checked_launch(backend, double, direct_launches):
    wss = simulated_workspaces(2, all_reduce_bytes=1 << 16, moe_bytes=256, double_buffer_bytes=8192)
    algorithm = backend.name.removeprefix("triton_")
    config = AllReduceConfig(algorithm, 256, 2, 4, double_buffer=double)
    launcher = backend.prepare(Problem.all_reduce(2000, "bf16", 2), config, RunContext(workspace=wss[0]))
    tensors = [torch.zeros(1000, dtype=torch.bfloat16)]
    if backend is not triton_one_shot_push:
        tensors.append(wss[0].empty((1000,), torch.bfloat16))  # zero-copy
    for x in tensors:
        assert launcher.bind(x) is None  # the variant is not bound before its first call
        launcher(x)
        checked = direct_launches[-1]
        launcher(x)  # no host state may change between calls: a graph of the first must serve later ones
        assert direct_launches[-1] == checked
        launch = launcher.bind(x)
        launch()
        assert direct_launches[-1] == checked
    with pytest.raises(BackendError, match="dtype"):
        launcher.bind(torch.zeros(1000, dtype=torch.float16))
    assert launcher.bind(torch.zeros(0, dtype=torch.bfloat16)) is None  # nothing to launch


def test_wrapped_triton_launcher_plans_per_address(direct_launches):
    wss = simulated_workspaces(2, all_reduce_bytes=1 << 16, moe_bytes=256)
    config = AllReduceConfig("one_shot", 256, 2, 4)
    launcher = triton_one_shot.prepare(Problem.all_reduce(2000, "bf16", 2), config, RunContext(workspace=wss[0]))
    wrapped = replay.wrap_eager(launcher, EAGER)  # CPU: bound launches, no graphs
    x = torch.zeros(1000, dtype=torch.bfloat16)
    for _ in range(3):
        wrapped(x)
    assert len(direct_launches) == 3 and len({args for _, args in direct_launches}) == 1
    assert list(wrapped._plans) == [x.data_ptr()]
    wss[0].empty((15000,), torch.bfloat16)  # 30 KB handed out: staging 2000 bytes at the top still fits
    wrapped(x)
    assert len(direct_launches) == 4 and not wrapped._plans  # replanned through the checks
    wrapped(x)
    assert list(wrapped._plans) == [x.data_ptr()]
    wss[0].empty((17000,), torch.bfloat16)  # 64000 bytes handed out: the stage would overlap them
    with pytest.raises(BackendError, match="overwrite"):
        wrapped(x)


def test_replay_function_skips_python_wrappers():
    class CGraph(dict):  # a C-level method, as torch._C._CUDAGraph.replay
        replay = dict.clear

    class PyGraph(CGraph):  # torch.cuda.CUDAGraph's Python wrapper around it
        def replay(self):
            raise AssertionError("the Python wrapper ran")

    graph = PyGraph(a=1)
    replay.replay_function(graph)()
    assert not graph
    fake = FakeGraph(lambda: None, [])
    assert replay.replay_function(fake) == fake.replay  # nothing below a Python method: as is

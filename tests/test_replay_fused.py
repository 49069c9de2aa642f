"""autosymm.runtime.replay.FusedReplay: the fused op's eager calls planned per (x, residual, weight, out)
addresses and eps, on the real fused launcher of simulated ranks with recorded (fake) launches and
graphs on the CPU: every plan writes the output its call returns, bad tensors reach the launcher's
checks, and the launch style of the config (eager_launch) decides graphs or bound launches."""

import dataclasses

import pytest
import torch

from autosymm.runtime import replay
from autosymm.backends.base import BackendError, RunContext
from autosymm.backends.triton_fused import triton_fused_one_shot, triton_fused_one_shot_push, triton_fused_two_shot
from autosymm.configs import FusedConfig
from autosymm.runtime.dispatch import Decision
from autosymm.problem import Problem
from autosymm.workspace.symm import simulated_workspaces

HIDDEN = 256


@pytest.fixture
def launches(monkeypatch):
    """LeanLaunchers of the fused family that bind at once and record their launches' arguments
    (int addresses first: x, residual, weight, out)."""
    import autosymm.backends.triton_fused as tf

    calls = []

    class FakeLean:
        def __init__(self, fn, grid, constexprs, **options):
            self.direct = None

        def __call__(self, *args):
            self.direct = lambda *a: calls.append(a)
            self.direct(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))

    monkeypatch.setattr(tf, "LeanLauncher", FakeLean)
    return calls


class FakeGraph:
    def __init__(self, launch):
        self.replay = launch  # a capture records the launch, a replay runs it


def _launcher(backend=triton_fused_one_shot, n_tokens=4, **config):
    (ws,) = simulated_workspaces(1, all_reduce_bytes=1 << 16, moe_bytes=256, double_buffer_bytes=1 << 14)
    config = FusedConfig(backend.algorithm, HIDDEN, 4, 2, **config)
    problem = Problem.all_reduce_rmsnorm(n_tokens, HIDDEN, "bf16", 1)
    return backend.prepare(problem, config, RunContext(workspace=ws)), config


def _wrapped(launcher, config, captured):
    def capture(launch, device):
        captured.append(launch)
        return FakeGraph(launch)

    decision = Decision(f"triton_fused_{config.algorithm}", config, "test", mode="eager")
    return replay.wrap_eager(launcher, decision, capture=capture)


def _tensors(n_tokens=4):
    x = torch.randn(n_tokens, HIDDEN).to(torch.bfloat16)
    return x, torch.randn(n_tokens, HIDDEN).to(torch.bfloat16), torch.ones(HIDDEN, dtype=torch.bfloat16)


def test_the_fused_launcher_gets_a_fused_replay(launches):
    launcher, config = _launcher()
    wrapped = _wrapped(launcher, config, [])
    assert isinstance(wrapped, replay.FusedReplay) and wrapped.max_graphs == replay.FUSED_MAX_GRAPHS
    assert replay.wrap_eager(launcher, Decision("triton_fused_one_shot", config, "t", mode="graph")) is launcher


def test_an_epilogue_launcher_is_not_replayed(launches):
    """FusedReplay plans the default epilogue's call (one out of x's dtype); another epilogue's
    launcher runs as it is, and serves its call."""
    from autosymm.epilogue import Epilogue

    (ws,) = simulated_workspaces(1, all_reduce_bytes=1 << 16, moe_bytes=256, double_buffer_bytes=1 << 14)
    config = FusedConfig("one_shot", HIDDEN, 4, 2)
    problem = Problem.all_reduce_rmsnorm(4, HIDDEN, "bf16", 1, epilogue=Epilogue(quant="fp8"))
    launcher = triton_fused_one_shot.prepare(problem, config, RunContext(workspace=ws))
    assert _wrapped(launcher, config, []) is launcher
    x, residual, weight = _tensors()
    out = launcher(x, residual, weight, 1e-6, scale=torch.tensor(1.0))
    assert out.dtype == torch.float8_e4m3fn and len(launches) == 1


@pytest.mark.parametrize("backend", [triton_fused_one_shot, triton_fused_one_shot_push, triton_fused_two_shot])
def test_bound_launch_is_the_checked_launch(backend, launches):
    launcher, _ = _launcher(backend)
    x, residual, weight = _tensors()
    out = torch.empty_like(x)
    assert launcher.bind(x, residual, weight, out) is None  # not bound before its first call
    launcher(x, residual, weight, 1e-5, out=out)
    checked = launches[-1]
    assert checked[:4] == (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr())
    launcher.bind(x, residual, weight, out, 1e-5)()
    assert launches[-1] == checked
    with pytest.raises(BackendError, match="residual strides"):
        launcher.bind(x, residual.t().contiguous().t(), weight, out)
    assert launcher.bind(x[:0], residual[:0], weight, out[:0]) is None  # no rows: nothing to launch


def test_every_plan_writes_the_output_its_call_returns(launches):
    """Outputs held by the caller and outputs dropped (whose blocks the allocator hands out
    again): whatever the addresses, each call's launch writes the tensor it returns, and a
    repeated (x, residual, weight, out, eps) is captured once and replayed."""
    launcher, config = _launcher()
    captured = []
    wrapped = _wrapped(launcher, config, captured)
    x, residual, weight = _tensors()
    held = []
    for step in range(40):
        out = wrapped(x, residual, weight, 1e-6)
        assert out.shape == x.shape and out.dtype is x.dtype
        assert launches[-1][3] == out.data_ptr() and launches[-1][:3] == (x.data_ptr(), residual.data_ptr(),
                                                                           weight.data_ptr())
        if step % 3 == 0:
            held.append(out)  # kept: the next output has another address
    assert len(launches) == 40  # one launch a call: a capture records it, it does not run it
    assert len(captured) == wrapped.captures == len(wrapped._plans) <= 40


def test_a_repeated_key_is_captured_once_then_replayed(launches, monkeypatch):
    launcher, config = _launcher()
    captured = []
    wrapped = _wrapped(launcher, config, captured)
    x, residual, weight = _tensors()
    out = torch.empty_like(x)
    monkeypatch.setattr(replay, "_empty_like", lambda t: out)  # the allocator hands the same block out
    for _ in range(5):
        assert wrapped(x, residual, weight) is out
    assert len(captured) == 1 and len(launches) == 5 and len(set(launches)) == 1
    wrapped(x, residual, weight, 1e-5)  # another eps: another key, through the checks
    assert len(captured) == 1 and launches[-1][-4] == 1e-5
    launcher.workspace.empty(((1 << 16) - 8192,), torch.uint8)  # staging limits moved: replanned
    wrapped(x, residual, weight)
    assert not wrapped._plans and len(captured) == 1


def test_bad_tensors_at_a_planned_key_reach_the_checks(launches, monkeypatch):
    launcher, config = _launcher()
    wrapped = _wrapped(launcher, config, [])
    x, residual, weight = _tensors()
    out = torch.empty_like(x)
    monkeypatch.setattr(replay, "_empty_like", lambda t: out)
    for _ in range(3):
        wrapped(x, residual, weight)
    assert wrapped._plans
    planned = len(launches)
    strided = torch.empty(HIDDEN * 2, dtype=torch.bfloat16)
    strided[: HIDDEN].copy_(weight)
    view = torch.as_strided(strided, (HIDDEN,), (2,))  # weight's shape, not contiguous
    bad = [(x, residual.float(), weight, "residual dtype"), (x, residual, view, "weight strides"),
           (x, residual.reshape(HIDDEN, 4)[:, :4].t(), weight, "residual strides")]
    for args in bad:
        with pytest.raises(BackendError, match=args[-1]):
            for _ in range(3):
                wrapped(*args[:3])
    assert len(launches) == planned


def test_direct_launch_style_binds_without_graphs(launches, monkeypatch):
    launcher, config = _launcher()
    direct = dataclasses.replace(config, eager_launch="direct")
    wrapped = _wrapped(launcher, direct, captured := [])
    assert wrapped.capture is None and not wrapped.capturing
    x, residual, weight = _tensors()
    out = torch.empty_like(x)
    monkeypatch.setattr(replay, "_empty_like", lambda t: out)
    for _ in range(4):
        wrapped(x, residual, weight)
    assert not captured and len(wrapped._plans) == 1 and len(set(launches)) == 1


def test_thrashing_keys_stop_captures_and_bind(launches, monkeypatch):
    launcher, config = _launcher()
    captured = []

    def capture(launch, device):
        captured.append(launch)
        return FakeGraph(launch)

    wrapped = replay.FusedReplay(launcher, capture, max_graphs=2, capture_after=1)
    x, residual, weight = _tensors()
    outs = [torch.empty_like(x) for _ in range(5)]
    for out in outs:
        monkeypatch.setattr(replay, "_empty_like", lambda t, out=out: out)
        assert wrapped(x, residual, weight) is out and launches[-1][3] == out.data_ptr()
    assert len(captured) == 4 and not wrapped.capturing and len(wrapped._plans) == 2


@pytest.fixture
def fused_group(tmp_path, monkeypatch, launches):
    """A 1-rank gloo world whose eager fused entry for bf16 [4, HIDDEN] runs a FusedReplay of the
    real launcher (fake launches); yields (autosymm, the entry, the wrapper)."""
    import torch.distributed as dist

    import autosymm
    from autosymm import api
    from autosymm.spec import ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT


    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    autosymm.reset()
    try:
        x, residual, weight = _tensors()
        autosymm.all_reduce_rmsnorm(x.clone(), residual.clone(), weight)  # prepares the entry (one rank: noop)
        entry = api.STATES[None].cache[call_key(ALL_REDUCE_RMSNORM, torch.bfloat16, x.shape, x.device, False, DEFAULT)]
        launcher, config = _launcher()
        entry.launcher = _wrapped(launcher, config, [])
        yield autosymm, entry, entry.launcher
    finally:
        autosymm.reset()
        dist.destroy_process_group()


def test_the_groups_last_eager_call_takes_the_hot_path(fused_group, monkeypatch):
    autosymm, entry, wrapped = fused_group
    from autosymm.collectives import all_reduce_rmsnorm as fused
    from autosymm.runtime import replay as rp

    x, residual, weight = _tensors()
    # The replay keys a plan by the output's address too: CUDA's caching allocator hands a freed
    # output's block back to the next call, the CPU's malloc may not (it depends on the heap).
    reused = torch.empty_like(x)
    monkeypatch.setattr(rp, "_empty_like", lambda t: reused)
    out = autosymm.all_reduce_rmsnorm(x, residual, weight)  # the key path: the entry becomes hot
    hot = rp.FUSED_HOT[None]
    assert (hot.entry, hot.call, hot.shape, hot.dtype) == (entry, wrapped, x.shape, torch.bfloat16)
    assert out.shape == x.shape
    keyed, states = [], fused.STATES
    spy = type("Spy", (dict,), {"get": lambda self, g: keyed.append(g) or states.get(g)})
    monkeypatch.setattr(fused, "STATES", spy())
    calls = entry.calls
    for _ in range(3):
        autosymm.all_reduce_rmsnorm(x, residual, weight)
    assert entry.calls == calls + 3 and not keyed and wrapped._plans  # no key, replayed
    autosymm.all_reduce_rmsnorm(x[:2].clone(), residual[:2].clone(), weight)  # another shape: the key path
    assert keyed == [None] and rp.FUSED_HOT[None].call is wrapped  # a plain launcher never becomes hot
    autosymm.reset()
    assert not rp.FUSED_HOT


def test_the_hot_path_refuses_aliased_arguments_before_any_launch(fused_group):
    """A hot call's plan is keyed by the three addresses it was checked at; any other addresses
    (a residual aliasing x, a weight inside x) go through the fused op's checks first."""
    autosymm, entry, wrapped = fused_group
    from autosymm.runtime import replay as rp

    x, residual, weight = _tensors()
    autosymm.all_reduce_rmsnorm(x, residual, weight)  # hot now
    assert rp.FUSED_HOT[None].call is wrapped
    before = len(wrapped._seen), dict(wrapped._plans)
    buffer = torch.zeros(8, HIDDEN, dtype=torch.bfloat16)
    for args in ((x, x, weight), (x, residual, x[1]), (buffer[:4], buffer[2:6], weight)):
        with pytest.raises(ValueError, match="must not overlap in memory"):
            autosymm.all_reduce_rmsnorm(*args)
    assert (len(wrapped._seen), dict(wrapped._plans)) == before  # nothing launched, planned or counted

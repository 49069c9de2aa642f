"""The fused op's eager calls replayed or bound (autosymm.runtime.replay.FusedReplay) on real GPUs, both
launch styles (eager_launch 'replay' | 'direct'): repeated calls with new data at the same x,
residual and weight, outputs dropped (the allocator hands their block out again: the same plan)
and outputs held (new addresses: other plans), checked launches and graph-mode captures of the
same launcher in between. Every result within one ulp of the kernels' fp32 sum (as
tests/gpu/test_fused_gpu.py), identical on every rank, and every output the caller still holds
unchanged by later calls (a plan writes only the tensor its call returns).

World size 1 is meaningful at the launcher level: the Triton fused kernels run on a one-rank
workspace (residual += x, then the norm), so graphs are captured and replayed at any world size.
The API level needs the group's workspace, which only world size >= 2 has (a one-rank group
decides NCCL's composition: checked as such); there it checks the group's hot call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus
from .test_fused_gpu import EPS, _check, _inputs, _setup

pytestmark = [requires_cuda, pytest.mark.gpu]

CASES = [(1, 8192, torch.bfloat16), (5, 4104, torch.float16), (64, 7168, torch.bfloat16)]


def _calls(run, raw, world_size, n_tokens, hidden, dtype, rank, name):
    """4 calls of ``run`` whose outputs are dropped (a repeated key: planned), then 12 with fresh
    data, checked; a checked launch of ``raw`` and a captured graph of it in between; every third
    output kept and compared at the end with its copy."""
    x = torch.empty(n_tokens, hidden, dtype=dtype, device="cuda")
    residual = torch.empty_like(x)
    xs, residual_in, weight = _inputs(world_size, n_tokens, hidden, dtype, seed=0)
    x.copy_(xs[rank])
    residual.copy_(residual_in)
    for _ in range(4):  # outputs dropped at once: the allocator hands the same block out, one key repeats
        run(x, residual, weight, EPS)
    held = []
    for step in range(12):
        xs, residual_in, _ = _inputs(world_size, n_tokens, hidden, dtype, seed=step + 1)
        x.copy_(xs[rank])
        residual.copy_(residual_in)
        if step == 6:  # graph mode of the same launcher, between the eager calls
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = raw(x, residual, weight, EPS)
            residual.copy_(residual_in)
            graph.replay()
        else:
            out = (raw if step == 4 else run)(x, residual, weight, EPS)
        try:
            _check(name, residual, out, xs, residual_in, weight)
        except AssertionError as err:
            raise AssertionError(f"{name} call {step}: {err}") from None
        if step % 3 == 0:
            held.append((step, out, out.clone()))
    for step, out, copy in held:
        assert torch.equal(out, copy), f"{name}: the output of call {step} was overwritten by a later call"


def _configs(backend, problem):
    """The first single-buffered config, the first double-buffered and the first split-row one."""
    space = backend.search_space(problem)
    picks = [next((c for c in space if not c.double_buffer and c.row_split == 1), None),
             next((c for c in space if c.double_buffer and c.row_split == 1), None),
             next((c for c in space if c.row_split > 1), None)]
    return [c for c in picks if c is not None]


def _launcher_body(rank, world_size):
    from autosymm.backends.triton_fused import BACKENDS
    from autosymm.runtime.dispatch import Decision
    from autosymm.problem import DTYPE_NAMES, Problem
    from autosymm.runtime.replay import FusedReplay, wrap_eager

    ws, caps, ctx, _ = _setup(rank, world_size)
    for n_tokens, hidden, dtype in CASES:
        problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, DTYPE_NAMES[dtype], world_size)
        for backend in BACKENDS:
            if backend.why_not(problem, caps, "eager") is not None:
                continue
            for config in _configs(backend, problem):
                for style in ("replay", "direct"):
                    config = dataclasses.replace(config, eager_launch=style)
                    raw = backend.prepare(problem, config, ctx)
                    wrapped = wrap_eager(raw, Decision(backend.name, config, "test", mode="eager"))
                    assert isinstance(wrapped, FusedReplay)
                    name = f"{backend.name} {config} {problem.describe()}"
                    _calls(wrapped, raw, world_size, n_tokens, hidden, dtype, rank, name)
                    assert wrapped._plans, f"{name}: nothing planned"
                    if style == "replay":
                        assert wrapped.captures >= 1 and wrapped.capture is not None, f"{name}: no graph"
                    else:
                        assert wrapped.captures == 0, f"{name}: a direct-launch row captured a graph"
                torch.cuda.synchronize()


def _api_body(rank, world_size):
    import autosymm
    from autosymm import api
    from autosymm.spec import ALL_REDUCE_RMSNORM, call_key
    from autosymm.epilogue import DEFAULT
    from autosymm.runtime import replay
    from autosymm.backends.triton_fused import triton_fused_one_shot

    from autosymm.runtime.dispatch import Decision

    autosymm.init()
    n_tokens, hidden, dtype = 4, 8192, torch.bfloat16
    x = torch.zeros(n_tokens, hidden, dtype=dtype, device="cuda")
    autosymm.all_reduce_rmsnorm(x.clone(), torch.zeros_like(x), torch.ones(hidden, dtype=dtype, device="cuda"))
    state = api.STATES[None]
    entry = state.cache[call_key(ALL_REDUCE_RMSNORM, dtype, x.shape, x.device, False, DEFAULT)]
    if world_size == 1:  # nothing to exchange: add + rms_norm, never wrapped, never hot
        assert entry.decision.backend == "noop" and not isinstance(entry.launcher, replay.FusedReplay)
        return
    if not isinstance(entry.launcher, replay.FusedReplay):  # the DB chose NCCL: wire a Triton row as prepare would
        problem = autosymm.Problem.all_reduce_rmsnorm(n_tokens, hidden, "bf16", world_size)
        config = triton_fused_one_shot.search_space(problem)[0]
        decision = Decision(triton_fused_one_shot.name, config, "test", mode="eager")
        entry.launcher = replay.wrap_eager(triton_fused_one_shot.prepare(problem, config, state.ctx), decision)
        replay.forget_all()
    raw = entry.launcher.launcher
    _calls(autosymm.all_reduce_rmsnorm, raw, world_size, n_tokens, hidden, dtype, rank, "autosymm.all_reduce_rmsnorm")
    hot = replay.FUSED_HOT[None]
    assert hot.call is entry.launcher and entry.launcher.captures >= 1
    autosymm.reset()


def test_fused_eager_calls_replayed_and_bound_match_the_reference():
    run_on_gpus(_launcher_body)


def test_the_public_fused_call_replays_eagerly():
    run_on_gpus(_api_body)

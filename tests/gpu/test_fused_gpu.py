"""The fused all-reduce + residual add + RMSNorm on real GPUs (one process per local GPU).

Every Triton variant (pull and push one-shot, single and double buffered; two-shot) and NCCL's
composition, a spread of each one's configs, odd token counts and hidden sizes: the residual
and the output within one ulp of the float64 reference (NCCL's composition, which rounds the sum
before the add: bf16-level), bit-identical on every rank; calls of different variants back to
back without a host sync; CUDA-graph capture replayed with new data; the public function and
its custom op, eager and captured.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

EPS = 1e-6
SHAPES = [(1, 8192), (3, 4104), (17, 5120), (128, 8192), (1000, 7168)]  # (tokens, hidden)


def _setup(rank, world_size):
    import torch.distributed as dist

    from autosymm.backends.base import Capabilities, RunContext
    from autosymm.backends.nccl_fused import BACKENDS as NCCL
    from autosymm.backends.triton_fused import BACKENDS as TRITON
    from autosymm.workspace.symm import get_workspace

    ws = get_workspace(dist.group.WORLD, torch.device("cuda", rank), all_reduce_bytes=160 << 20, moe_bytes=1 << 20)
    caps = Capabilities.of(world_size, workspace=ws, compute_capability=torch.cuda.get_device_capability())
    return ws, caps, RunContext(group=dist.group.WORLD, workspace=ws), TRITON + NCCL


def _inputs(world_size, n_tokens, hidden, dtype, seed):
    """Every rank's x (each rank makes all of them: the reference needs no collective), the
    replicated residual and weight."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(n_tokens, hidden, generator=gen, device="cuda").to(dtype) for _ in range(world_size)]
    residual = torch.randn(n_tokens, hidden, generator=gen, device="cuda").to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen, device="cuda")).to(dtype)
    return xs, residual, weight


def _check(name, residual, out, xs, residual_in, weight):
    import torch.distributed as dist

    from _fused_ref import check, reference

    if name in ("nccl_fused", "noop"):  # torch's add and norm of the rounded sum: bf16-level, not one ulp
        exact_res, exact_out = reference(xs, residual_in, weight, EPS)
        torch.testing.assert_close(residual.double(), exact_res, rtol=2e-2, atol=3e-2)
        torch.testing.assert_close(out.double(), exact_out, rtol=3e-2, atol=3e-2)
    else:
        check(residual, out, xs, residual_in, weight, EPS)
    for tensor in (residual, out):
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        assert all(torch.equal(g, tensor) for g in gathered), f"{name}: ranks disagree"


def _spread(space, count=3):
    if len(space) <= count:
        return list(space)
    return [space[round(i * (len(space) - 1) / (count - 1))] for i in range(count)]


def _configs(backend, problem):
    """A spread of the space, and of its double-buffered half when there is one."""
    if backend.name == "nccl_fused":
        return [None]
    space = backend.search_space(problem)
    single = [c for c in space if not c.double_buffer]
    return _spread(single) + _spread([c for c in space if c.double_buffer], 2)


def _variants_body(rank, world_size):
    from autosymm.problem import DTYPE_NAMES, Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    for dtype in (torch.bfloat16, torch.float16):
        for n_tokens, hidden in SHAPES if dtype == torch.bfloat16 else SHAPES[1:3]:
            problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, DTYPE_NAMES[dtype], world_size)
            for backend in backends:
                why_not = backend.why_not(problem, caps)
                assert why_not is None or world_size > 2, f"{backend.name}: {why_not}"
                if why_not is not None:  # a push stage of (world size - 1) copies may not fit
                    continue
                for config in _configs(backend, problem):
                    launcher = backend.prepare(problem, config, ctx)
                    xs, residual_in, weight = _inputs(world_size, n_tokens, hidden, dtype, seed=n_tokens + hidden)
                    x, residual = xs[rank].clone(), residual_in.clone()
                    out = launcher(x, residual, weight, EPS)
                    try:
                        _check(backend.name, residual, out, xs, residual_in, weight)
                    except AssertionError as err:
                        raise AssertionError(f"{backend.name} {config} {problem.describe()}: {err}") from None
                    if backend.name != "nccl_fused":
                        assert torch.equal(x, xs[rank]), f"{backend.name} changed x"


def _back_to_back_body(rank, world_size):
    """Every variant, single and double buffered, in turn without a host sync (stages reused)."""
    from autosymm.problem import Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    calls = []
    for n_tokens in (5, 300, 64):
        problem = Problem.all_reduce_rmsnorm(n_tokens, 8192, "bf16", world_size)
        for backend in backends[:-1]:
            if backend.why_not(problem, caps) is not None:  # the Lamport variant's x limit
                continue
            for config in _configs(backend, problem)[::2]:
                calls.append((backend.name, backend.prepare(problem, config, ctx), n_tokens))
    data = [_inputs(world_size, n, 8192, torch.bfloat16, seed=i) for i, (_, _, n) in enumerate(calls * 2)]
    states = [(xs[rank].clone(), residual.clone()) for xs, residual, _ in data]
    torch.cuda.synchronize()
    outs = [launcher(x, r, d[2], EPS) for (_, launcher, _), (x, r), d in zip(calls * 2, states, data)]
    for (name, _, _), (x, residual), out, (xs, residual_in, weight) in zip(calls * 2, states, outs, data):
        _check(name, residual, out, xs, residual_in, weight)


def _graph_body(rank, world_size):
    from autosymm.problem import Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    n_tokens, hidden = 37, 8192
    problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, "bf16", world_size)
    for backend in backends:
        if backend.why_not(problem, caps) is not None:  # the Lamport variant's x limit
            continue
        for config in _configs(backend, problem)[::2]:
            launcher = backend.prepare(problem, config, ctx)
            xs, residual_in, weight = _inputs(world_size, n_tokens, hidden, torch.bfloat16, seed=5)
            x, residual = xs[rank].clone(), residual_in.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                launcher(x, residual, weight, EPS)  # warm-up: compile and bind outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = launcher(x, residual, weight, EPS)
            for trial in range(3):  # replay with new data each time
                xs, residual_in, weight_new = _inputs(world_size, n_tokens, hidden, torch.bfloat16, seed=10 + trial)
                x.copy_(xs[rank])
                residual.copy_(residual_in)
                weight.copy_(weight_new)
                graph.replay()
                _check(backend.name, residual, out, xs, residual_in, weight)
            torch.cuda.synchronize()


def _api_body(rank, world_size):
    """The public function and its custom op, eager and inside a capture (the decision of
    whatever database is present, or the NCCL fallback)."""
    import torch.distributed as dist

    import autosymm

    autosymm.init()
    n_tokens, hidden = 9, 4096
    xs, residual_in, weight = _inputs(world_size, n_tokens, hidden, torch.bfloat16, seed=3)
    problem = autosymm.Problem.all_reduce_rmsnorm(n_tokens, hidden, "bf16", world_size)
    decision = autosymm.explain(problem=problem, mode="eager")
    for use_op in (False, True):
        residual = residual_in.clone()
        if use_op:
            out = torch.ops.autosymm.all_reduce_rmsnorm(xs[rank].clone(), residual, weight, EPS,
                                                        dist.group.WORLD.group_name)
        else:
            out = autosymm.all_reduce_rmsnorm(xs[rank].clone(), residual, weight, EPS)
        _check(decision.backend, residual, out, xs, residual_in, weight)
    x, residual = xs[rank].clone(), residual_in.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = autosymm.all_reduce_rmsnorm(x, residual, weight, EPS)
    graph.replay()
    _check(autosymm.explain(problem=problem, mode="graph").backend, residual, out, xs, residual_in, weight)
    autosymm.reset()


def test_every_variant_matches_the_reference():
    run_on_gpus(_variants_body)


def test_variants_back_to_back_without_sync():
    run_on_gpus(_back_to_back_body)


def test_cuda_graph_capture_and_replay():
    run_on_gpus(_graph_body)


def test_public_function_and_custom_op():
    run_on_gpus(_api_body)


def _split_body(rank, world_size):
    """Split rows (FusedConfig.row_split > 1: every config of the one-shots' spaces, and one
    single-buffered): eager, then one capture replayed with new data many times (each row's
    arrival counter must be 0 again after every call), and calls with more rows than the stash
    holds, which run with whole rows."""
    from autosymm.backends.triton_fused import split_scratch
    from autosymm.problem import DTYPE_NAMES, Problem

    ws, caps, ctx, backends = _setup(rank, world_size)
    counts = split_scratch(ws)[0]
    for dtype, n_tokens, hidden in [(torch.bfloat16, 1, 8192), (torch.bfloat16, 4, 5120), (torch.float16, 16, 7168),
                                    (torch.bfloat16, 64, 8192), (torch.float16, 37, 4104)]:
        problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, DTYPE_NAMES[dtype], world_size)
        for backend in backends[:2]:
            split = [c for c in backend.search_space(problem) if c.row_split > 1]
            assert split or n_tokens * 2 > 132, f"{backend.name}: no split rows at {problem.describe()}"
            for config in split + [dataclasses.replace(c, double_buffer=False) for c in split[:1]]:
                name = f"{backend.name} {config} {problem.describe()}"
                launcher = backend.prepare(problem, config, ctx)
                xs, residual_in, weight = _inputs(world_size, n_tokens, hidden, dtype, seed=n_tokens)
                x, residual = xs[rank].clone(), residual_in.clone()
                out = launcher(x, residual, weight, EPS)
                try:
                    _check(name, residual, out, xs, residual_in, weight)
                except AssertionError as err:
                    raise AssertionError(f"{name}: {err}") from None
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = launcher(x, residual, weight, EPS)
                for trial in range(20):
                    xs, residual_in, _ = _inputs(world_size, n_tokens, hidden, dtype, seed=100 + trial)
                    x.copy_(xs[rank])
                    residual.copy_(residual_in)
                    graph.replay()
                    if trial % 5 == 4:
                        _check(name, residual, out, xs, residual_in, weight)
                torch.cuda.synchronize()
                assert int(counts.count_nonzero()) == 0, f"{name}: arrival counters left non-zero"
                del graph
        many = launcher.split_rows + 3  # more rows than the stash holds: whole rows
        xs, residual_in, weight = _inputs(world_size, many, hidden, dtype, seed=7)
        x, residual = xs[rank].clone(), residual_in.clone()
        _check(f"{launcher.config} at {many} rows", residual, launcher(x, residual, weight, EPS), xs, residual_in,
               weight)


def test_split_rows_eager_replayed_and_beyond_the_stash():
    run_on_gpus(_split_body)

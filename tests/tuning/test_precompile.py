"""Parallel compile-only precompilation of a problem's candidates (autosymm.tuning.precompile), with
stand-ins for triton's JIT functions: the GPU compile itself is exercised by the tuner on a node."""

import torch

from autosymm.backends.base import Backend, Needs
from autosymm.backends import RunContext
from autosymm.backends.triton_all_reduce import all_reduce_space
from autosymm.problem import Problem


class _FakeJit:
    """A @triton.jit stand-in: records warmups (compiles) and launches, by thread."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.warmups, self.launches, self.threads = [], [], set()

    def warmup(self, *args, grid, **kwargs):
        import threading

        with self.lock:
            self.warmups.append((grid, kwargs["BLOCK"]))
            self.threads.add(threading.get_ident())

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs["BLOCK"]))
        return launch


class _CompilingBackend(Backend):
    needs = Needs(compiles_kernels=True)

    def __init__(self, fn, fail_on=()):
        self.fn, self.fail_on = fn, set(fail_on)

    def prepare(self, problem, config, ctx):
        from autosymm.backends.launch import LeanLauncher

        if config.block_size in self.fail_on:
            raise RuntimeError("cannot build")
        return LeanLauncher(self.fn, (config.num_blocks,), dict(BLOCK=config.block_size), num_warps=config.num_warps)


class _CollectiveBackend(Backend):
    needs = Needs()

    def prepare(self, problem, config, ctx):
        raise AssertionError("a backend without compiles_kernels must not be called: it may run collectives")


def test_precompile_compiles_every_candidate_in_threads_and_launches_nothing(monkeypatch):
    import autosymm.backends.launch as launch_mod
    from autosymm.tuning.precompile import precompile

    monkeypatch.setattr(launch_mod, "interpreter_active", lambda: False)
    monkeypatch.setenv("AUTOSYMM_COMPILE_THREADS", "4")
    problem = Problem.all_reduce(1 << 20, "bf16", 2)
    space = all_reduce_space("one_shot", problem.numel, 2, 2)[:12]
    fn = _FakeJit()
    backends = {"compiling": _CompilingBackend(fn, fail_on={16384}), "nccl": _CollectiveBackend()}
    n = precompile(problem, {"compiling": space, "nccl": [None]}, backends, RunContext(), (torch.zeros(4),),
                   torch.device("cpu"))
    expected = [(( c.num_blocks, 1, 1), c.block_size) for c in space if c.block_size != 16384]
    assert n == len(expected) and sorted(fn.warmups) == sorted(expected)
    assert not fn.launches, "compile-only: nothing reaches the GPU"
    # outside precompile the same launcher launches again
    backends["compiling"].prepare(problem, space[0], RunContext())(torch.zeros(4))
    assert fn.launches == [((space[0].num_blocks, 1, 1), space[0].block_size)]


def test_precompile_is_a_no_op_under_the_interpreter():
    from autosymm.tuning.precompile import precompile

    problem = Problem.all_reduce(4096, "bf16", 2)
    fn = _FakeJit()
    space = all_reduce_space("one_shot", problem.numel, 2, 2)
    assert precompile(problem, {"c": space}, {"c": _CompilingBackend(fn)}, RunContext(), (torch.zeros(4),),
                      torch.device("cpu")) == 0
    assert not fn.warmups and not fn.launches


def test_compile_threads_from_the_environment(monkeypatch):
    import pytest

    from autosymm.tuning.precompile import compile_threads

    monkeypatch.setenv("AUTOSYMM_COMPILE_THREADS", "3")
    assert compile_threads() == 3
    monkeypatch.setenv("AUTOSYMM_COMPILE_THREADS", "0")
    assert compile_threads() == 1  # at least one
    monkeypatch.delenv("AUTOSYMM_COMPILE_THREADS")
    assert 1 <= compile_threads() <= 16
    monkeypatch.setenv("AUTOSYMM_COMPILE_THREADS", "many")
    with pytest.raises(ValueError, match="AUTOSYMM_COMPILE_THREADS='many' must be a whole number"):
        compile_threads()

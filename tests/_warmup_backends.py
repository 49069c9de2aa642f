"""Stand-ins for warm-up tuning on gloo ranks (CPU): an all-reduce backend with a config space that
runs gloo's sum and then sleeps for its config (so which config wins is known, and a rank can be
made slower or failing), installed in a rank's process under a registered backend's name (its
rows then validate and dispatch serves it), and a serving stack's own path that sleeps too."""

from __future__ import annotations

import os
import time

import torch

from autosymm.backends.base import Backend, Needs
from autosymm.backends.stack import StackPath
from autosymm.configs import AllReduceConfig

#: The stand-in's configs, by the sleep (us) each adds to a call: BLOCK 1024 is the fastest.
SLEEP_US = {1024: 100.0, 2048: 2000.0, 4096: 6000.0}
CONFIGS = tuple(AllReduceConfig("one_shot", block, 1, 4) for block in SLEEP_US)


class SleepyAllReduce(Backend):
    """'triton_one_shot' on gloo: ``dist.all_reduce`` then ``SLEEP_US[config.BLOCK]`` us (times
    ``slow``, a rank's own factor); ``fail_on``: a BLOCK this rank cannot prepare (as a kernel that
    fails to compile on one rank: the ranks agree on it before any launches it; a candidate that
    launched on every rank and then fails on one is the kernels' own bounded barrier's to end);
    ``die_on``: a BLOCK whose launch ends this process (a rank dying mid-tune); ``calls``: BLOCKs
    launched, in order."""

    name, algorithm = "triton_one_shot", "one_shot"
    needs = Needs()

    def __init__(self, slow: float = 1.0, fail_on: int = 0, die_on: int = 0) -> None:
        self.slow, self.fail_on, self.die_on = slow, fail_on, die_on
        self.calls: list[int] = []

    def search_space(self, problem):
        return list(CONFIGS)

    def fallback_config(self, problem):
        return None

    def prepare(self, problem, config, ctx):
        import torch.distributed as dist

        block, group = config.block_size, ctx.group
        if block == self.fail_on:
            raise RuntimeError(f"stand-in: BLOCK {block} does not build on this rank")

        def launcher(x: torch.Tensor) -> torch.Tensor:
            self.calls.append(block)
            if block == self.die_on:
                os._exit(3)
            dist.all_reduce(x, group=group)
            time.sleep(SLEEP_US[block] * self.slow * 1e-6)
            return x

        return launcher


def install(backend: Backend) -> Backend:
    """Make ``backend`` what the registry serves under its name in this process."""
    from autosymm import backends

    backends._LOADED[backends._entries()[backend.name]] = backend
    return backend


def sleepy_stack(sleep_us: float, calls: list) -> StackPath:
    """vLLM's own path as a stand-in: gloo's sum in place (the NCCL baseline's own call), then
    ``sleep_us`` us: with 0 exactly as fast as that baseline."""
    import torch.distributed as dist

    def make(problem):
        def launcher(x: torch.Tensor) -> torch.Tensor:
            calls.append(x.numel())
            dist.all_reduce(x)
            if sleep_us:  # sleep(0) still yields the core: a scheduling slice on a busy machine
                time.sleep(sleep_us * 1e-6)
            return x

        return launcher

    return StackPath("vllm", {"all_reduce": make})

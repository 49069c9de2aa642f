"""Compile a tuning problem's candidate kernels in parallel threads before they are measured.

Without it, the first candidates of each problem compile one by one (about 0.3-1 s per Triton
kernel variant) while the other ranks wait in the tuner's protocol.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import settings
from ..problem import Problem
from ..backends import launch
from ..backends.launch import compile_only


def compile_threads() -> int:
    """Threads that compile a problem's kernels: AUTOSYMM_COMPILE_THREADS, else this process's
    share of the CPUs (every local rank compiles its own kernels), at most 16."""
    threads = settings.get("AUTOSYMM_COMPILE_THREADS")
    if threads is not None:
        return threads
    ranks = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return max(1, min(16, (os.cpu_count() or 1) // ranks))


def precompile(problem: Problem, candidates: dict[str, list], backends: dict, ctx, args: tuple,
               device: torch.device) -> int:
    """Compile every kernel the candidates of backends whose Needs say ``compiles_kernels`` would launch for
    ``args``, in :func:`compile_threads` threads; returns how many launchers ran. Local only (no
    launch, no collective: autosymm.backends.launch.compile_only). A failure is left for the
    candidate's own prepare/measure to report. Without it, the first candidates of each problem
    compile one by one (about 0.3-1 s per kernel variant)."""
    if launch.interpreter_active():
        return 0
    jobs = [(name, config) for name, configs in candidates.items()
            if backends[name].needs.compiles_kernels for config in configs]
    if not jobs:
        return 0

    def build(job) -> bool:
        name, config = job
        if device.type == "cuda":
            torch.cuda.set_device(device)  # triton compiles for (and caches under) the current device
        try:
            launcher = backends[name].prepare(problem, config, ctx)
            with compile_only():
                launcher(*args)
            return True
        except Exception:  # reported by the candidate's own prepare/measure
            return False

    # Each backend's first launcher alone: triton creates a kernel's per-device cache on first
    # use, and two threads creating it at once would lose one's compiled kernels.
    firsts = {name: i for i, (name, _) in reversed(list(enumerate(jobs)))}
    built = sum(build(jobs[i]) for i in sorted(firsts.values()))
    rest = [job for i, job in enumerate(jobs) if i not in firsts.values()]

    with ThreadPoolExecutor(max_workers=compile_threads()) as pool:
        return built + sum(pool.map(build, rest))

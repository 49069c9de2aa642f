"""Stand-ins for `autosymm bench --regret --cpu`: the regret bench's whole plumbing on gloo ranks,
without a GPU. Every registered backend stands in as a Hopper node would offer it: its own
eligibility under that node's capabilities (:func:`stand_in_caps`: the default workspace, as
`autosymm explain` assumes for another machine), its search space (at most
:data:`STAND_IN_CONFIGS` configs, spread over it) and formula; its launcher is the op's fallback
on gloo, so every candidate is validated against the reference for real. Its time is a stand-in
(:func:`stand_in_us`): a made-up, deterministic cost of the candidate and the size, with a small
noise per tune (``salt``), the same on every rank. It is the time of nothing: the CLI prints
none of it.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

from ..backends import Backend, Capabilities, backend_names, get_backend
from ..configs import config_to_json
from ..problem import Problem
from ..tuning.evaluator import SweepEvaluator
from ..tuning.outcome import Candidate
from ..tuning.timing import Timing
from ..settings import default_region_bytes

#: Configs per backend a stand-in tune tries (spread evenly over the backend's space).
STAND_IN_CONFIGS = 4
#: The largest call a stand-in run measures (bytes of the op's tensor: every call is a real gloo
#: collective on the CPU).
STAND_IN_MAX_BYTES = 1 << 20
#: The stand-in node's compute capability: Hopper's.
HOPPER = (9, 0)


def stand_in_caps(world_size: int) -> Capabilities:
    """The capabilities of the node the stand-ins play: the default workspace, no multicast."""
    return Capabilities.of(world_size, region_bytes=default_region_bytes(), compute_capability=HOPPER)


class StandInBackend(Backend):
    """``real`` as a GPU node offers it (see the module docstring), launching the op's fallback;
    it compiles nothing (the tuner's precompilation would launch collectives in threads)."""

    def __init__(self, real: Backend) -> None:
        self.real, self.name = real, real.name
        self.needs = dataclasses.replace(real.needs, compiles_kernels=False)
        self.batch_invariant = real.batch_invariant

    def serves(self, record) -> bool:
        return self.real.serves(record)

    def why_not(self, problem: Problem, caps: Capabilities, mode: str = "eager") -> Optional[str]:
        return self.real.why_not(problem, caps, mode)

    def formula(self, problem: Problem) -> str:
        return self.real.formula(problem)

    def invariant_for(self, problem: Problem) -> bool:
        return self.real.invariant_for(problem)

    def search_space(self, problem: Problem) -> list:
        space = list(self.real.search_space(problem))
        step = max(1, len(space) // STAND_IN_CONFIGS)
        return space[::step][:STAND_IN_CONFIGS]

    def fallback_config(self, problem: Problem):
        return self.real.fallback_config(problem)

    def prepare(self, problem: Problem, config, ctx):
        fallback = get_backend(problem.record.fallback)
        return fallback.prepare(problem, fallback.fallback_config(problem), ctx)


def stand_in_backends() -> dict[str, StandInBackend]:
    """name -> stand-in of every registered backend this process can load."""
    out = {}
    for name in backend_names():
        try:
            out[name] = StandInBackend(get_backend(name))
        except ImportError:  # a backend torch cannot load here is not offered, as on a node
            continue
    return out


def stand_in_us(candidate: Candidate, problem: Problem, mode: str, salt: object = 0) -> float:
    """A made-up time (us): a launch cost (3-13 us) and a bandwidth (20-420 GB/s) of the
    candidate's own (a hash of its backend, config and mode), so winners change with the size as
    real ones do, times 1 + up to 2 % noise of ``salt`` (one tune), the key and the candidate."""
    seed = zlib.crc32(f"{candidate.backend}|{config_to_json(candidate.config)}|{mode}".encode())
    launch_us, gb_per_s = 3.0 + seed % 1000 / 100.0, 20.0 + (seed >> 10) % 400
    noise = zlib.crc32(f"{salt}|{seed}|{problem.bucket}|{problem.shape_key}".encode()) % 1000 / 50000.0
    return (launch_us + problem.nbytes / (gb_per_s * 1e3)) * (1.0 + noise)


class StandInEvaluator(SweepEvaluator):
    """The tuner's evaluator with a stand-in clock: each candidate is validated for real (the
    fallback's result on gloo against the reference) and its timing inputs run through it once;
    its time is :func:`stand_in_us` (no CUDA graph is captured in either mode)."""

    def __init__(self, *args, salt: object = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.salt = salt
        self.candidate: Optional[Candidate] = None

    def prepare(self, candidate: Candidate):
        launcher = super().prepare(candidate)
        self.candidate = candidate  # measured next (the tuner prepares and measures one at a time)
        return launcher

    def time(self, launcher) -> Timing:
        launcher(*self.data.timing_args()[0])
        us = stand_in_us(self.candidate, self.problem, self.mode, self.salt)
        return Timing(us, us, us, self.plan.repeats)

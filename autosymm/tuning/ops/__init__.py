"""The tuning side of each op, one module per collective (autosymm.collectives has the runtime
side): inputs, references, workspace needs, what `bench` measures. An op's spec names its module
(``OpSpec.tuning``, an entry): :func:`registered` follows the op registry's order; :func:`get`
finds an op's by name.

Adding a collective: ``tuning/ops/<op>.py`` with a :class:`~autosymm.tuning.ops.base.TuningOp`
subclass (``allocate``, ``build_reference``, ``workspace_bytes``; ``validation_args`` /
``timing_args`` / ``result`` where its launcher's call differs from ``(input, *extra)``), named by
its spec.
"""

from __future__ import annotations

from ... import spec
from ...entries import load
from ...problem import Problem
from .base import TuningOp


def registered() -> tuple[TuningOp, ...]:
    """Every registered op's tuning side, in registry order."""
    return tuple(load(record.tuning) for record in spec.registered())


def get(name: str) -> TuningOp:
    """The tuning side of op ``name``; ValueError naming the registered ops otherwise."""
    return load(spec.get(name).tuning)


def workspace_bytes(problems: list[Problem], at_least: tuple[int, int]) -> tuple[int, int]:
    """(all-reduce, MoE) region bytes every problem fits, at least ``at_least``."""
    ar, moe = at_least
    for problem in problems:
        need_ar, need_moe = get(problem.op).workspace_bytes(problem)
        ar, moe = max(ar, need_ar), max(moe, need_moe)
    return ar, moe


__all__ = ["TuningOp", "get", "registered", "workspace_bytes"]

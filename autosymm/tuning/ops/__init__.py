"""The tuning side of each op, one module per collective (autosymm.collectives has the runtime
side): inputs, references, workspace needs, what `bench` measures. :data:`ALL` follows the
runtime registry's order; :func:`get` finds an op's by name.

Adding a collective: ``tuning/ops/<op>.py`` with a :class:`~autosymm.tuning.ops.base.TuningOp`
subclass (``allocate``, ``build_reference``, ``workspace_bytes``; ``validation_args`` /
``timing_args`` / ``result`` where its launcher's call differs from ``(input, *extra)``) and one
line in :data:`ALL`.
"""

from __future__ import annotations

from ...problem import Problem
from .all_gather import ALL_GATHER
from .all_reduce import ALL_REDUCE
from .all_reduce_rmsnorm import ALL_REDUCE_RMSNORM
from .base import TuningOp
from .moe import DP_TO_EP, EP_TO_DP
from .reduce_scatter import REDUCE_SCATTER

ALL: tuple[TuningOp, ...] = (ALL_REDUCE, DP_TO_EP, EP_TO_DP, ALL_REDUCE_RMSNORM, REDUCE_SCATTER, ALL_GATHER)
_BY_NAME = {op.name: op for op in ALL}


def get(name: str) -> TuningOp:
    """The tuning side of op ``name``; ValueError naming the known ones otherwise."""
    op = _BY_NAME.get(name)
    if op is None:
        raise ValueError(f"op={name!r} has no tuning module (known: {tuple(_BY_NAME)})")
    return op


def workspace_bytes(problems: list[Problem], at_least: tuple[int, int]) -> tuple[int, int]:
    """(all-reduce, MoE) region bytes every problem fits, at least ``at_least``."""
    ar, moe = at_least
    for problem in problems:
        need_ar, need_moe = get(problem.op).workspace_bytes(problem)
        ar, moe = max(ar, need_ar), max(moe, need_moe)
    return ar, moe


__all__ = ["ALL", "ALL_GATHER", "ALL_REDUCE", "ALL_REDUCE_RMSNORM", "DP_TO_EP", "EP_TO_DP", "REDUCE_SCATTER", "TuningOp", "get",
           "workspace_bytes"]

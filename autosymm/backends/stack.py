"""Backends ``vllm`` and ``sglang``: what a serving stack runs for a call without autosymm (its own
communicator chain), as a candidate timed beside autosymm's backends and NCCL, and the default
to beat (autosymm.tuning.warmup). It serves only on a group whose serving adapter handed the
runtime the stack's path (:class:`StackPath`, ``RunContext.stack``; ``Capabilities.stack`` names
it): a row of it says the stack's own path was fastest there, so dispatch leaves the call to the
stack (autosymm.integrations.serving). The adapter builds the launchers, in the forms of
autosymm.backends.base (an all-reduce sums in place: the stack's out-of-place result copied
back), from the stack's own calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..problem import Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext


@dataclass(frozen=True)
class StackPath:
    """A serving stack's own path on one group: ``name`` ('vllm' | 'sglang'); ``launchers``: op
    name -> ``make(problem) -> launcher`` running the stack's own calls (the ops it has a path
    for); ``formula(problem) -> str``: the numerics of its path for a call (Backend.formula's
    names); ``why_not(problem, mode) -> str | None``: the calls its path cannot run here (said in
    the rows' ``stack_note``)."""

    name: str
    launchers: Mapping[str, Callable[[Problem], Callable]] = field(default_factory=dict)
    formula: Optional[Callable[[Problem], str]] = None
    why_not: Optional[Callable[[Problem, str], Optional[str]]] = None

    def reason(self, problem: Problem, mode: str) -> Optional[str]:
        """Why this path cannot run ``problem`` in ``mode`` here, or None."""
        if problem.op not in self.launchers:
            return f"{self.name} has no {problem.op} path"
        return self.why_not(problem, mode) if self.why_not is not None else None


class StackBackend(Backend):
    """One stack's own path (see the module docstring); no config."""

    batch_invariant = False  # the stack's own chain: NCCL's and custom all-reduces' orders

    def __init__(self, name: str) -> None:
        self.name = name
        self.needs = Needs(dtypes=None, intra_node=True)  # the ops whose specs list it (STACK_BACKENDS)

    def why_not(self, problem: Problem, caps: Capabilities, mode: str = "eager") -> Optional[str]:
        if caps.stack != self.name:
            return f"no {self.name} path on this group"
        reason = caps.stack_path.reason(problem, mode) if isinstance(caps.stack_path, StackPath) else None
        return reason or super().why_not(problem, caps, mode)

    def prepare(self, problem: Problem, config: None, ctx: RunContext):
        path = ctx.stack
        if not isinstance(path, StackPath) or path.name != self.name:
            raise BackendError(f"{self.name}: the group holds no {self.name} path (got {type(path).__name__})")
        reason = path.reason(problem, "eager")
        if reason is not None:
            raise BackendError(f"{self.name}: {reason}")
        return path.launchers[problem.op](problem)


def path_formula(path: Any, problem: Problem) -> str:
    """The formula of ``path``'s result for ``problem`` (its own word, else the op's)."""
    if isinstance(path, StackPath) and path.formula is not None:
        return path.formula(problem)
    return problem.record.formula


vllm = StackBackend("vllm")
sglang = StackBackend("sglang")
BACKENDS = (vllm, sglang)

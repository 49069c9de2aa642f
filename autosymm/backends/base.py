"""What every backend is: a named way to run one or more ops, with a config space, and the one
eligibility contract that dispatch, the tuner and the API all ask.

A backend never decides; it answers ``why_not(problem, caps, mode)`` (None, or a short reason:
its declared :class:`Needs`, then :meth:`Backend.limits`), ``search_space(problem)``,
``fallback_config(problem)`` and ``prepare(problem, config, ctx)``: a launcher bound to everything
but the tensors, so a repeated call costs one Python call plus the kernel launch. It also names
the formula its result follows (:meth:`Backend.formula`) and whether it is batch-invariant. The
launchers' signatures, op by op: the design notes.

Design notes: docs/BACKENDS.md#backends-base
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..configs import AnyConfig
from ..geometry import ALL_REDUCE_REGION, DEFAULT_MOE_MAX_BYTES, MAX_WORLD_SIZE, MOE_REGION
from ..problem import DTYPES, MODES, Problem


@dataclass(frozen=True)
class Capabilities:
    """What a process group offers, as far as backend choice goes (same on every rank). Build it
    with :meth:`of`; the fields are plain so tests can state any group."""

    world_size: int
    all_reduce_bytes: int = 0  # capacity of the workspace's all-reduce region (0: no workspace)
    moe_bytes: int = 0  # capacity of the MoE region
    has_multicast: bool = False
    intra_node: bool = True  # False when the group spans nodes
    torch_symm_ops: bool = False  # torch.ops.symm_mem one/two-shot available
    compute_capability: tuple[int, int] = (0, 0)
    moe_max_bytes: int = 0  # MoE region (bytes) an eager call may grow the workspace to (<= moe_bytes: none)
    stack: str = ""  # the serving stack whose own path this group's runs hold ('vllm', 'sglang'; '': none)
    #: that path (autosymm.backends.stack.StackPath): which calls it can run here
    stack_path: Any = field(default=None, compare=False)

    @classmethod
    def of(cls, world_size: int, *, workspace=None, region_bytes: Optional[tuple[int, int]] = None,
           intra_node: bool = True, compute_capability: tuple[int, int] = (0, 0),
           moe_max_bytes: int = DEFAULT_MOE_MAX_BYTES) -> "Capabilities":
        """The one builder. ``workspace``: the group's autosymm.workspace.symm.Workspace (regions, multicast
        and torch's ops as this process has them). ``region_bytes``: (all-reduce, MoE) bytes of
        a workspace on another machine (``autosymm explain``): no multicast (autosymm never
        enables it), torch's symm_mem ops assumed present. Neither: a group without a workspace.
        ``moe_max_bytes``: how far eager MoE calls may grow the MoE region (autosymm.runtime.moe_room)."""
        if workspace is not None:
            moe_bytes = workspace.capacity(MOE_REGION)
            return cls(world_size, workspace.capacity(ALL_REDUCE_REGION), moe_bytes, bool(workspace.has_multicast),
                       intra_node, ops_available(), tuple(compute_capability), max(moe_bytes, moe_max_bytes))
        if region_bytes is not None:
            return cls(world_size, region_bytes[0], region_bytes[1], False, intra_node, True,
                       tuple(compute_capability), max(region_bytes[1], moe_max_bytes))
        return cls(world_size, intra_node=intra_node, compute_capability=tuple(compute_capability))

    def moe_room(self, mode: str) -> int:
        """Bytes of MoE region a call in ``mode`` can have: in eager mode the region may grow
        (collectively, autosymm.runtime.moe_room) up to ``moe_max_bytes``; inside a CUDA-graph capture
        nothing may be allocated, so only what the region has."""
        return max(self.moe_bytes, self.moe_max_bytes) if mode == "eager" and self.moe_bytes > 0 else self.moe_bytes

    def region_bytes(self, region: str) -> int:
        """Bytes of workspace region ``region`` ('all_reduce' | 'moe'); 0 without a workspace."""
        return {ALL_REDUCE_REGION: self.all_reduce_bytes, MOE_REGION: self.moe_bytes}[region]


def ops_available() -> bool:
    """True when this torch registers the symm_mem one-shot/two-shot all-reduce ops
    (autosymm.backends.torch_symm runs them)."""
    ops = getattr(torch.ops, "symm_mem", None)
    try:
        return ops is not None and hasattr(ops, "one_shot_all_reduce_out") and hasattr(ops, "two_shot_all_reduce_")
    except (RuntimeError, AttributeError):
        return False


@dataclass(frozen=True)
class Needs:
    """What a backend declares it needs from a call and a group (which ops it serves is the ops'
    specs' to say: autosymm.spec.OpSpec.backends)."""

    dtypes: Optional[tuple[str, ...]] = tuple(DTYPES)  # None: any dtype (NCCL's, a byte copy)
    reduce_ops: Optional[tuple[str, ...]] = ("sum",)  # of a reducing op (Problem.reduce_op); None: any
    graph_capturable: bool = True  # its launcher may be captured in a CUDA graph
    compiles_kernels: bool = False  # its launchers compile Triton kernels (the tuner precompiles them)
    workspace_region: Optional[str] = None  # the symmetric-workspace region it works in
    intra_node: bool = False  # needs one NVLink domain (peer-mapped memory)
    torch_symm_ops: bool = False  # needs torch.ops.symm_mem's all-reduce ops
    multicast: bool = False  # needs a multicast address (multimem)
    min_compute_capability: tuple[int, int] = (0, 0)


@dataclass
class RunContext:
    """Per-rank objects a launcher needs: the group and its workspace (None for NCCL), and the
    serving stack's own path on the group (autosymm.backends.stack.StackPath; None outside one)."""

    group: Any = None
    workspace: Any = None
    stack: Any = None


Launcher = Callable[..., Any]


class Backend:
    """Base of every backend: ``name``, ``needs`` and the eligibility contract.

    ``batch_invariant``: every element of its result is a function of that element's inputs
    alone, the same at every call size, config, grid and mode, and the same as every other
    batch-invariant backend of the op gives (for sums: the fp32 sum of ranks 0..W-1 in order
    from +0.0, rounded once; for data movement: the rows moved). The ``deterministic`` setting
    (autosymm.settings) restricts dispatch to such backends."""

    name: str
    needs: Needs
    batch_invariant: bool = False

    def formula(self, problem: Problem) -> str:
        """The numerics of this backend's result for ``problem``, by name: the op's
        (``OpSpec.formula``: 'sum' in any order, 'copy', the fused op's 'single-rounding')
        unless the backend computes another (the NCCL fused fallback's 'native-chain'). Warm-up
        tuning lets only candidates of the reference path's formula compete (autosymm.tuning.warmup)."""
        return problem.record.formula

    def invariant_for(self, problem: Problem) -> bool:
        """Whether this backend's result for ``problem`` is batch-invariant (``batch_invariant``,
        unless the backend knows better for this call: NCCL's max of any dtype is)."""
        return self.batch_invariant

    def serves(self, record) -> bool:
        """Whether this backend serves the op of ``record`` (an autosymm.spec.OpSpec): the op's
        spec lists it."""
        return self.name in record.backends

    def why_not(self, problem: Problem, caps: Capabilities, mode: str = "eager") -> Optional[str]:
        """None when this backend can serve ``problem`` on ``caps`` in ``mode``, else why not."""
        needs = self.needs
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if not self.serves(problem.record):
            return f"does not serve {problem.op}"
        if needs.dtypes is not None and problem.dtype not in needs.dtypes:
            return f"dtype {problem.dtype} (supports {', '.join(needs.dtypes)})"
        if (needs.reduce_ops is not None and problem.record.domain.reduce_ops
                and problem.reduce_op not in needs.reduce_ops):
            return f"op {problem.reduce_op} (supports {', '.join(needs.reduce_ops)})"
        if mode == "graph" and not needs.graph_capturable:
            return "not CUDA-graph capturable"
        if needs.intra_node and not caps.intra_node:
            return "group spans nodes"
        if needs.torch_symm_ops and not caps.torch_symm_ops:
            return "torch.ops.symm_mem all-reduce ops unavailable"
        if needs.workspace_region is not None:
            if problem.world_size > MAX_WORLD_SIZE:
                return f"world size {problem.world_size} > {MAX_WORLD_SIZE} (the kernels' signal layout)"
            if caps.region_bytes(needs.workspace_region) <= 0:
                return "no symmetric workspace"
        if needs.multicast and not caps.has_multicast:
            return "no multicast"
        if tuple(caps.compute_capability) < needs.min_compute_capability:
            have, want = caps.compute_capability, needs.min_compute_capability
            return f"needs sm_{want[0]}{want[1]}+, got sm_{have[0]}{have[1]}"
        return self.limits(problem, caps)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        """What only this backend knows (sizes, alignment, workspace fit): None when it serves."""
        return None

    def search_space(self, problem: Problem) -> list[Optional[AnyConfig]]:
        return [None]

    def fallback_config(self, problem: Problem) -> Optional[AnyConfig]:
        """The config to run ``problem`` with when no database row serves it."""
        return None

    def prepare(self, problem: Problem, config: Optional[AnyConfig], ctx: RunContext) -> Launcher:
        raise NotImplementedError


class BackendError(RuntimeError):
    """A backend cannot run a call it was asked to (the message names the offending value)."""

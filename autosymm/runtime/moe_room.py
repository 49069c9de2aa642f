"""Room for the MoE conversions in a group's symmetric workspace: declared up front, or grown.

* **Declared**: ``autosymm.init(group, moe=[MoEPlan(shape, max_tokens_per_rank, dtype)])`` sizes
  the MoE region for the largest declared call (:func:`plans_region_bytes`) before the workspace
  is made, or, when the group is set up already, grows it right away (every rank calls init).
* **Grown**: an eager MoE call the Triton conversion would serve but whose rows do not fit the
  region (``Capabilities.moe_room``: up to ``moe_max_bytes``) first moves the MoE region to a
  larger symmetric allocation on every rank together (:func:`grow_region`). Every rank makes the
  same MoE call, with the same agreed capabilities, so every rank reaches the same decision at
  the same call; the allocation's success is agreed too (a rank out of memory makes every rank
  stop growing and use NCCL). The old allocation stays alive (views handed out and graphs
  captured before address it); cached Triton MoE launchers are prepared again on the new one.
  Each growth is logged once (rank 0, warning).
* **Inside a CUDA-graph capture** nothing can be allocated: a call that only lacks room raises a
  RuntimeError naming the bytes it needs and the call that reserves them.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, replace
from typing import Sequence, Union

import torch
import torch.distributed as dist

from ..backends import get_backend
from ..geometry import MOE_REGION, grown_moe_bytes, moe_region_bytes
from ..spec import KEY_SPEC
from ..problem import DTYPES, MODEL_SHAPES, MoEShape, Problem, dtype_name
from .agreement import Exchange, problems
from ..settings import MAX_WORKSPACE_BYTES
from ..workspace.symm import peer_buffers

log = logging.getLogger("autosymm")


@dataclass(frozen=True)
class MoEPlan:
    """MoE conversions to come on a group: ``shape`` (a MoEShape, a key like 'd7168_e256_k8' or a
    name of autosymm.MODEL_SHAPES), up to ``max_tokens_per_rank`` tokens per rank, ``dtype``."""

    shape: Union[MoEShape, str]
    max_tokens_per_rank: int
    dtype: Union[torch.dtype, str] = torch.bfloat16

    def __post_init__(self) -> None:
        shape = self.shape
        if isinstance(shape, str):
            shape = MODEL_SHAPES[shape] if shape in MODEL_SHAPES else MoEShape.from_key(shape)
        if not isinstance(shape, MoEShape):
            raise TypeError(f"MoEPlan.shape must be a MoEShape or a key like 'd7168_e256_k8', got {self.shape!r}")
        dtype = self.dtype if isinstance(self.dtype, str) else dtype_name(self.dtype)
        if dtype not in DTYPES:
            raise ValueError(f"MoEPlan.dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        tokens = self.max_tokens_per_rank
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"MoEPlan.max_tokens_per_rank={tokens!r} must be an int >= 1")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", DTYPES[dtype])

    def region_bytes(self, world_size: int) -> int:
        """Bytes of MoE region both conversions of this plan need on ``world_size`` ranks."""
        row_bytes = self.shape.d_model * torch.empty((), dtype=self.dtype).element_size()
        return moe_region_bytes(self.max_tokens_per_rank, self.shape.n_expts_act, row_bytes, world_size)


def plans_region_bytes(plans: Sequence[MoEPlan], world_size: int) -> int:
    """Bytes of MoE region every plan fits (one call of each op at a time: the largest plan's)."""
    for plan in plans:
        if not isinstance(plan, MoEPlan):
            raise TypeError(f"autosymm.init(moe=...) takes autosymm.MoEPlan objects, got {plan!r}")
    return max((plan.region_bytes(world_size) for plan in plans), default=0)


def agree(group, plans: Sequence[MoEPlan], moe_max_bytes, wrong: str = "") -> tuple[int, int]:
    """(MoE region bytes the plans need, moe_max_bytes or -1), the same on every rank of
    ``group`` (an exchange with a deadline, autosymm.runtime.agreement); a ValueError on every rank when
    the ranks were given different ones, or one of them could not read its plans, or found
    ``wrong`` with init's other arguments (its message)."""
    world_size = dist.get_world_size(group)
    report = {"ok": True, "error": "", "settings": {}}
    try:
        report["settings"] = {"moe_region_bytes": plans_region_bytes(plans, world_size),
                              "moe_max_bytes": -1 if moe_max_bytes is None else checked_max_bytes(moe_max_bytes)}
    except Exception as exc:  # a bad plan on one rank: every rank hears it
        report.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    if wrong:
        report.update(ok=False, error=wrong)
    trouble = problems(Exchange(group, dist.get_rank(group), world_size).exchange("init_moe", report))
    if trouble is not None:
        raise ValueError(f"autosymm.init: ranks must pass the same moe=, moe_max_bytes= and deterministic=, each "
                         f"valid: {trouble}")
    return report["settings"]["moe_region_bytes"], report["settings"]["moe_max_bytes"]


def checked_max_bytes(moe_max_bytes) -> int:
    """``moe_max_bytes`` of ``autosymm.init``: a whole number of bytes >= 0 (0: never grow), at most
    settings.MAX_WORKSPACE_BYTES; TypeError or ValueError naming the value otherwise."""
    try:
        nbytes = operator.index(moe_max_bytes)  # ints (numpy's too), never floats
    except TypeError:
        nbytes = None
    if nbytes is None or isinstance(moe_max_bytes, bool):
        raise TypeError(f"autosymm.init: moe_max_bytes={moe_max_bytes!r} ({type(moe_max_bytes).__name__}) must be "
                        f"a whole number of bytes")
    if not 0 <= nbytes <= MAX_WORKSPACE_BYTES:
        raise ValueError(f"autosymm.init: moe_max_bytes={nbytes} must be in 0..{MAX_WORKSPACE_BYTES} bytes "
                         f"(0: the MoE region never grows)")
    return nbytes


def configure(state, region_bytes: int, moe_max_bytes: int) -> None:
    """Apply agreed settings to a group state (collective when the region must grow now)."""
    ws = state.workspace
    if ws is None:
        return  # no symmetric memory on this group: NCCL serves every MoE call
    if moe_max_bytes >= 0:
        state.caps = replace(state.caps, moe_max_bytes=max(moe_max_bytes, region_bytes, ws.capacity(MOE_REGION)))
    if region_bytes > ws.capacity(MOE_REGION):
        grow(state, region_bytes, "declared by autosymm.init(moe=...)")


def prepare(state, problem: Problem, mode: str):
    """``state.prepare(problem, mode)`` for a MoE call, after growing the region (eager) or
    raising a clear error (graph) where only room stops the Triton conversion."""
    if state.workspace is not None:
        # a backend loads on first use (autosymm.backends), not with this module
        from ..backends.triton_moe import TRITON_MOE, fits, region_bytes_for

        caps = state.caps
        if mode == "eager":
            decision = state.decide(problem, mode)
            if decision.backend == TRITON_MOE.name and not fits(problem, caps.moe_bytes):
                target = grown_moe_bytes(caps.moe_bytes, region_bytes_for(problem), caps.moe_room(mode))
                grow(state, target, problem.describe())
        elif not fits(problem, caps.moe_bytes) and \
                TRITON_MOE.why_not(problem, replace(caps, moe_bytes=region_bytes_for(problem)), mode) is None:
            raise RuntimeError(graph_room_message(problem, caps.moe_bytes))
    return state.prepare(problem, mode)


def graph_room_message(problem: Problem, have: int) -> str:
    # a backend loads on first use (autosymm.backends), not with this module
    from ..backends.triton_moe import buffer_bytes, region_bytes_for

    shape, dtype = problem.shape, str(DTYPES[problem.dtype]).replace("torch.", "")
    return (f"autosymm: {problem.describe()} inside a CUDA-graph capture needs a MoE workspace region of "
            f"{region_bytes_for(problem)} bytes ({buffer_bytes(problem)} for this op's buffer); the group's has "
            f"{have} and nothing can be allocated during a capture. Reserve it before capturing: "
            f"autosymm.init(group, moe=[autosymm.MoEPlan('{shape.key}', max_tokens_per_rank={problem.n_tokens_local}, "
            f"dtype=torch.{dtype})]), or make this call once eagerly first (the region then grows)")


def grow(state, nbytes: int, why: str) -> bool:
    """Move the MoE region of ``state``'s workspace to a new allocation of ``nbytes`` on every rank
    (collective), update the capabilities and prepare the cached Triton MoE launchers again.
    False on every rank when some rank could not allocate: growth stops there (NCCL serves)."""
    ws = state.workspace
    old = ws.capacity(MOE_REGION)
    if grow_region(ws, MOE_REGION, nbytes):
        new = ws.capacity(MOE_REGION)
        state.caps = replace(state.caps, moe_bytes=new, moe_max_bytes=max(new, state.caps.moe_max_bytes))
        prepare_again(state)
        if state.rank == 0:
            log.warning("autosymm: grew the MoE workspace region from %d to %d bytes per rank for %s (declare the "
                        "calls to come with autosymm.init(moe=[autosymm.MoEPlan(...)]) to size it up front)",
                        old, new, why)
        return True
    state.caps = replace(state.caps, moe_max_bytes=old)
    if state.rank == 0:
        log.warning("autosymm: a rank could not allocate a %d-byte MoE workspace region for %s; MoE calls that "
                    "do not fit the %d-byte region use NCCL", nbytes, why, old)
    return False


def prepare_again(state) -> None:
    """Re-prepare every cached Triton MoE launcher on the workspace's current MoE region (only MoE
    calls have them; a call key leads with its op's spec, autosymm.spec.CallKey)."""
    backend = get_backend("triton_moe")
    for key, entry in state.cache.items():
        if entry.decision.backend == backend.name:
            entry.launcher = backend.prepare(key[KEY_SPEC].problem_of_key(key, state.world_size), entry.decision.config,
                                             state.ctx)


def grow_region(ws, name: str, nbytes: int) -> bool:
    """Collective over ``ws.group``: every rank allocates ``nbytes`` of symmetric memory, the ranks
    agree that all succeeded, rendezvous, and region ``name`` moves there (Workspace.move_region).
    False on every rank, nothing changed, when any rank could not allocate."""
    # symmetric memory: `import torch` skips it; only a workspace needs it
    import torch.distributed._symmetric_memory as symm_mem

    try:
        buffer = symm_mem.empty((nbytes,), dtype=torch.uint8, device=ws.device)
    except RuntimeError:  # torch.OutOfMemoryError included: agreed below, never raised alone
        buffer = None
    if Exchange(ws.group, ws.rank, ws.world_size).all_ok("grow_region", buffer is not None):
        return False
    peers, handle, _ = peer_buffers(buffer, ws.group)
    ws.move_region(name, peers, keep=(handle,))
    return True

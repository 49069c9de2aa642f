"""The session-level public calls: ``init``, ``explain``, ``stats``, ``empty``, ``barrier_errors``,
``reset_barriers``, ``reset``. The collectives' own functions are their front doors
(autosymm.collectives). Call ``init(group)`` (or make one eager call) before capturing a CUDA
graph: the first call on a group runs collectives that must not be captured.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .backends import flashinfer_fused
from .logs import configure_from_env
from .dist_compat import reduce_op_name
from .problem import MODES, Problem, any_dtype_name
from .runtime import moe_room
from .runtime.dispatch import Decision
from .runtime.group import STATES, state_key, state_of, stream_capturing
from .runtime.replay import forget_all
from .spec import ALL_REDUCE, get as spec_of, names as op_names
from .workspace.symm import reserve_moe_bytes

configure_from_env()  # AUTOSYMM_LOG; a bad value is warned about, never raised

def init(group=None, *, moe: Sequence = (), moe_max_bytes: Optional[int] = None,
         deterministic: Optional[bool] = None) -> None:
    """Set up autosymm on ``group`` now (collective): workspace, databases, rank agreement.

    ``moe``: the MoE conversions to come, a list of ``autosymm.MoEPlan(shape, max_tokens_per_rank,
    dtype)``: the workspace's MoE region is sized for the largest (grown now, collectively, if
    the group is set up already), so those calls run the Triton conversion, CUDA-graph capture
    included. ``moe_max_bytes``: how far eager MoE calls may grow the MoE region (bytes; default
    geometry.DEFAULT_MOE_MAX_BYTES; 0: never grow). ``deterministic``: True restricts this group's
    calls to batch-invariant backends, False lifts it (default: AUTOSYMM_DETERMINISTIC;
    docs/DETERMINISM.md). Every rank must pass the same values; a bad one on any rank is a
    ValueError on every rank, before anything is set up.
    """
    if not dist.is_initialized():
        raise RuntimeError("autosymm needs torch.distributed initialised (dist.init_process_group)")
    wrong = "" if deterministic is None or isinstance(deterministic, bool) else \
        f"TypeError: deterministic={deterministic!r} ({type(deterministic).__name__}) must be True, False or None"
    region_bytes, max_bytes = moe_room.agree(group if group is not None else dist.group.WORLD, moe, moe_max_bytes,
                                             wrong)
    if region_bytes and state_key(group) not in STATES:
        reserve_moe_bytes(group if group is not None else dist.group.WORLD, region_bytes)
    moe_room.configure(state_of(group), region_bytes, max_bytes)
    if deterministic is not None:
        state_of(group).set_deterministic(deterministic)
        forget_all()  # hot plans were made under the old setting


def _mode() -> str:
    """'graph' while the current stream is capturing a CUDA graph, else 'eager'."""
    return "graph" if stream_capturing() else "eager"


def explain(x: Optional[torch.Tensor] = None, *, group=None, op: str = "all_reduce", mode: Optional[str] = None,
            problem: Optional[Problem] = None, reduce_op="sum") -> Decision:
    """The Decision a call would get on ``group`` (backend, config, DB row or fallback reason,
    expected µs, the hardware decided for), without running it: the dispatcher's, as the call
    itself gets it. Give a tensor (an all-reduce by ``reduce_op``, any dtype) or a Problem (any
    op, any dtype or reduction)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"explain: mode={mode!r} is not one of {MODES}")
    if op not in op_names():
        raise ValueError(f"explain: op={op!r} is not one of {op_names()}")
    asked = spec_of(op)
    if problem is None:
        if x is None:
            raise ValueError("explain needs a tensor or a Problem")
        if asked is not ALL_REDUCE:
            raise ValueError(f"explain: a tensor describes an all-reduce, not {op}; pass "
                             f"problem={asked.problem_hint()}")
    elif asked is not ALL_REDUCE and problem.op != op:
        raise ValueError(f"explain: op={op!r} but the problem is a {problem.op}")
    state = state_of(group)
    mode = mode or _mode()
    if problem is None:
        problem = Problem(ALL_REDUCE.name, any_dtype_name(x.dtype), state.world_size,
                          nbytes=x.numel() * x.element_size(), reduce_op=reduce_op_name(reduce_op))
    return state.decide(problem, mode)


def stats(group=None) -> dict[str, dict[str, int]]:
    """Calls and bytes per backend since start (all groups, or one group)."""
    out: dict[str, dict[str, int]] = {}
    if group is None:
        states = list(STATES.values())
    else:
        states = [STATES[group]] if group in STATES else []
    for state in {id(state): state for state in states}.values():  # a state may sit under two names
        for backend, counts in state.counts().items():
            agg = out.setdefault(backend, {"calls": 0, "bytes": 0})
            agg["calls"] += counts["calls"]
            agg["bytes"] += counts["bytes"]
    return out


def empty(shape, dtype: torch.dtype = torch.bfloat16, group=None) -> torch.Tensor:
    """A tensor inside the group's workspace: all_reduce of it needs no copy (zero-copy path).

    Every rank must call it in the same order with the same shapes.
    """
    state = state_of(group)
    if state.workspace is None:
        return torch.empty(shape, dtype=dtype, device=state.device)
    return state.workspace.empty(tuple(shape), dtype)


def barrier_errors(group=None) -> int:
    """Barrier waits on this rank that gave up (a peer never arrived) since the last
    ``reset_barriers``; 0 when healthy. Non-zero: results since the last clean check are garbage.
    Synchronizes the device: call it after the fact, not per call."""
    workspace = state_of(group).workspace
    return workspace.barrier_errors() if workspace is not None else 0


def reset_barriers(group=None) -> None:
    """Re-arm the signal pads after barrier errors (collective: every rank of ``group`` calls it)."""
    workspace = state_of(group).workspace
    if workspace is not None:
        workspace.reset_signals()


def reset() -> None:
    """Forget every group's state and prepared calls (tests; after destroy_process_group), and
    free FlashInfer's fused workspaces (autosymm.backends.flashinfer_fused)."""
    forget_all()
    flashinfer_fused.close_all()
    STATES.clear()

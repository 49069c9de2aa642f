"""Input checks shared by the MoE conversion backends (triton_moe, nccl_all_to_all): one contract
for every path.

* :func:`check_inputs` (every call, local, no device read-back, capture-safe): types, devices,
  dtypes, contiguity, shapes, the assignment's size against the problem and the group.
* :func:`check_index_ranges` (an eager call's first use of its shape: it reads values back):
  every owner of ``assignment.expt_owner`` is a rank of the group, and ``gate_indx`` /
  ``topk_indx`` is a permutation of the pairs ``[0, n_tokens_global * k)`` (what
  ``autosymm.route`` builds). BackendError names what is wrong.
* Expert ids need no check: an id outside ``[0, n_expts_tot)`` marks a dropped pair, of any
  width (an int64 id of 2**32 or more included), and the Triton kernels, the split kernel and
  the torch planning of the NCCL path all skip it alike. ``expt_indx`` must be the same on every
  rank: an eager call's first use compares :func:`ids_digest` across ranks.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

from ..geometry import MAX_WORLD_SIZE
from ..spec import get as collective
from ..problem import DTYPES, Problem
from ..routing import ExptAssignment
from .base import BackendError

#: Largest top-k the backends accept (the kernels need no limit; this is the tested range).
MAX_N_EXPTS_ACT = 32
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


def shape_reason(problem: Problem) -> Optional[str]:
    if not 1 <= problem.world_size <= MAX_WORLD_SIZE:
        return f"world size {problem.world_size} > {MAX_WORLD_SIZE}"
    if not 1 <= problem.shape.n_expts_act <= MAX_N_EXPTS_ACT:
        return f"top-k {problem.shape.n_expts_act} outside 1..{MAX_N_EXPTS_ACT}"
    if problem.shape.n_expts_tot < problem.world_size:
        return f"{problem.shape.n_expts_tot} experts for {problem.world_size} ranks"
    return None


def _check_tensor(name: str, t, device: torch.device, dtypes, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise BackendError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise BackendError(f"{op}: {name} is on {t.device}, the group's device is {device}")
    if t.dtype not in dtypes:
        raise BackendError(f"{op}: {name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if not t.is_contiguous():
        raise BackendError(f"{op}: {name} of shape {tuple(t.shape)} and strides {t.stride()} is not contiguous")


def check_inputs(problem: Problem, device: torch.device, world_size: int, src, assignment, expt_indx, indx) -> int:
    """Validate a call against its problem; return n_tokens_local. BackendError names the culprit."""
    op, shape, record = problem.op, problem.shape, problem.record
    dtype = DTYPES[problem.dtype]
    _check_tensor("src", src, device, (dtype,), op)
    _check_tensor("expt_indx", expt_indx, device, INDEX_DTYPES, op)
    _check_tensor(record.index_name, indx, device, INDEX_DTYPES, op)
    if not isinstance(assignment, ExptAssignment):
        raise BackendError(f"{op}: assignment must be an ExptAssignment, got {type(assignment).__name__}")
    _check_tensor("assignment.expt_owner", assignment.expt_owner, device, (torch.int32,), op)
    if assignment.expt_owner.dim() != 1 or assignment.expt_owner.numel() != assignment.n_expts_tot:
        raise BackendError(f"{op}: assignment.expt_owner has shape {tuple(assignment.expt_owner.shape)}, expected "
                           f"[{assignment.n_expts_tot}] (one owner per expert)")
    if assignment.n_expt_shard != world_size:
        raise BackendError(f"{op}: assignment has {assignment.n_expt_shard} shards, the group {world_size} ranks")
    if assignment.n_expts_tot != shape.n_expts_tot:
        raise BackendError(f"{op}: assignment has {assignment.n_expts_tot} experts, the problem {shape.n_expts_tot}")
    if expt_indx.dim() != 2 or expt_indx.shape[1] != shape.n_expts_act:
        raise BackendError(f"{op}: expt_indx has shape {tuple(expt_indx.shape)}, expected "
                           f"[n_tokens_global, {shape.n_expts_act}]")
    if expt_indx.shape[0] % world_size:
        raise BackendError(f"{op}: n_tokens_global={expt_indx.shape[0]} is not a multiple of world size {world_size}")
    n_tokens_local = expt_indx.shape[0] // world_size
    n_pairs = expt_indx.numel()
    if indx.numel() != n_pairs:
        raise BackendError(f"{op}: index tensor of shape {tuple(indx.shape)} has {indx.numel()} entries, "
                           f"expected n_tokens_global * k = {n_pairs}")
    src_rows = record.src_rows(n_tokens_local, n_pairs)
    if src.dim() != 2 or src.shape[1] != shape.d_model or src.shape[0] != src_rows:
        what = "n_tokens_local" if record.to_experts else "n_tokens_global * k"
        raise BackendError(f"{op}: src has shape {tuple(src.shape)}, expected [{src_rows}, {shape.d_model}] "
                           f"([{what}, d_model]; n_tokens_global={expt_indx.shape[0]} must be "
                           f"world size {world_size} * n_tokens_local)")
    return n_tokens_local


def ids_digest(expt_indx: torch.Tensor) -> str:
    """12 hex digits of a SHA-1 over the values of ``expt_indx`` (as int64): the ranks compare it
    at a call's first use, since every rank must pass the same ids. Reads the ids back."""
    return hashlib.sha1(expt_indx.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()[:12]


def check_index_ranges(op: str, expt_indx: torch.Tensor, indx: torch.Tensor, expt_owner: torch.Tensor,
                       world_size: int) -> None:
    """BackendError unless every owner in ``expt_owner`` is a rank in [0, world_size) and ``indx``
    (gate_indx / topk_indx) holds every pair index of [0, n_tokens_global * k) exactly once.
    Reads a few numbers back from the device: call it once per prepared call, outside a
    CUDA-graph capture (after :func:`check_inputs`, which fixed the sizes)."""
    if expt_owner.numel():
        low, high = (int(v) for v in torch.aminmax(expt_owner))
        if low < 0 or high >= world_size:
            raise BackendError(f"{op}: assignment.expt_owner holds ranks in [{low}, {high}], outside the group's "
                               f"[0, {world_size}); build it with autosymm.make_expt_assignment({world_size}, ...)")
    if indx.numel() == 0:
        return
    n_pairs = expt_indx.numel()
    name = collective(op).index_name
    flat = indx.reshape(-1)
    low, high = (int(v) for v in torch.aminmax(flat))
    if low < 0 or high >= n_pairs:
        raise BackendError(f"{op}: {name} holds values in [{low}, {high}], outside [0, {n_pairs}) "
                           f"(n_tokens_global * k); build it with autosymm.route(expt_indx)")
    counts = torch.bincount(flat.long(), minlength=n_pairs)
    repeated = int(counts.argmax())
    times = int(counts[repeated])
    if times > 1:  # n_pairs values in range, one repeated: not a permutation (some row never written)
        raise BackendError(f"{op}: {name} is not a permutation of [0, {n_pairs}) (n_tokens_global * k): "
                           f"{int((counts == 0).sum())} value(s) missing, {repeated} given {times} times; "
                           f"build it with autosymm.route(expt_indx)")

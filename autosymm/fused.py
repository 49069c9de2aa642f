"""``all_reduce_rmsnorm``: the all-reduce of a tensor-parallel layer fused with the residual add
and the RMSNorm that follow it. Its record (problem, checks, custom op
``torch.ops.autosymm.all_reduce_rmsnorm``) is autosymm.collectives.all_reduce_rmsnorm.

Calls are decided and prepared through the group state of autosymm.group (the same databases,
rank agreement, workspace and cache of prepared calls as ``all_reduce``), keyed by
(record, dtype, x shape, capturing): a repeated call is a dict lookup and the launcher.
"""

from __future__ import annotations

import torch

from .collectives import ALL_REDUCE_RMSNORM, prepare_call
from .dist_compat import group_name as name_of_group
from .group import STATES, state_of, stream_capturing


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       group=None) -> torch.Tensor:
    """On every rank of ``group``: ``residual += all_reduce(x)`` (in place) and return
    ``rmsnorm(residual) * weight`` as a new tensor.

    ``x`` and ``residual``: [tokens, hidden], contiguous, one dtype (bf16, fp16 or fp32) and
    ``residual`` the same on every rank (tensor parallelism); ``weight``: [hidden], same dtype.
    Sums and the norm are taken in fp32 (the norm of the unrounded sum) and rounded once; every
    rank ends with bit-identical ``residual`` and output. ``x`` is scratch: the Triton kernels
    leave it unchanged, the NCCL path leaves the sum in it. Under torch.compile (or another tracer,
    which hands over tensor subclasses) the call is ``torch.ops.autosymm.all_reduce_rmsnorm``.
    """
    if type(x) is not torch.Tensor or torch.compiler.is_dynamo_compiling():
        return torch.ops.autosymm.all_reduce_rmsnorm(x, residual, weight, eps, name_of_group(group))
    state = STATES.get(group) or state_of(group)
    key = (ALL_REDUCE_RMSNORM, x.dtype, x.shape, stream_capturing())
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, ALL_REDUCE_RMSNORM, key, (x, residual, weight))
    entry.calls += 1
    return entry.launcher(x, residual, weight, eps)

"""``all_reduce_rmsnorm``: the all-reduce of a tensor-parallel layer fused with the residual add
and the RMSNorm that follow it. Its record (problem, checks, custom op
``torch.ops.autosymm.all_reduce_rmsnorm``) is autosymm.collectives.all_reduce_rmsnorm.

Calls are decided and prepared through the group state of autosymm.group (the same databases,
rank agreement, workspace and cache of prepared calls as ``all_reduce``), keyed by
(record, dtype, x shape, capturing): a repeated call is its arguments' checks (shapes, dtypes,
devices, contiguity, no aliasing: before anything runs), a dict lookup and the launcher. An
eager call whose launcher replays (autosymm.replay.FusedReplay) becomes the group's hot call
(autosymm.replay.FUSED_HOT): a repeat of its dtype and shape skips the key, and its replay checks
the arguments (a plan only at the checked call's addresses, a miss through check_args).
"""

from __future__ import annotations

import torch

from .collectives import ALL_REDUCE_RMSNORM, prepare_call
from .collectives.all_reduce_rmsnorm import check_args
from .dist_compat import group_name as name_of_group
from .group import STATES, check_traced, current_raw_stream, state_of, stream_capturing
from .replay import FUSED_HOT, FusedReplay, HotFused

_dynamo_compiling = torch.compiler.is_dynamo_compiling


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
    Where an input requires grad it is ``all_reduce_rmsnorm_functional`` (differentiable:
    autosymm.autograd) and the new residual is copied into ``residual``.
    """
    if (x.requires_grad or residual.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        out, new_residual = torch.ops.autosymm.all_reduce_rmsnorm_functional(x, residual, weight, eps,
                                                                             name_of_group(group))
        residual.copy_(new_residual)
        return out
    if type(x) is not torch.Tensor or _dynamo_compiling():
        check_traced(x, "all_reduce_rmsnorm")
        return torch.ops.autosymm.all_reduce_rmsnorm(x, residual, weight, eps, name_of_group(group))
    # The hot path: the group's last prepared eager call (replay.FUSED_HOT), of x's dtype and shape,
    # while nothing captures (on torch's default stream nothing can); its replay checks the rest.
    hot = FUSED_HOT.get(group)
    if (hot is not None and hot.dtype is x.dtype and hot.shape == x.shape
            and (current_raw_stream(hot.device_index) == 0 or not stream_capturing())):
        hot.entry.calls += 1
        return hot.call(x, residual, weight, eps)
    return fused_call(x, residual, weight, eps, group)


def fused_call(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group) -> torch.Tensor:
    """The keyed eager path of :func:`all_reduce_rmsnorm` for plain tensors (the custom ops' impls)."""
    state = STATES.get(group) or state_of(group)
    key = (ALL_REDUCE_RMSNORM, x.dtype, x.shape, stream_capturing())
    try:
        check_args(x, residual, weight, state.device)  # every call, before anything runs (the key names x only)
    except ValueError:
        # a new call (or checked mode): every rank learns of it, as prepare_call checks the call with
        # every rank, then raises; a prepared one raises here alone, as its peers agree on nothing
        if state.check_calls or key not in state.cache:
            prepare_call(state, ALL_REDUCE_RMSNORM, key, (x, residual, weight))
        raise
    entry = state.cache.get(key)
    if entry is None:
        entry = prepare_call(state, ALL_REDUCE_RMSNORM, key, (x, residual, weight))
    entry.calls += 1
    launcher = entry.launcher
    if not key[-1] and type(launcher) is FusedReplay and not state.check_calls:  # checked: never hot
        FUSED_HOT[group] = HotFused(x.dtype, x.shape, launcher.device_index, entry, launcher)
    return launcher(x, residual, weight, eps)

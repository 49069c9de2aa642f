"""``all_reduce_rmsnorm``: the all-reduce of a tensor-parallel layer fused with the residual add
and the RMSNorm that follow it, and its torch custom op ``torch.ops.autosymm.all_reduce_rmsnorm``.

Calls are decided and prepared through the group state of autosymm.api (the same databases,
rank agreement, workspace and cache of prepared calls as ``all_reduce``), keyed by
(dtype, tokens, hidden, capturing): a repeated call is a dict lookup and the launcher.
"""

from __future__ import annotations

import torch

from .group import STATES, Entry, GroupState, check_tensor, state_of, stream_capturing
from .dispatch import Decision
from .dist_compat import group_name as name_of_group, resolve_group
from .problem import Problem, dtype_name

OP = "all_reduce_rmsnorm"


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
    key = (OP, x.dtype, x.shape, stream_capturing())
    entry = state.cache.get(key)
    if entry is None:
        entry = _prepare(state, x, residual, weight, key)
    entry.calls += 1
    return entry.launcher(x, residual, weight, eps)


def _prepare(state: GroupState, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, key: tuple) -> Entry:
    """The first call of a key: checked, decided and prepared on every rank alike (a bad tensor on
    one rank raises on all of them: autosymm.api's agreed_check)."""
    mode = "graph" if key[-1] else "eager"
    call = f"{OP} of {x.dtype} {tuple(x.shape)} in {mode} mode"
    entry = state.agreed_check(call, lambda: _build(state, x, residual, weight, mode))
    entry.bytes_per_call = x.numel() * x.element_size()
    state.cache[key] = entry
    return entry


def _build(state: GroupState, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, mode: str) -> Entry:
    """This rank's checks (ValueError naming the bad tensor), decision and launcher."""
    for tensor in (x, residual, weight):
        check_tensor(tensor, state, OP)
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"autosymm.{OP}: x {tuple(x.shape)} and residual {tuple(residual.shape)} must both be "
                         "[tokens, hidden]")
    if tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"autosymm.{OP}: weight {tuple(weight.shape)} must be [hidden] = [{x.shape[1]}]")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"autosymm.{OP}: x {x.dtype}, residual {residual.dtype} and weight {weight.dtype} must "
                         "share one dtype")
    dtype = dtype_name(x.dtype)  # ValueError naming an unsupported dtype
    n_tokens, hidden = int(x.shape[0]), int(x.shape[1])
    if n_tokens == 0 or hidden == 0:  # the same on every rank (x's shape is replicated)
        return Entry(Decision("noop", None, "no rows: nothing to exchange", mode=mode), _empty_call)
    return state.prepare(Problem.all_reduce_rmsnorm(n_tokens, hidden, dtype, state.world_size), mode)


def _empty_call(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """No rows (on every rank alike): nothing to exchange."""
    return torch.empty_like(x)


@torch.library.custom_op("autosymm::all_reduce_rmsnorm", mutates_args=("x", "residual"))
def _all_reduce_rmsnorm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           group_name: str) -> torch.Tensor:
    """``torch.ops.autosymm.all_reduce_rmsnorm(x, residual, weight, eps, group_name)``: the custom
    op of :func:`all_reduce_rmsnorm` (x is declared mutated: the NCCL path sums into it)."""
    return all_reduce_rmsnorm(x, residual, weight, eps, resolve_group(group_name))


@_all_reduce_rmsnorm_op.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)

"""Autograd formulas of autosymm's functional custom ops, those of ``torch.distributed.nn.functional``
where it has one (each op's door declares them with its custom op; autosymm.ops registers them).

* ``all_reduce``: the gradient is the all-reduce (sum) of the gradients (``avg``: their average);
  other reduce ops raise in backward (torch's formula is not their derivative).
* ``all_reduce_rmsnorm_functional``: RMSNorm's gradient (Gemma's ``1 + weight`` included), then
  the all-reduce of it for ``x``, computed in fp32 from the rounded new residual; the quantized
  epilogues have no backward.
* ``dp_to_ep`` / ``ep_to_dp``: each one's backward is the other direction with the same routing;
  rows no pair fills get a zero gradient.

Design notes: docs/DISPATCH.md#collectives-autograd
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist_compat import resolve_group

#: Reduce ops whose all-reduce is linear in the inputs, so the gradient is an all-reduce of the
#: gradients with the same op.
LINEAR_OPS = ("sum", "avg")


def all_reduce_setup(ctx, inputs, output) -> None:
    _, ctx.op, ctx.group_name = inputs


def all_reduce_backward(ctx, grad: torch.Tensor):
    if ctx.op not in LINEAR_OPS:
        raise RuntimeError(f"autosymm.all_reduce: no gradient for op={ctx.op!r} (only {', '.join(LINEAR_OPS)} are "
                           "linear in their inputs); detach the input or reduce with torch.distributed")
    return torch.ops.autosymm.all_reduce(grad, ctx.op, ctx.group_name), None, None


def fused_setup(ctx, inputs, output) -> None:
    _, residual, weight, ctx.eps, ctx.group_name = inputs[:5]
    ctx.gemma = bool(inputs[5]) if len(inputs) > 5 else False
    ctx.has_residual = residual is not None
    ctx.save_for_backward(output[1], weight)


def fused_backward(ctx, grad_out, grad_residual):
    new_residual, weight = ctx.saved_tensors
    s = new_residual.float()
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + ctx.eps)
    grad_s = torch.zeros_like(s)
    grad_weight = None
    if grad_out is not None:
        g = grad_out.float() * (weight.float() + 1 if ctx.gemma else weight.float())
        grad_s += r * g - s * r.pow(3) * (g * s).mean(-1, keepdim=True)
        grad_weight = (grad_out.float() * s * r).sum(0).to(weight.dtype)
    if grad_residual is not None:
        grad_s += grad_residual.float()
    grad_s = grad_s.to(new_residual.dtype)
    grad_x = torch.ops.autosymm.all_reduce(grad_s, "sum", ctx.group_name)
    return grad_x, grad_s if ctx.has_residual else None, grad_weight, None, None, None


def _valid(expt_indx: torch.Tensor, n_expts_tot: int) -> torch.Tensor:
    return (expt_indx >= 0) & (expt_indx < n_expts_tot)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of 0..n-1 (int32, as autosymm.route gives them)."""
    flat = permutation.reshape(-1).long()
    inverse = torch.empty_like(flat)
    inverse[flat] = torch.arange(flat.numel(), device=flat.device)
    return inverse.to(torch.int32)


def moe_setup(ctx, inputs, output) -> None:
    src, assignment, ctx.n_expts_per_shard, expt_indx, indx, ctx.group_name = inputs
    ctx.n_src_rows = src.shape[0]
    ctx.save_for_backward(*assignment, expt_indx, indx)


def _rank(group_name: str) -> int:
    return dist.get_rank(resolve_group(group_name))


def dp_to_ep_backward(ctx, grad_rows):
    """ep->dp of the gradient rows (expert order) to this rank's pairs, summed over top-k."""
    *assignment, expt_indx, gate_indx = ctx.saved_tensors
    n_tokens_local, k = ctx.n_src_rows, expt_indx.shape[1]
    topk_indx = _inverse(gate_indx)
    pairs = torch.ops.autosymm.ep_to_dp(grad_rows.contiguous(), assignment, ctx.n_expts_per_shard, expt_indx,
                                        topk_indx, ctx.group_name)
    start = _rank(ctx.group_name) * n_tokens_local
    mine = _valid(expt_indx[start:start + n_tokens_local], assignment[2].shape[1]).reshape(-1, 1)
    pairs = torch.where(mine, pairs, torch.zeros((), dtype=pairs.dtype, device=pairs.device))
    return pairs.view(n_tokens_local, k, -1).sum(1), [None] * len(assignment), None, None, None, None


def ep_to_dp_backward(ctx, grad_pairs):
    """dp->ep of this rank's pair gradients (one pair a "token", top-k 1) to the experts' rows."""
    *assignment, expt_indx, topk_indx = ctx.saved_tensors
    gate_indx = _inverse(topk_indx).view(-1, 1)
    rows = torch.ops.autosymm.dp_to_ep(grad_pairs.contiguous(), assignment, ctx.n_expts_per_shard,
                                       expt_indx.reshape(-1, 1), gate_indx, ctx.group_name)
    expt_owner = assignment[3]
    experts = expt_indx.reshape(-1)[topk_indx.long()]  # the expert of each expert-ordered row
    valid = _valid(experts, assignment[2].shape[1])
    mine = valid & (expt_owner[experts.clamp(0, expt_owner.numel() - 1).long()] == _rank(ctx.group_name))
    rows = torch.where(mine.view(-1, 1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return rows, [None] * len(assignment), None, None, None, None

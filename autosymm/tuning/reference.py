"""A tuning problem's inputs and this rank's reference output (autosymm.tuning.sweep validates every
candidate against it before timing it).

All-reduce: small multiples of 1/4 as the validation input, so every partial sum of <= 8 ranks
is exact in bf16/fp16/fp32 and the reference (NCCL's all_reduce of the same input) does not
depend on the summation order. Fused all-reduce + RMSNorm: the same for x and the residual (the
updated residual is exact too); the expected result is that residual stacked on its RMSNorm *
weight computed in fp32 (a launcher's result is stacked the same way by :meth:`ProblemData.result`). MoE: random rows routed by the same expert indices on every
rank; the reference is computed by plain torch from a gathered copy of every rank's input.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..problem import DTYPES, MOE_OPS, Problem
from ..routing import ExptAssignment

_SEED = 1234
FUSED_EPS = 1e-6


def moe_reference_for_rank(op: str, gathered: torch.Tensor, owner_of_pair: torch.Tensor, indx: torch.Tensor,
                           rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected output, bool mask of the rows the op writes) of ``rank``, on ``gathered``'s
    device. ``gathered`` [R, rows, d] holds every rank's src; ``owner_of_pair`` [n_pairs] the
    rank owning each (token, k) pair's expert (-1: dropped); ``indx`` is gate_indx (dp_to_ep) or
    topk_indx (ep_to_dp). Same semantics as reference_dp_to_ep / reference_ep_to_dp below (tested against them)."""
    world_size, rows, d_model = gathered.shape
    owner = owner_of_pair.reshape(-1).long()
    n_pairs = owner.numel()
    idx = indx.reshape(-1).long()
    if op == "dp_to_ep":
        k = n_pairs // (world_size * rows)
        x = gathered.reshape(world_size * rows, d_model)
        pairs = torch.nonzero(owner == rank).flatten()
        ref = torch.zeros((n_pairs, d_model), dtype=gathered.dtype, device=gathered.device)
        mask = torch.zeros(n_pairs, dtype=torch.bool, device=gathered.device)
        ref[idx[pairs]] = x[pairs // k]
        mask[idx[pairs]] = True
        return ref, mask
    if op == "ep_to_dp":
        n_local_pairs = n_pairs // world_size
        sorted_rows = torch.arange(n_pairs, device=gathered.device)
        pairs = idx[sorted_rows]
        sender = owner[pairs]
        sel = (sender >= 0) & (pairs // n_local_pairs == rank)
        ref = torch.zeros((n_local_pairs, d_model), dtype=gathered.dtype, device=gathered.device)
        mask = torch.zeros(n_local_pairs, dtype=torch.bool, device=gathered.device)
        dest = pairs[sel] - rank * n_local_pairs
        ref[dest] = gathered[sender[sel], sorted_rows[sel]]
        mask[dest] = True
        return ref, mask
    raise ValueError(f"op={op!r} is not one of {MOE_OPS}")


def check_output(out: Any, expected: torch.Tensor, mask: Optional[torch.Tensor], *, exact: bool) -> None:
    """Raise ValueError unless ``out`` matches ``expected`` (on the rows of ``mask``). NaN never
    passes; ``exact`` for pure copies, else a bf16-level tolerance (atol = rtol = 1e-2)."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"launcher returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(expected.shape) or out.dtype != expected.dtype:
        raise ValueError(f"output {tuple(out.shape)} {out.dtype} != expected {tuple(expected.shape)} {expected.dtype}")
    got, want = (out[mask], expected[mask]) if mask is not None else (out, expected)
    if got.numel() == 0:
        return
    if exact:
        bad = got.view(torch.int16 if got.element_size() == 2 else torch.int32) != \
            want.view(torch.int16 if want.element_size() == 2 else torch.int32)
        if bool(bad.any()):
            raise ValueError(f"wrong result: {int(bad.any(dim=-1).sum())} of {got.shape[0]} rows differ")
        return
    got32, want32 = got.float(), want.float()
    err = (got32 - want32).abs()
    tol = 1e-2 + 1e-2 * want32.abs()
    bad = ~(err <= tol)  # NaN compares False: never passes
    if bool(bad.any()):
        first = int(torch.nonzero(bad.reshape(-1))[0])
        got_v, want_v = got32.reshape(-1)[first].item(), want32.reshape(-1)[first].item()
        raise ValueError(f"wrong result: {int(bad.sum())} of {bad.numel()} elements off (first at flat index "
                         f"{first}: got {got_v}, expected {want_v})")


class ProblemData:
    """One problem's inputs and this rank's reference, on ``device``. ``allocate`` is local (may
    fail: out of memory); ``build_reference`` runs NCCL collectives on ``group``."""

    def __init__(self, problem: Problem, group, device: torch.device, rank: int, n_inputs: int):
        self.problem, self.group, self.device, self.rank, self.n_inputs = problem, group, device, rank, n_inputs
        self.dtype = DTYPES[problem.dtype]
        self.expected: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None
        self.exact = problem.op in MOE_OPS

    def allocate(self) -> None:
        p, dev = self.problem, self.device
        gen = torch.Generator(device=dev).manual_seed(_SEED * 1009 + self.rank)
        if p.op == "all_reduce_rmsnorm":
            shape = (p.n_tokens_local, p.hidden)
            self.val_input = _quarters(shape, gen, dev, self.dtype)
            same = torch.Generator(device=dev).manual_seed(_SEED)  # residual and weight: replicated
            self.residual, self.weight = _quarters(shape, same, dev, self.dtype), _quarters((p.hidden,), same, dev,
                                                                                            self.dtype)
            self.timing = [torch.empty(shape, dtype=self.dtype, device=dev) for _ in range(self.n_inputs)]
            self.timing_residuals = [torch.empty_like(t) for t in self.timing]
            self.extra = ()
        elif p.op == "all_reduce":
            # small multiples of 1/4: every partial sum of <= 8 ranks is exact in bf16/fp16/fp32,
            # so the reference does not depend on the summation order
            self.val_input = torch.randint(-8, 9, (p.numel,), generator=gen, device=dev, dtype=torch.int8
                                           ).to(self.dtype).mul_(0.25)
            self.timing = [torch.empty(p.numel, dtype=self.dtype, device=dev) for _ in range(self.n_inputs)]
            self.extra: tuple = ()
        else:
            from ..routing import make_expt_assignment, make_expt_dict_uniform, random_expt_indx, route

            shape, world_size = p.shape, p.world_size
            n_global = world_size * p.n_tokens_local
            self.assignment = make_expt_assignment(world_size, shape.n_expts_tot,
                                                   make_expt_dict_uniform(world_size, shape.n_expts_tot), dev)
            self.expt_indx = random_expt_indx(n_global, shape.n_expts_tot, shape.n_expts_act,
                                              seed=_SEED + p.n_tokens_local, device=dev)  # same on every rank
            gate_indx, topk_indx = route(self.expt_indx, shape.n_expts_tot)
            self.indx = gate_indx if p.op == "dp_to_ep" else topk_indx
            rows = p.n_tokens_local if p.op == "dp_to_ep" else n_global * shape.n_expts_act
            self.val_input = torch.randn((rows, shape.d_model), generator=gen, device=dev).to(self.dtype)
            self.timing = [torch.empty_like(self.val_input) for _ in range(self.n_inputs)]
            self.extra = (self.assignment, self.expt_indx, self.indx)
        self.refresh()

    def refresh(self) -> None:
        """Fresh random timing inputs (in-place all-reduces grow them call after call)."""
        for t in self.timing + getattr(self, "timing_residuals", []):
            t.normal_()

    def build_reference(self) -> None:
        import torch.distributed as dist

        p = self.problem
        if p.op == "all_reduce_rmsnorm":
            total = self.val_input.clone()
            dist.all_reduce(total, group=self.group)  # exact: small multiples of 1/4
            new = self.residual.float() + total.float()
            out = new * torch.rsqrt(new.pow(2).mean(-1, keepdim=True) + FUSED_EPS) * self.weight.float()
            self.expected = torch.stack((new.to(self.dtype), out.to(self.dtype)))
        elif p.op == "all_reduce":
            self.expected = self.val_input.clone()
            dist.all_reduce(self.expected, group=self.group)
        else:
            gathered = torch.empty((p.world_size, *self.val_input.shape), dtype=self.dtype, device=self.device)
            dist.all_gather(list(gathered.unbind(0)), self.val_input, group=self.group)  # stable API, any torch
            e = self.expt_indx.reshape(-1).long()
            n_expts = self.assignment.n_expts_tot
            owner = torch.where((e >= 0) & (e < n_expts),
                                self.assignment.expt_owner.long()[e.clamp(0, n_expts - 1)], -1)
            self.expected, self.mask = moe_reference_for_rank(p.op, gathered, owner, self.indx, self.rank)
            del gathered
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def validation_args(self) -> tuple:
        if self.problem.op == "all_reduce_rmsnorm":  # residual updated in place; x may be (NCCL)
            return (self.val_input.clone(), self.residual.clone(), self.weight, FUSED_EPS)
        x = self.val_input.clone() if self.problem.op == "all_reduce" else self.val_input  # all-reduce is in place
        return (x, *self.extra)

    def result(self, out: Any, args: tuple) -> Any:
        """What is checked of a launcher's return value ``out`` for ``args``: the fused op's updated
        residual stacked on its output (the expected value's layout), else ``out`` itself."""
        if self.problem.op == "all_reduce_rmsnorm" and isinstance(out, torch.Tensor):
            return torch.stack((args[1], out))
        return out

    def timing_args(self) -> list[tuple]:
        if self.problem.op == "all_reduce_rmsnorm":
            return [(t, r, self.weight, FUSED_EPS) for t, r in zip(self.timing, self.timing_residuals)]
        return [(t, *self.extra) for t in self.timing]


def _quarters(shape: tuple, gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Random multiples of 1/4 in [-2, 2]: sums of a few of them are exact in every float dtype."""
    return torch.randint(-8, 9, shape, generator=gen, device=device, dtype=torch.int8).to(dtype).mul_(0.25)


# ------------------------------------------------------------------------------------------
# The MoE conversions' references (tests, and the tuner's validation)
# ------------------------------------------------------------------------------------------

def _pair_owner(assignment: ExptAssignment, expt_indx: torch.Tensor) -> torch.Tensor:
    """int64 [n_pairs]: owning rank of each pair, -1 for a dropped pair."""
    e = expt_indx.reshape(-1).long().cpu()
    owner = assignment.expt_owner.long().cpu()
    valid = (e >= 0) & (e < owner.numel())
    return torch.where(valid, owner[e.clamp(0, owner.numel() - 1)], -1)


def _outputs(out, world_size: int, shape: tuple[int, int], like: torch.Tensor) -> list[torch.Tensor]:
    if out is None:
        return [torch.zeros(shape, dtype=like.dtype) for _ in range(world_size)]
    if len(out) != world_size or any(tuple(o.shape) != shape for o in out):
        raise ValueError(f"out must be {world_size} tensors of shape {shape}")
    return [o.detach().cpu().clone() for o in out]


def reference_dp_to_ep(srcs: Sequence[torch.Tensor], assignment: ExptAssignment, expt_indx: torch.Tensor,
                       gate_indx: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """Every rank's dp->ep buffer [n_tokens_global * k, d_model] (CPU), from every rank's ``src``.

    Rows no pair writes are taken from ``out`` (copied, default zeros).
    """
    world_size = len(srcs)
    n_tokens_local, d_model = srcs[0].shape
    n_expts_act = expt_indx.shape[1]
    x = torch.cat([s.detach().cpu() for s in srcs])  # [n_tokens_global, d_model]
    dsts = _outputs(out, world_size, (x.shape[0] * n_expts_act, d_model), x)
    owner = _pair_owner(assignment, expt_indx)
    gate = gate_indx.reshape(-1).long().cpu()
    for rank in range(world_size):
        pairs = torch.nonzero(owner == rank).flatten()
        dsts[rank][gate[pairs]] = x[pairs // n_expts_act]
    return dsts


def reference_ep_to_dp(srcs: Sequence[torch.Tensor], assignment: ExptAssignment, expt_indx: torch.Tensor,
                       topk_indx: torch.Tensor, out: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """Every rank's ep->dp buffer [n_tokens_local * k, d_model] (CPU), from every rank's
    expert-sorted ``src`` [n_tokens_global * k, d_model] (only its own experts' rows are read)."""
    world_size = len(srcs)
    n_rows, d_model = srcs[0].shape
    n_pairs_local = n_rows // world_size
    dsts = _outputs(out, world_size, (n_pairs_local, d_model), srcs[0])
    owner = _pair_owner(assignment, expt_indx)
    topk = topk_indx.reshape(-1).long().cpu()
    for rank in range(world_size):
        rows = torch.nonzero(owner[topk] == rank).flatten()
        pairs = topk[rows]
        src = srcs[rank].detach().cpu()
        for home in range(world_size):
            mine = (pairs // n_pairs_local) == home
            dsts[home][pairs[mine] - home * n_pairs_local] = src[rows[mine]]
    return dsts


def rows_written(op: str, assignment: ExptAssignment, expt_indx: torch.Tensor, indx: torch.Tensor,
                 world_size: int) -> list[torch.Tensor]:
    """bool mask of the destination rows ``op`` writes on each rank (CPU); ``indx`` is
    gate_indx for 'dp_to_ep', topk_indx for 'ep_to_dp' (unused there: every valid pair's row)."""
    owner = _pair_owner(assignment, expt_indx)
    n_pairs = owner.numel()
    if op == "dp_to_ep":
        gate = indx.reshape(-1).long().cpu()
        masks = [torch.zeros(n_pairs, dtype=torch.bool) for _ in range(world_size)]
        for rank in range(world_size):
            masks[rank][gate[owner == rank]] = True
        return masks
    if op == "ep_to_dp":
        return list((owner >= 0).view(world_size, n_pairs // world_size).unbind(0))
    raise ValueError(f"op={op!r} is not 'dp_to_ep' or 'ep_to_dp'")

"""Expert placement, routing indices and pure-torch references of the MoE token conversions.

Terms (as in triton_kernels' distributed MoE): ``R`` ranks each hold ``n_tokens_local`` tokens;
``expt_indx`` [n_tokens_global, k] holds every token's top-k global expert ids (identical on
all ranks, ``n_tokens_global = R * n_tokens_local``, -1 marks a dropped pair). Pairs are
flattened ``p = t * k + j``; ``topk_indx`` [n_tokens_global * k] lists pairs in expert order
(stable) and ``gate_indx`` [n_tokens_global, k] is its inverse (pair -> sorted row).

* dp->ep: pair (t, j) of a local token is written to row ``gate_indx[t, j]`` of the
  [n_tokens_global * k, d_model] buffer of the rank owning expert ``expt_indx[t, j]``.
* ep->dp: every rank sends the sorted rows of its own experts back: row ``s`` (pair
  ``p = topk_indx[s]``) goes to row ``p % (n_tokens_local * k)`` of the
  [n_tokens_local * k, d_model] buffer of token ``p // k``'s home rank.

Rows of dropped pairs (expert id outside ``[0, n_expts_tot)``) are written by neither op; the
references leave them as they were (see ``rows_written``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "ExptAssignment", "make_expt_assignment", "make_expt_dict_uniform", "make_expt_dict_random", "route",
    "random_expt_indx", "reference_dp_to_ep", "reference_ep_to_dp", "rows_written",
]


@dataclass
class ExptAssignment:
    """Which shard (rank) owns which expert; every tensor lives on the assignment's device."""

    #: int32 [n_expt_shard, ceil(n_expts_tot / 32)]: bit e%32 of word e//32 of row i set iff shard i owns e
    expt_bitmask: torch.Tensor
    #: bool [n_expt_shard, n_expts_tot]: True iff shard i owns expert e
    expt_boolmask: torch.Tensor
    #: int32 [n_expt_shard, n_expts_tot]: local id of expert e on shard i (sorted order), -1 if not owned
    expt_map: torch.Tensor
    #: experts per shard
    n_expts_per_shard: list[int]
    #: int32 [n_expts_tot]: the shard owning expert e (what the conversion kernels read)
    expt_owner: torch.Tensor

    @property
    def n_expt_shard(self) -> int:
        return int(self.expt_map.shape[0])

    @property
    def n_expts_tot(self) -> int:
        return int(self.expt_map.shape[1])


def make_expt_dict_uniform(n_expt_shard: int, n_expt_tot: int) -> dict[int, list[int]]:
    """Contiguous placement: shard i owns a block of consecutive experts (sizes differ by <= 1)."""
    _check_counts(n_expt_shard, n_expt_tot)
    base, extra = divmod(n_expt_tot, n_expt_shard)
    out, start = {}, 0
    for shard in range(n_expt_shard):
        size = base + (shard < extra)
        out[shard] = list(range(start, start + size))
        start += size
    return out


def make_expt_dict_random(n_expt_shard: int, n_expt_tot: int, seed: int = 0) -> dict[int, list[int]]:
    """Random placement: disjoint random subsets of random (non-zero) sizes, reproducible by ``seed``."""
    _check_counts(n_expt_shard, n_expt_tot)
    rng = random.Random(seed)
    perm = list(range(n_expt_tot))
    rng.shuffle(perm)
    cuts = [0] + sorted(rng.sample(range(1, n_expt_tot), n_expt_shard - 1)) + [n_expt_tot]
    return {shard: sorted(perm[cuts[shard]:cuts[shard + 1]]) for shard in range(n_expt_shard)}


def _check_counts(n_expt_shard: int, n_expt_tot: int) -> None:
    if n_expt_shard < 1:
        raise ValueError(f"n_expt_shard={n_expt_shard} must be >= 1")
    if n_expt_tot < n_expt_shard:
        raise ValueError(f"n_expt_tot={n_expt_tot} experts cannot fill n_expt_shard={n_expt_shard} shards")


def make_expt_assignment(n_expt_shard: int, n_expt_tot: int, expt_dict: dict[int, Sequence[int]],
                         device="cpu") -> ExptAssignment:
    """Build an :class:`ExptAssignment` from ``expt_dict[shard] = [expert ids]``.

    Every expert must be owned by exactly one shard and every shard must own at least one
    expert; ValueError names the offending shard or expert otherwise.
    """
    _check_counts(n_expt_shard, n_expt_tot)
    owner = [-1] * n_expt_tot
    for shard, experts in expt_dict.items():
        if not isinstance(shard, int) or not 0 <= shard < n_expt_shard:
            raise ValueError(f"shard {shard!r} out of range [0, {n_expt_shard})")
        if not isinstance(experts, (list, tuple, range)):
            raise TypeError(f"expt_dict[{shard}] must be a list of expert ids, got {type(experts).__name__}")
        for e in experts:
            if isinstance(e, bool) or not isinstance(e, int):
                raise TypeError(f"expt_dict[{shard}] holds {e!r}: expert ids must be ints")
            if not 0 <= e < n_expt_tot:
                raise ValueError(f"expert id {e} of shard {shard} out of range [0, {n_expt_tot})")
            if owner[e] != -1:
                raise ValueError(f"expert {e} is owned by two shards: {owner[e]} and {shard}")
            owner[e] = shard
    for shard in range(n_expt_shard):
        if not expt_dict.get(shard):
            raise ValueError(f"shard {shard} owns no expert")
    unowned = [e for e in range(n_expt_tot) if owner[e] == -1]
    if unowned:
        raise ValueError(f"expert {unowned[0]} is owned by no shard ({len(unowned)} unowned in all)")

    expt_owner = torch.tensor(owner, dtype=torch.int32)
    experts = torch.arange(n_expt_tot)
    boolmask = expt_owner[None, :] == torch.arange(n_expt_shard, dtype=torch.int32)[:, None]
    words = (n_expt_tot + 31) // 32
    bits = torch.zeros(n_expt_shard, words * 32, dtype=torch.int64)
    bits[:, :n_expt_tot] = boolmask.long() << (experts % 32)
    bitmask = bits.view(n_expt_shard, words, 32).sum(-1)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)  # two's complement
    local_id = torch.cumsum(boolmask.int(), dim=1) - 1
    expt_map = torch.where(boolmask, local_id, -1).to(torch.int32)
    return ExptAssignment(bitmask.to(device), boolmask.to(device), expt_map.to(device),
                          boolmask.sum(1).tolist(), expt_owner.to(device))


def route(expt_indx: torch.Tensor, n_expts_tot: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_indx [n_tokens, k], topk_indx [n_tokens * k]), int32 on ``expt_indx``'s device.

    ``topk_indx`` is the stable argsort of ``expt_indx.flatten()`` (sorted row -> pair) with
    invalid ids (< 0, or >= ``n_expts_tot`` when given) sorted last; ``gate_indx`` its inverse.
    """
    if expt_indx.dim() != 2:
        raise ValueError(f"expt_indx must be [n_tokens, k], got shape {tuple(expt_indx.shape)}")
    if expt_indx.dtype.is_floating_point or expt_indx.dtype == torch.bool:
        raise ValueError(f"expt_indx must hold integer expert ids, got {expt_indx.dtype}")
    keys = expt_indx.reshape(-1).long()
    invalid = keys < 0 if n_expts_tot is None else (keys < 0) | (keys >= n_expts_tot)
    keys = torch.where(invalid, torch.iinfo(torch.int64).max, keys)
    topk_indx = torch.argsort(keys, stable=True)
    gate_indx = torch.empty_like(topk_indx)
    gate_indx[topk_indx] = torch.arange(topk_indx.numel(), device=keys.device)
    return gate_indx.view(expt_indx.shape).to(torch.int32), topk_indx.to(torch.int32)


def random_expt_indx(n_tokens: int, n_expts_tot: int, n_expts_act: int, *, seed: int = 0, device="cpu",
                     dtype: torch.dtype = torch.int32, drop_fraction: float = 0.0) -> torch.Tensor:
    """[n_tokens, n_expts_act] distinct random expert ids per token (a fixed ``seed`` gives the
    same ids on every rank); ``drop_fraction`` of the pairs set to -1."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_tokens, n_expts_tot, generator=gen)
    indx = scores.topk(n_expts_act, dim=1).indices
    if drop_fraction > 0:
        indx[torch.rand(indx.shape, generator=gen) < drop_fraction] = -1
    return indx.to(dtype).to(device)


# ------------------------------------------------------------------------------------------
# References (tests, and the tuner's validation)
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

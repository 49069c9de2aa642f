"""Expert placement and routing indices of the MoE token conversions.

Terms (as in triton_kernels' distributed MoE): ``R`` ranks each hold ``n_tokens_local`` tokens;
``expt_indx`` [n_tokens_global, k] holds every token's top-k global expert ids (identical on all
ranks, -1: a dropped pair). Pairs are flattened ``p = t * k + j``; ``topk_indx`` lists the pairs
in expert order (stable), ``gate_indx`` is its inverse. dp->ep writes pair (t, j) of a local token
to row ``gate_indx[t, j]`` of the expert owner's [n_tokens_global * k, d_model] buffer; ep->dp
sends sorted row ``s`` (pair ``p = topk_indx[s]``) back to row ``p % (n_tokens_local * k)`` of its
token's home rank. Rows of dropped pairs are written by neither op; the pure-torch references live
on the tuning side (autosymm.tuning.reference).

Design notes: docs/BACKENDS.md#routing
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "ExptAssignment", "make_expt_assignment", "make_expt_dict_uniform", "make_expt_dict_random", "route",
    "random_expt_indx",
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

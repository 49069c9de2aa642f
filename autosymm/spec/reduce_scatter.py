"""The sharded ops' specs: ``reduce_scatter`` (a tensor summed over the group, each rank keeping
its dim-0 shard) and ``all_gather`` (every rank's tensor concatenated along dim 0 in rank order).
Problem: ``nbytes`` of the full (unsharded) tensor; bucket: those bytes; no shape. An all-gather
copies bytes: a dtype without rows of its own is keyed as bf16 (the rows of the same byte size).
Their front doors: autosymm.collectives.reduce_scatter / all_gather."""

from __future__ import annotations

from dataclasses import dataclass

from ..configs import AllGatherConfig, ReduceScatterConfig
from .all_reduce import SUMS
from .base import STACK_BACKENDS, BytesKeyed, Domain, Lookups, TuningPoints
from .kinds import SIZES


@dataclass(frozen=True, eq=False)
class ShardedSpec(BytesKeyed):
    """The reduce-scatter and the all-gather: a full tensor and its dim-0 shards."""

    def one_rank_reason(self, deterministic: bool) -> str:
        return "world size 1: the shard is the whole tensor"


_BACKENDS = "autosymm.backends."
REDUCE_SCATTER = ShardedSpec(
    "reduce_scatter", fallback="nccl_reduce_scatter", fallback_order=("nccl_reduce_scatter",),
    points=TuningPoints(sizes=SIZES), config_type=ReduceScatterConfig, door="autosymm.collectives.reduce_scatter:DOOR",
    backends={"nccl_reduce_scatter": _BACKENDS + "nccl_rs_ag:nccl_reduce_scatter",
              "nccl_ordered_reduce_scatter": _BACKENDS + "nccl_ordered:nccl_ordered_reduce_scatter",
              "triton_reduce_scatter_pull": _BACKENDS + "triton_rs_ag:triton_reduce_scatter_pull",
              "triton_reduce_scatter_push": _BACKENDS + "triton_rs_ag:triton_reduce_scatter_push", **STACK_BACKENDS},
    tuning="autosymm.tuning.ops.reduce_scatter:REDUCE_SCATTER", bench="autosymm.bench.rs_ag:SHARDED_BENCH",
    lookups=Lookups(bf16_same_bytes=True), tuned_by_default=False, invariant_fallback="nccl_ordered_reduce_scatter",
    domain=SUMS, local="autosymm.backends.local:copy_shard")

ALL_GATHER = ShardedSpec(
    "all_gather", fallback="nccl_all_gather", fallback_order=("nccl_all_gather",), points=TuningPoints(sizes=SIZES),
    config_type=AllGatherConfig, door="autosymm.collectives.all_gather:DOOR",
    backends={"nccl_all_gather": _BACKENDS + "nccl_rs_ag:nccl_all_gather",
              "triton_all_gather_push": _BACKENDS + "triton_rs_ag:triton_all_gather_push",
              "triton_all_gather_pull": _BACKENDS + "triton_rs_ag:triton_all_gather_pull", **STACK_BACKENDS},
    tuning="autosymm.tuning.ops.all_gather:ALL_GATHER", bench="autosymm.bench.rs_ag:SHARDED_BENCH",
    lookups=Lookups(bf16_same_bytes=True), tuned_by_default=False, domain=Domain(keyed_as="bf16"),
    local="autosymm.backends.local:copy_shard", formula="copy")

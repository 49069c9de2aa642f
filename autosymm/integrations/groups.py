"""The group autosymm serves a stack's slot on, from the group the stack hands over.

vLLM and SGLang build their custom-all-reduce object with the *CPU* (gloo) group of a
parallel group (vLLM ``cuda_communicator.py``, SGLang ``parallel_state.py``); the kernels and
NCCL fallback need the device group over the same ranks. :func:`device_group_for` finds it
among the groups this process already has (the stacks create both groups together) or creates
it, collectively over those ranks only.

:func:`serving_backend` is this package's one mapping from a device to the backend its
collectives run on; a group's device is autosymm.dist_compat's ``group_device``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def serving_backend(device: torch.device) -> str:
    """The torch.distributed backend whose group serves tensors on ``device``: NCCL for CUDA,
    gloo for the CPU."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"autosymm serves CUDA (NCCL) and CPU (gloo) groups, not device {device}")


def _has_backend(group, backend: str) -> bool:
    return backend in str(dist.get_backend(group)).lower()


def _known_groups() -> list:
    """Every group this rank belongs to, in creation order (the same order on every rank)."""
    me = dist.get_rank()
    ranks_of = getattr(dist.distributed_c10d._world, "pg_group_ranks", {})  # group -> {global: group rank}
    return [group for group, ranks in ranks_of.items() if me in ranks]


def find_group(ranks: list[int], backend: str) -> Optional[dist.ProcessGroup]:
    """An existing group over exactly ``ranks`` (global ranks in group-rank order) on ``backend``."""
    for group in _known_groups():
        if dist.get_process_group_ranks(group) == ranks and _has_backend(group, backend):
            return group
    return None


def device_group_for(group, backend: str):
    """The group over ``group``'s ranks (None: the world) that runs ``backend``: ``group`` itself
    when it does, else an existing one, else a new one.

    Creating is collective over those ranks only (``use_local_synchronization``): every rank of
    ``group`` must call this together, in the same order relative to its other group creations.
    """
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("autosymm needs torch.distributed initialised (dist.init_process_group)")
    if _has_backend(group, backend):
        return group
    ranks = dist.get_process_group_ranks(group)
    found = find_group(ranks, backend)
    if found is not None:
        return found
    # registered with torch like any group: the next adapter over these ranks finds it
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True)

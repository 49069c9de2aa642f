"""What ``dist.all_reduce`` accepts, mapped onto autosymm: reduce ops, work handles, DTensors.

* Reduce ops: a ``dist.ReduceOp`` (``ReduceOp.SUM`` or an instance ``ReduceOp(ReduceOp.MAX)``) or
  its lower-case name (``"sum"``); autosymm's ops and cache keys carry the name.
* ``async_op=True``: :class:`Work`, a handle like torch's ``Work`` for a call whose kernels are
  already queued on the current CUDA stream (where NCCL serves, torch's own Work is returned).
* A DTensor with ``Partial`` placements: a copy of its local tensor is reduced over the mesh
  dimensions that are partial and a new DTensor with ``Replicate`` there is returned; the input
  keeps its placements and its data (``redistribute``'s semantics: a Partial DTensor never holds
  summed data).
* Groups by name: ``group.group_name``, what ``torch.ops.autosymm.*`` (and torch's ``symm_mem``
  ops) take, and back; the device a group serves on (:func:`group_device`); the group over the
  same ranks on another backend (:func:`group_over`: a stack's CPU group, the tuner's).
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

#: Reduce ops by the name autosymm's ops take (the ``dist.ReduceOp`` of the same name, upper case).
REDUCE_OP_NAMES = ("sum", "avg", "max", "min", "product", "band", "bor", "bxor")
#: (dist.ReduceOp enum member, name) pairs, compared by identity: torch.compile (2.11) cannot hash
#: a RedOpType, so the common case must not go through a dict.
_ENUMS = tuple((getattr(dist.ReduceOp, name.upper()), name) for name in REDUCE_OP_NAMES)
_BY_ENUM = dict(_ENUMS)


def reduce_op_name(op) -> str:
    """The name ("sum", "max", ...) of ``op``, a ``dist.ReduceOp`` or a name. ValueError for a
    reduce op or name autosymm does not take, TypeError for anything else (a list, a group);
    both name what is accepted."""
    if isinstance(op, str):
        if op in REDUCE_OP_NAMES:
            return op
    else:
        for enum, name in _ENUMS:
            if op is enum:
                return name
        inner = getattr(op, "op", op)  # a ReduceOp instance wraps its RedOpType in .op
        name = _BY_ENUM.get(inner) if isinstance(inner, dist.ReduceOp.RedOpType) else None
        if name is not None:
            return name
    accepted = (f"a dist.ReduceOp of {', '.join(n.upper() for n in REDUCE_OP_NAMES)} or one of the names "
                f"{list(REDUCE_OP_NAMES)}")
    if isinstance(op, dist.ProcessGroup):
        raise TypeError("autosymm.all_reduce: the second argument is op, as in dist.all_reduce(tensor, op, group); "
                        "pass the group as group=")
    if isinstance(op, (str, dist.ReduceOp, dist.ReduceOp.RedOpType)):
        raise ValueError(f"autosymm.all_reduce: op={op!r} is not {accepted}")
    raise TypeError(f"autosymm.all_reduce: op={op!r} ({type(op).__name__}) is not a reduce op: pass {accepted}")


class Work:
    """Handle of an ``async_op=True`` call served by autosymm's kernels (torch's ``Work`` API).

    The kernels are queued on the stream that was current at the call, so later work on that
    stream already sees the result. ``wait()`` makes the caller's *current* stream wait for
    them (as NCCL's ``Work.wait()`` does); ``is_completed()`` asks whether the GPU finished.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self._event: Optional[torch.cuda.Event] = None
        if tensor.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self, timeout=None) -> bool:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return [self._tensor]


def is_dtensor(x) -> bool:
    """True for a DTensor (without importing torch.distributed.tensor: none exists before it is)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def reduce_dtensor(x, op: str, op_given: bool, reduce: Callable[..., torch.Tensor]):
    """A new DTensor: ``x`` with every ``Partial`` placement reduced (``reduce(local, op, group)``
    per partial mesh dimension, in place on a copy of the local tensor) and made ``Replicate``.
    ``x`` keeps its placements and its local data, as with ``x.redistribute(...)``: reducing its
    local tensor in place would leave a Partial DTensor holding the sum (``full_tensor()`` would
    sum it again).

    ``op_given``: the caller passed an op, which must then match the placements' reduce op.
    ValueError names the placements when there is nothing partial, or a partial kind autosymm
    cannot reduce (a subclass of Partial, e.g. a norm's)."""
    # DTensor: ~1 s of imports `import torch` skips; only a DTensor call needs it
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = tuple(x.placements)
    partial_dims = [d for d, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial_dims:
        raise ValueError(f"autosymm.all_reduce: DTensor with placements {placements} has no Partial "
                         f"placement: nothing to reduce")
    for d in partial_dims:
        p = placements[d]
        if type(p) is not Partial or p.reduce_op not in REDUCE_OP_NAMES:
            raise ValueError(f"autosymm.all_reduce: cannot reduce the placement {p!r} (mesh dim {d}) of a "
                             f"DTensor with placements {placements}; redistribute it with torch")
        if op_given and p.reduce_op != op:
            raise ValueError(f"autosymm.all_reduce: op={op!r} differs from the placement {p!r} (mesh dim {d}) "
                             f"of a DTensor with placements {placements}")
    local = x.to_local().clone()
    for d in partial_dims:
        local = reduce(local, placements[d].reduce_op, x.device_mesh.get_group(d))
    new = tuple(Replicate() if d in partial_dims else p for d, p in enumerate(placements))
    return DTensor.from_local(local, x.device_mesh, new, run_check=False, shape=x.shape, stride=x.stride())


def check_group(group) -> None:
    """TypeError naming what was passed unless ``group`` is None (the world group) or a
    ``torch.distributed`` ProcessGroup (or an object carrying its ``group_name``)."""
    if group is not None and not isinstance(group, dist.ProcessGroup) and not hasattr(group, "group_name"):
        raise TypeError(f"autosymm: group={group!r} ({type(group).__name__}) is not a torch.distributed "
                        f"ProcessGroup: pass None (the world group) or a group from dist.new_group")


def group_name(group=None) -> str:
    """The name torch.distributed resolves ``group`` by (default: the world group), the same
    string on every rank: the ``group_name`` argument of ``torch.ops.autosymm.*`` and
    ``torch.ops.symm_mem.*``, and the key of the group's workspace and agreement channel.
    TypeError for what is not a group (:func:`check_group`)."""
    check_group(group)
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("autosymm needs torch.distributed initialised (dist.init_process_group)")
    name = getattr(group, "group_name", None)
    if name is None:  # a group object without the attribute: c10d's own table
        name = dist.distributed_c10d._get_process_group_name(group)
    return str(name)


def group_device(group=None) -> torch.device:
    """The device autosymm serves ``group`` on (default: the world group): the current CUDA
    device when the group has an NCCL backend for CUDA tensors (``nccl``, or a mixed
    ``cpu:gloo,cuda:nccl``), else the CPU (``gloo``: the CPU tests)."""
    backend = str(dist.get_backend(group)).lower()
    per_device = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    cuda_backend = per_device.get("cuda", "") if per_device else backend
    if cuda_backend.strip() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_group(name: str):
    """The group named ``name``, as autosymm.api keys its state: None for the world group (so
    compiled and eager calls on the default group share one state and its prepared calls)."""
    world = dist.group.WORLD
    if world is not None and world.group_name == name:
        return None
    return _resolve_process_group(name)


def has_backend(group, backend: str) -> bool:
    """Whether ``group`` runs torch.distributed backend ``backend`` ('nccl', 'gloo')."""
    return backend in str(dist.get_backend(group)).lower()


def _known_groups() -> list:
    """Every group this rank belongs to, in creation order (the same order on every rank)."""
    me = dist.get_rank()
    ranks_of = getattr(dist.distributed_c10d._world, "pg_group_ranks", {})  # group -> {global: group rank}
    return [group for group, ranks in ranks_of.items() if me in ranks]


def find_group(ranks: list[int], backend: str):
    """An existing group over exactly ``ranks`` (global ranks in group-rank order) on
    ``backend``, or None."""
    for group in _known_groups():
        if dist.get_process_group_ranks(group) == ranks and has_backend(group, backend):
            return group
    return None


def group_over(group, backend: str):
    """The group over ``group``'s ranks (None: the world) that runs ``backend``: ``group`` itself
    when it does, else an existing one, else a new one. Creating is collective over those ranks
    only (``use_local_synchronization``): every rank of ``group`` calls this together, in the
    same order relative to its other group creations."""
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("autosymm needs torch.distributed initialised (dist.init_process_group)")
    if has_backend(group, backend):
        return group
    ranks = dist.get_process_group_ranks(group)
    found = find_group(ranks, backend)
    if found is not None:
        return found
    # registered with torch like any group: the next caller over these ranks finds it
    return dist.new_group(ranks, backend=backend, use_local_synchronization=True)

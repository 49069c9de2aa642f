"""The record every collective is (:class:`Collective`), the data it declares (:class:`Lookups`,
:class:`TuningPoints`, :class:`PointRequest`, :class:`CustomOp`) and the one entry path every
public call takes on its first call of a key (:func:`prepare_call`).

Cache keys. A group state keeps one dict of prepared calls (autosymm.runtime.group.GroupState.cache). A
key is led by the op's record (``(record, dtype, ..., capturing)``), except the all-reduce's,
which its hot path builds as ``(dtype, numel, contiguous, reduce op, device, capturing)``: a torch dtype
first, so it never equals another op's key. Every key ends with ``capturing`` (bool), the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..problem import MoEShape, Problem, format_bytes

#: What a bucket counts: bytes of the full (unsharded) tensor, or tokens per rank.
BUCKET_UNITS = ("bytes", "tokens")


@dataclass(frozen=True)
class Lookups:
    """Where the dispatcher looks when a call's own (dtype, mode, shape) has no row, in order:
    the other mode's rows; for a call in fp16/fp32 the bf16 rows of the same byte size (byte-bound
    kernels); for a shape without rows, the nearest tuned shape (autosymm.runtime.neighbours)."""

    other_mode: bool = True
    bf16_same_bytes: bool = False
    nearest_shape: bool = False


@dataclass(frozen=True)
class TuningPoints:
    """An op's default tuning points (``autosymm tune`` without options), as data: ``sizes``
    (bytes), ``moe_shapes``, ``hidden`` sizes (elements per row), ``tokens`` per rank, and
    ``extra_tokens`` also tuned where they lie inside the asked-for token range, and the fused
    op's ``epilogues`` (autosymm.epilogue.Epilogue)."""

    sizes: tuple[int, ...] = ()
    moe_shapes: tuple[MoEShape, ...] = ()
    hidden: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    extra_tokens: tuple[int, ...] = ()
    epilogues: tuple[Any, ...] = ()


@dataclass(frozen=True)
class PointRequest:
    """The points a tune, a plan or ``explain`` asks for; a field left None takes the op's
    :class:`TuningPoints`. ``extra_tokens`` False: only the asked-for token counts (plans)."""

    dtypes: tuple[str, ...]
    world_size: int
    sizes: Optional[Sequence[int]] = None
    moe_shapes: Optional[Sequence[MoEShape]] = None
    hidden: Optional[Sequence[int]] = None
    tokens: Optional[Sequence[int]] = None
    extra_tokens: bool = True
    epilogues: Optional[Sequence[Any]] = None


@dataclass(frozen=True)
class CustomOp:
    """One ``torch.ops.autosymm.<name>``: its implementation (whose annotations make the schema),
    the arguments it mutates, its fake implementation and, for a differentiable op, its
    ``backward`` and ``setup_context`` (torch.library.register_autograd's; autosymm.ops registers
    them all)."""

    name: str
    impl: Callable
    fake: Callable
    mutates_args: tuple[str, ...] = ()
    setup_context: Optional[Callable] = None
    backward: Optional[Callable] = None


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: cache keys lead with it
class Collective:
    """One collective: ``name`` (the database's ``op`` column, ``Problem.op``); ``bucket_unit``
    ('bytes' of the full tensor | 'tokens' per rank); ``shape_param`` (the parameter its DB
    ``shape`` column holds: '' none, 'moe_shape', 'hidden'); ``fallback`` (the backend that always
    serves it: the tuner's baseline, the dispatcher's last resort) and ``fallback_order`` (where
    no row serves, the first of these that can serve runs with its ``fallback_config``);
    ``config_type`` (the config class its database rows hold; None for config-less backends) and
    ``other_config_types`` (those of backends outside autosymm's families: FlashInfer's fused call);
    ``lookups`` and the growth model (:meth:`moved_ratio`) of the dispatcher; its default tuning
    ``points``; ``tuned_by_default`` (in `autosymm tune`'s default ``--ops``);
    ``prepare_in_check`` (the decision and launcher are made inside the agreed check; False when
    preparing may run a collective, as growing the MoE region does); ``invariant_fallback`` (the
    batch-invariant backend that always serves it under the ``deterministic`` setting, where the
    ``fallback_order`` has none: autosymm.backends.nccl_ordered; '' when that order has one);
    ``arg_names`` (its entry's arguments, as the checked mode names them).
    Subclasses (one module per op) give the methods below that raise NotImplementedError here."""

    name: str
    bucket_unit: str
    fallback: str
    fallback_order: tuple[str, ...]
    points: TuningPoints
    config_type: type
    lookups: Lookups = Lookups()
    other_config_types: tuple[type, ...] = ()
    shape_param: str = ""
    tuned_by_default: bool = True
    prepare_in_check: bool = True
    invariant_fallback: str = ""
    arg_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_unit not in BUCKET_UNITS:
            raise ValueError(f"{self.name}: bucket_unit={self.bucket_unit!r} is not one of {BUCKET_UNITS}")
        if not self.fallback_order or self.fallback_order[-1] != self.fallback:
            raise ValueError(f"{self.name}: fallback_order {self.fallback_order} must end with the fallback "
                             f"{self.fallback!r} (the backend that always serves)")

    def __reduce__(self):
        """Pickled by name (a Problem sent to a worker process keeps the registered record)."""
        return _registered, (self.name,)

    # -- the problem and its database key --------------------------------------------------
    def check_problem(self, problem: Problem) -> None:
        """ValueError naming what ``problem`` (of this op) lacks."""
        raise NotImplementedError(self.name)

    def bucket(self, problem: Problem) -> int:
        """The database bucket (autosymm.problem): tokens per rank, or bytes (at least 1)."""
        return problem.n_tokens_local if self.bucket_unit == "tokens" else max(1, problem.nbytes)

    def shape_key(self, problem: Problem) -> str:
        """The database ``shape`` column ('' without a shape)."""
        return ""

    def shape_of_key(self, key: str) -> Any:
        """The shape parameter (:attr:`shape_param`) a database ``shape`` key names; ValueError for
        an op without shapes or a key it cannot read."""
        raise ValueError(f"{self.name} has no shape parameter; got the shape key {key!r}")

    def describe(self, problem: Problem) -> str:
        if self.bucket_unit == "tokens":
            return (f"{self.name} {problem.dtype} ws={problem.world_size} {self.shape_key(problem)} "
                    f"tokens/rank={problem.n_tokens_local}")
        return f"{self.name} {problem.dtype} ws={problem.world_size} {format_bytes(problem.nbytes)}"

    def one_rank_reason(self, deterministic: bool) -> str:
        """Why a call over a one-rank group runs no collective (its decision is backend 'noop'),
        or '' where a backend serves it; the dispatcher and the entry's checks both ask."""
        return ""

    def problem_hint(self) -> str:
        """How a caller builds a Problem of this op (errors that ask for one name it)."""
        return f"autosymm.Problem({self.name!r}, dtype, world_size, nbytes=...)"

    def size_text(self, bucket: int) -> str:
        """A bucket as the dispatcher's reasons say it."""
        if self.bucket_unit == "tokens":
            return f"{bucket} tokens/rank"
        return format_bytes(bucket) if bucket % 1024 == 0 else f"{bucket} B"

    def point_label(self, problem: Problem, sep: str = " t=") -> str:
        """A tuned point as summaries and plans label it ('1MiB', 'd7168_e256_k8 t=64')."""
        if self.bucket_unit == "tokens":
            return f"{self.shape_key(problem)}{sep}{problem.n_tokens_local}"
        return format_bytes(problem.nbytes)

    def moved_ratio(self, problem: Problem, row) -> float:
        """How much more work the call ``problem`` moves than the tuned ``row`` (a db_schema.Row of
        this op) on the critical path, before any per-config rounds (autosymm.runtime.neighbours.growth)."""
        return problem.bucket / row.bucket

    # -- tuning points ----------------------------------------------------------------------
    def problems(self, request: PointRequest) -> list[Problem]:
        """The Problems of ``request`` (its fields, else :attr:`points`), dtype-major."""
        raise NotImplementedError(self.name)

    # -- the public entry ---------------------------------------------------------------------
    def call_text(self, key: tuple, args: tuple, mode: str) -> str:
        """The call as the ranks compare it (and errors name it) on its first use."""
        raise NotImplementedError(self.name)

    def fingerprint(self, key: tuple, args: tuple, mode: str) -> dict[str, Any]:
        """What the checked mode (AUTOSYMM_CHECK_CALLS) compares across ranks on every call: each
        argument by :attr:`arg_names` (a tensor's dtype and shape) and the mode."""
        from ..runtime.call_check import fingerprint

        return fingerprint(self.name, args, self.arg_names, mode=mode)

    def check_call(self, state, key: tuple, args: tuple, mode: str) -> Any:
        """This rank's checks of a new call (local: no collective; ValueError naming the bad
        tensor): its Problem, or a prepared Entry where no database decides (e.g. 'noop')."""
        raise NotImplementedError(self.name)

    def prepare(self, state, problem: Problem, mode: str):
        """The Entry (decision and launcher) of a checked call."""
        return state.prepare(problem, mode)

    def bytes_per_call(self, args: tuple) -> int:
        """Bytes a call moves, for ``autosymm.stats`` (the first tensor's)."""
        return args[0].numel() * args[0].element_size()

    def problem_of_key(self, key: tuple, world_size: int) -> Problem:
        """The Problem of a cache key (re-preparing cached launchers); ops that need it give it."""
        raise NotImplementedError(self.name)

    def custom_ops(self) -> tuple[CustomOp, ...]:
        """Its ``torch.ops.autosymm.*`` ops."""
        raise NotImplementedError(self.name)


def _registered(name: str) -> Collective:
    from . import get

    return get(name)


def prepare_call(state, record: Collective, key: tuple, args: tuple):
    """The first call of ``key`` on a group state: checked on this rank, agreed with every rank
    (a bad tensor on one rank raises on all: GroupState.agreed_check), decided, prepared and
    cached. Every public entry takes this path on a miss of its key in ``state.cache`` (a repeated
    call is that lookup, ``entry.calls += 1`` and the launcher, inline in the entry). In checked
    mode (AUTOSYMM_CHECK_CALLS) every call comes here, its lookups missing by design, and is
    checked with every rank first (autosymm.runtime.call_check.checked_entry)."""
    mode = "graph" if key[-1] else "eager"
    if state.check_calls:
        from ..runtime.call_check import checked_entry

        entry = checked_entry(state, record, key, args, mode)
        if entry is not None:
            return entry

    def local():
        found = record.check_call(state, key, args, mode)
        if record.prepare_in_check and isinstance(found, Problem):
            return record.prepare(state, found, mode)
        return found

    found = state.agreed_check(record.call_text(key, args, mode), local)
    entry = record.prepare(state, found, mode) if isinstance(found, Problem) else found
    entry.bytes_per_call = record.bytes_per_call(args)
    state.cache[key] = entry
    return entry


def refuse_call(state, record: Collective, args: tuple):
    """A call whose key cannot be built (an argument that is not a dense tensor, per-rank sizes
    that are not ints): its checks (``record.check_call``, which name the argument) raise, after
    they are agreed with every rank as :func:`prepare_call` agrees a call's first use, so a peer
    making its first use of a call at the same point raises too, naming this rank's error."""
    from ..runtime.group import stream_capturing

    mode = "graph" if stream_capturing() else "eager"

    def check():
        record.check_call(state, None, args, mode)
        raise TypeError(f"autosymm.{record.name}: the arguments are not tensors of one call")  # checks missed it

    if state.check_calls:
        from ..runtime.call_check import checked_entry

        checked_entry(state, record, None, args, mode)  # raises the checks' error (or the peers')
    state.agreed_check(f"{record.name} of arguments this rank refused", check)

"""The declarative half of a collective (:class:`OpSpec`): how a call becomes a Problem and its
database key, its fallbacks, lookups, growth model and default tuning points, as data. Beside it
the records it is made of (:class:`Lookups`, :class:`Domain`, :class:`TuningPoints`,
:class:`PointRequest`; its bucket unit and shape kind: autosymm.spec.kinds) and the typed key of a
prepared call (:class:`CallKey`). Nothing here runs a collective: the front doors
(autosymm.collectives) do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

from ..problem import DTYPES, Problem, format_bytes, spec_of
from .kinds import BYTES, TOKENS, BucketUnit, Option, ShapeKind


@dataclass(frozen=True)
class Lookups:
    """Where the dispatcher looks when a call's own (dtype, mode, shape) has no row, in order:
    the other mode's rows; for a call in fp16/fp32 the bf16 rows of the same byte size (byte-bound
    kernels); for a shape without rows, the nearest tuned shape (autosymm.runtime.neighbours)."""

    other_mode: bool = True
    bf16_same_bytes: bool = False
    nearest_shape: bool = False


#: The backends that are a serving stack's own path (autosymm.backends.stack), listed by every op
#: a stack runs itself (the all-reduce, the fused all-reduce + RMSNorm, reduce-scatter, all-gather).
STACK_BACKENDS = {"vllm": "autosymm.backends.stack:vllm", "sglang": "autosymm.backends.stack:sglang"}


@dataclass(frozen=True)
class Domain:
    """The calls an op's database rows can decide (its tuned domain): ``dtypes`` (the kernels'),
    ``reduce_ops`` (a reducing op's: the kernels sum; () for ops that reduce nothing) and
    ``keyed_as`` (a dtype outside ``dtypes`` whose calls take that dtype's rows of the same
    bytes: an all-gather copies bytes; '' none). The dispatcher serves a call outside it from
    the op's fallbacks, without reading a row."""

    dtypes: tuple[str, ...] = tuple(DTYPES)
    reduce_ops: tuple[str, ...] = ()
    keyed_as: str = ""


@dataclass(frozen=True)
class TuningPoints:
    """An op's default points (``autosymm tune`` without options, plans), as data: ``sizes`` (in
    its unit: bytes, tokens per rank), ``shapes`` (of its shape kind) and ``extra_sizes`` also
    tuned where they lie inside the asked-for range of sizes."""

    sizes: tuple[int, ...] = ()
    shapes: tuple[Any, ...] = ()
    extra_sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class PointRequest:
    """The points a tune, a plan or ``explain`` asks of an op: ``sizes`` (in its unit) and
    ``shapes`` (of its kind), each None for the op's :class:`TuningPoints`; ``extra_sizes`` False:
    only the asked-for sizes (plans)."""

    dtypes: tuple[str, ...]
    world_size: int
    sizes: Optional[Sequence[int]] = None
    shapes: Optional[Sequence[Any]] = None
    extra_sizes: bool = True


def with_extra_sizes(sizes, extra) -> list[int]:
    """``sizes`` plus the ``extra`` sizes within their range, sorted."""
    if not sizes:
        return []
    return sorted(set(sizes) | {size for size in extra if min(sizes) <= size <= max(sizes)})


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: call keys lead with it
class OpSpec:
    """One collective's record, the one place that names everything of it: ``name`` (the database's
    ``op`` column, ``Problem.op``); ``unit`` (what its bucket counts, by subclass: :class:`BytesKeyed`
    the :data:`BYTES` of the full tensor, :class:`TokensKeyed` the :data:`TOKENS` per rank);
    ``shape`` (what its DB ``shape`` column holds: None or the op's kind, autosymm.spec.kinds);
    ``door`` (the entry 'module:attribute' of its front door, an autosymm.runtime.entry.Door);
    ``backends`` (name -> entry of every backend serving it, autosymm.backends: a backend serving
    two ops is listed by both, with the same entry); ``tuning`` (the entry of its tuning side, an
    autosymm.tuning.ops.base.TuningOp) and ``bench`` (the entry of how `autosymm bench` measures
    it, an autosymm.bench.report.BenchOp; '' none);
    ``fallback`` (the backend that always serves it: the tuner's baseline, the dispatcher's last
    resort) and ``fallback_order`` (where no row serves, the first of these that can serve runs
    with its ``fallback_config``); ``config_type`` (the config class its database rows hold) and
    ``other_config_types`` (those of backends outside autosymm's families: FlashInfer's fused
    call); ``lookups`` and the growth model (:meth:`moved_ratio`) of the dispatcher; its default
    tuning ``points``; ``tuned_by_default`` (in `autosymm tune`'s default ``--ops``);
    ``invariant_fallback`` (the batch-invariant backend that always serves it under the
    ``deterministic`` setting where the ``fallback_order`` has none; '' when that order has one);
    ``domain`` (the calls its rows can decide: :class:`Domain`); ``local`` (the entry
    'module:function' making the launcher of a call with nothing to exchange, the backend
    'noop': ``local(problem) -> launcher``; '' where every call exchanges); ``formula`` (the
    numerics its backends compute unless one says otherwise, autosymm.backends.Backend.formula:
    'sum' in any rank order, 'copy', the fused op's 'single-rounding').
    Subclasses (one module per op) give :meth:`check_problem` and :meth:`problem_at`."""

    unit: ClassVar[BucketUnit]
    name: str
    fallback: str
    fallback_order: tuple[str, ...]
    points: TuningPoints
    config_type: type
    door: str
    backends: Mapping[str, str]
    tuning: str
    bench: str = ""
    lookups: Lookups = Lookups()
    other_config_types: tuple[type, ...] = ()
    shape: Optional[ShapeKind] = None
    tuned_by_default: bool = True
    invariant_fallback: str = ""
    domain: Domain = Domain()
    local: str = ""
    formula: str = "sum"

    def __post_init__(self) -> None:
        if not self.fallback_order or self.fallback_order[-1] != self.fallback:
            raise ValueError(f"{self.name}: fallback_order {self.fallback_order} must end with the fallback "
                             f"{self.fallback!r} (the backend that always serves)")
        named = (*self.fallback_order, self.invariant_fallback)
        unlisted = [name for name in named if name and name not in self.backends]
        if unlisted:
            raise ValueError(f"{self.name}: fallback backend(s) {unlisted} are not among its backends "
                             f"{tuple(self.backends)}")

    @property
    def config_types(self) -> tuple[type, ...]:
        """Every config class the op's database rows may hold (``config_type`` first)."""
        return (self.config_type, *self.other_config_types)

    @property
    def call_options(self) -> tuple[Option, ...]:
        """The options `autosymm explain` asks one call of this op with (its unit's, its shape's)."""
        return (self.unit.option, *((self.shape.option, *self.shape.refine) if self.shape else ()))

    @property
    def sweep_options(self) -> tuple[Option, ...]:
        """The options `autosymm tune` asks this op's sweep with (its unit's, its shape's)."""
        return (self.unit.sweep, *(self.shape.sweep if self.shape else ()))

    def __reduce__(self):
        """Pickled by name (a Problem sent to a worker process keeps the registered spec)."""
        return _registered, (self.name,)

    def check_problem(self, problem: Problem) -> None:
        """ValueError naming what ``problem`` (of this op) lacks."""
        raise NotImplementedError(self.name)

    def bucket(self, problem: Problem) -> int:
        """The database bucket (autosymm.problem): tokens per rank, or bytes (at least 1)."""
        raise NotImplementedError(self.name)

    def shape_key(self, problem: Problem) -> str:
        """The database ``shape`` column ('' without a shape)."""
        return ""

    def shape_of_key(self, key: str) -> Any:
        """The shape a database ``shape`` key names; ValueError for an op without shapes or a key
        it cannot read."""
        if not self.shape:
            raise ValueError(f"{self.name} has no shape parameter; got the shape key {key!r}")
        return self.shape.of_key(key)

    def describe(self, problem: Problem) -> str:
        raise NotImplementedError(self.name)

    def one_rank_reason(self, deterministic: bool) -> str:
        """Why a call over a one-rank group runs no collective (its decision is backend 'noop'),
        or '' where a backend serves it (the dispatcher asks)."""
        return ""

    def empty_reason(self, problem: Problem) -> str:
        """Why ``problem`` exchanges nothing on any rank (its decision is backend 'noop'), or ''."""
        return ""

    def outside_domain(self, problem: Problem) -> str:
        """Why no database row can decide ``problem`` (its dtype or reduction is outside the
        op's :class:`Domain`: the fallbacks serve it), or ''."""
        domain = self.domain
        if domain.reduce_ops and problem.reduce_op not in domain.reduce_ops:
            return f"op {problem.reduce_op} has no tuned kernel"
        if problem.dtype not in domain.dtypes and not domain.keyed_as:
            return f"dtype {problem.dtype} has no tuned kernel"
        return ""

    def key_dtype(self, problem: Problem) -> str:
        """The dtype of the rows that decide ``problem`` (its own, or the domain's ``keyed_as``)."""
        return problem.dtype if problem.dtype in self.domain.dtypes else self.domain.keyed_as

    def problem_hint(self) -> str:
        """How a caller builds a Problem of this op (errors that ask for one name it)."""
        return f"autosymm.Problem({self.name!r}, dtype, world_size, nbytes=...)"

    def size_text(self, bucket: int) -> str:
        """A bucket as the dispatcher's reasons say it."""
        return self.unit.text(bucket)

    def point_label(self, problem: Problem, sep: str = " t=") -> str:
        """A tuned point as summaries and plans label it ('1MiB', 'd7168_e256_k8 t=64')."""
        raise NotImplementedError(self.name)

    def moved_ratio(self, problem: Problem, row) -> float:
        """How much more work the call ``problem`` moves than the tuned ``row`` (a db.schema.Row of
        this op) on the critical path, before any per-config rounds (autosymm.runtime.neighbours)."""
        return problem.bucket / row.bucket

    def problem_at(self, dtype: str, world_size: int, size: int, shape: Any = None) -> Problem:
        """The Problem of one point: ``size`` in the op's unit, ``shape`` of its kind (None without
        one); a ValueError naming the rule where no call has it."""
        raise NotImplementedError(self.name)

    def no_calls(self, shape: Any) -> str:
        """Why no call has ``shape`` (sweeps and plans leave it out), or '' where calls have it."""
        return ""

    def problems(self, request: PointRequest) -> list[Problem]:
        """The Problems of ``request`` (its fields, else :attr:`points`), dtype-major, then shape,
        then size."""
        sizes = list(self.points.sizes if request.sizes is None else request.sizes)
        if request.extra_sizes:
            sizes = with_extra_sizes(sizes, self.points.extra_sizes)
        shapes = (self.points.shapes if request.shapes is None else request.shapes) if self.shape else (None,)
        return [self.problem_at(dtype, request.world_size, size, shape) for dtype in request.dtypes
                for shape in shapes if not self.no_calls(shape) for size in sizes]

    def problem_of_key(self, key: "CallKey", world_size: int) -> Problem:
        """The Problem of a call key (re-preparing cached launchers); ops that need it give it."""
        raise NotImplementedError(self.name)

    def problem_of_row(self, row) -> Problem:
        """The Problem whose database key is ``row``'s (a db.schema.Row of this op: its dtype,
        world_size, bucket and shape), built as a call's is, so the op's own rules apply; a
        ValueError naming the rule where no call can have that key."""
        return self.problem_at(row.dtype, row.world_size, row.bucket,
                               self.shape_of_key(row.shape) if self.shape else None)


@dataclass(frozen=True, eq=False)
class BytesKeyed(OpSpec):
    """An op keyed by the bytes of its full tensor, without a shape (all-reduce, reduce-scatter,
    all-gather): ``nbytes`` >= 0, bucket max(1, nbytes)."""

    unit: ClassVar[BucketUnit] = BYTES

    def check_problem(self, problem: Problem) -> None:
        if problem.nbytes < 0:
            raise ValueError(f"nbytes={problem.nbytes} must be >= 0")

    def bucket(self, problem: Problem) -> int:
        return max(1, problem.nbytes)

    def empty_reason(self, problem: Problem) -> str:
        return "an empty tensor: nothing to exchange" if problem.nbytes == 0 else ""

    def describe(self, problem: Problem) -> str:
        op = f" op={problem.reduce_op}" if self.domain.reduce_ops and problem.reduce_op != "sum" else ""
        return f"{self.name} {problem.dtype}{op} ws={problem.world_size} {format_bytes(problem.nbytes)}"

    def point_label(self, problem: Problem, sep: str = " t=") -> str:
        return format_bytes(problem.nbytes)

    def problem_at(self, dtype: str, world_size: int, size: int, shape: Any = None) -> Problem:
        return Problem(self.name, dtype, world_size, nbytes=size)


@dataclass(frozen=True, eq=False)
class TokensKeyed(OpSpec):
    """An op keyed by tokens per rank and a shape (the MoE conversions, the fused op)."""

    unit: ClassVar[BucketUnit] = TOKENS

    def bucket(self, problem: Problem) -> int:
        return problem.n_tokens_local

    def describe(self, problem: Problem) -> str:
        return (f"{self.name} {problem.dtype} ws={problem.world_size} {self.shape_key(problem)} "
                f"tokens/rank={problem.n_tokens_local}")

    def point_label(self, problem: Problem, sep: str = " t=") -> str:
        return f"{self.shape_key(problem)}{sep}{problem.n_tokens_local}"


def _registered(name: str) -> OpSpec:
    return spec_of(name)


#: The key of a prepared call in a group's cache, one rule for every op: the plain tuple ``(spec,
#: dtype, shape, device, capturing, extra)`` :func:`call_key` builds (a lookup hashes and compares
#: it at tuple speed), read through the indices below. ``shape`` is the op's leading tensor's (the
#: all-reduce's numel: it is served flat), ``capturing`` the mode (True while the stream captures
#: a CUDA graph), ``extra`` what else fixes the call (a reduce op's name, per-rank sizes, an
#: epilogue, the MoE routing's sizes).
CallKey = tuple
KEY_SPEC, KEY_DTYPE, KEY_SHAPE, KEY_DEVICE, KEY_CAPTURING, KEY_EXTRA = range(6)


def call_key(spec: OpSpec, dtype, shape, device, capturing: bool, extra: Any = None) -> CallKey:
    """The :data:`CallKey` of a call (the one builder)."""
    return spec, dtype, shape, device, capturing, extra


def key_mode(key: CallKey) -> str:
    """'graph' for a key made while the stream captured a CUDA graph, else 'eager'."""
    return "graph" if key[KEY_CAPTURING] else "eager"

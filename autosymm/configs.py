"""Launch configurations of the autosymm kernel families, their validity rules, and the MoE
conversions' search space (the Triton all-reduce and fused families keep theirs beside their
backends, with their algorithm records).

A config is a frozen dataclass: hashable (dispatch caches on it), comparable, and serialised to
the tuning database as JSON through :func:`config_to_json` / :func:`config_from_json`.
Illegal combinations are rejected in ``__post_init__`` with a message naming the field. An
all-reduce or fused config names its algorithm; what the algorithm allows is its record
(autosymm.backends.launch.Algorithm) in its family's ``ALGORITHMS``.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Mapping

from .entries import load
from .geometry import FUSED_SPLIT_MAX, MAX_PROGRAMS
from .problem import registered_specs

WARP_SIZE = 32

#: Widest BLOCK (elements) a config may ask for: far beyond any useful one (the search spaces stop
#: at 32768), and a bound on what a damaged database row can make the compiler build.
MAX_BLOCK = 65536


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_num_warps(num_warps: int) -> None:
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps={num_warps} must be a power of two in 1..32")


def as_int(name: str, value: Any) -> int:
    """``value`` as a Python int (numpy's ints too); a bool, float, str or anything else is a
    ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an int, not {type(value).__name__}") from None


def _check_ints(config, *names: str) -> None:
    """The named fields of ``config`` are ints (kept as Python ints): the kernels take them as
    constexprs and grid sizes."""
    for name in names:
        object.__setattr__(config, name, as_int(name, getattr(config, name)))  # the dataclass is frozen


def _check_block(name: str, value: int, smallest: int) -> None:
    if not _is_pow2(value) or not smallest <= value <= MAX_BLOCK:
        raise ValueError(f"{name}={value} must be a power of two in {smallest}..{MAX_BLOCK} (elements)")


#: How an eager Triton call launches (``eager_launch`` of the all-reduce and fused configs, tuned
#: and stored per eager row; autosymm.runtime.replay): 'replay' a cached one-kernel CUDA graph (the least
#: host time: loops the host bounds), 'direct' a bound launch (a shorter gap between back-to-back
#: kernels: loops the kernel bounds). Rows written before the field read as 'replay'.
EAGER_LAUNCHES = ("replay", "direct")


def _check_eager_launch(config) -> None:
    if config.eager_launch not in EAGER_LAUNCHES:
        raise ValueError(f"eager_launch={config.eager_launch!r} must be one of {EAGER_LAUNCHES}")


class AnyConfig:
    """The base of every launch config (each a frozen dataclass): what a backend's search space
    and a database row hold. Which config types an op's rows may hold is its spec's
    (autosymm.spec.OpSpec.config_types); :func:`config_types` reads them off the op registry."""


_FAMILIES: dict[str, Mapping[str, "Algorithm"]] = {}


def family_algorithms(family: str) -> Mapping[str, "Algorithm"]:
    """name -> Algorithm of a Triton family, ``family`` the entry of its ``ALGORITHMS`` table
    (autosymm.entries), loaded on first use: the family's module imports this one."""
    algorithms = _FAMILIES.get(family)
    if algorithms is None:
        algorithms = _FAMILIES[family] = load(family)
    return algorithms


def _check_algorithm(config) -> "Algorithm":
    """The record of ``config.algorithm`` in its family; a name outside it, or double buffering
    where the algorithm has none, is a ValueError."""
    algorithms = family_algorithms(config.FAMILY)
    record = algorithms.get(config.algorithm) if isinstance(config.algorithm, str) else None
    if record is None:
        raise ValueError(f"algorithm={config.algorithm!r} is not one of {tuple(algorithms)}")
    if not isinstance(config.double_buffer, bool):
        raise ValueError(f"double_buffer={config.double_buffer!r} must be a bool")
    if config.double_buffer and not record.double_buffer:
        # two-shot/multimem have no end barrier to remove: their second barrier waits for the
        # peers' pushes into our stage (data, not a guard against overwriting it).
        capable = tuple(name for name, a in algorithms.items() if a.double_buffer)
        raise ValueError(f"double_buffer=True is only for algorithm in {capable}, not {config.algorithm!r}")
    return record


def _check_spin(config, record: "Algorithm") -> None:
    """``spin`` (the Lamport wait's per-thread spin, autosymm.kernels.lamport_all_reduce) is a
    bool, and True only for an algorithm over the Lamport region."""
    if not isinstance(config.spin, bool):
        raise ValueError(f"spin={config.spin!r} must be a bool")
    if config.spin and not record.lamport:
        raise ValueError(f"spin=True is only for the Lamport algorithm, not {config.algorithm!r}")


def config_fields(config) -> dict[str, Any]:
    """The fields that describe ``config``, in order: fields added after configs were first
    stored (metadata ``json_omit_default``) only when they differ from their default, so
    descriptions and JSON of older configs read as before."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.metadata.get("json_omit_default") and value == f.default:
            continue
        out[f.name] = value
    return out


@dataclass(frozen=True)
class AllReduceConfig(AnyConfig):
    """One launch of a Triton all-reduce kernel.

    ``block_size`` is the BLOCK width: elements one program handles per loop iteration
    (a power of two; each of its ``num_warps * 32`` threads owns ``block_size / threads``
    consecutive elements, 16 bytes or more when the vector loads are to be 128-bit).
    ``num_blocks`` programs stride over the data, so any element count is served.
    ``double_buffer`` (one-shot only): a staged (non-zero-copy) input alternates between two
    staging halves and the kernel has no end barrier (autosymm.kernels.all_reduce); a tensor too
    large for a half, or a zero-copy one, takes the single-buffer path. Absent from the JSON when
    False, so rows written before the field existed read back, and serialise, unchanged.
    ``eager_launch`` (:data:`EAGER_LAUNCHES`, eager rows): how an eager call launches; absent from
    the JSON at its default 'replay', as are graph rows' (where it means nothing).
    ``spin`` (Lamport only): at world size 2 on a GPU, each thread re-polls only its own missing
    words (the kernel's SPIN); elsewhere it changes nothing. Absent from the JSON when False.
    """

    algorithm: str
    block_size: int
    num_blocks: int
    num_warps: int
    double_buffer: bool = field(default=False, metadata={"json_omit_default": True})
    eager_launch: str = field(default="replay", metadata={"json_omit_default": True})
    spin: bool = field(default=False, metadata={"json_omit_default": True})
    #: The module whose ``ALGORITHMS`` names the algorithms (not a field).
    FAMILY: ClassVar[str] = "autosymm.backends.triton_all_reduce:ALGORITHMS"  # an entry (autosymm.entries)

    def __post_init__(self) -> None:
        _check_spin(self, _check_algorithm(self))
        _check_eager_launch(self)
        _check_ints(self, "block_size", "num_blocks", "num_warps")
        _check_num_warps(self.num_warps)
        _check_block("block_size", self.block_size, 1)
        if self.block_size < self.threads:
            raise ValueError(
                f"block_size={self.block_size} is smaller than the {self.threads} threads of "
                f"num_warps={self.num_warps}: each thread needs at least one element"
            )
        if not 1 <= self.num_blocks <= MAX_PROGRAMS:
            raise ValueError(f"num_blocks={self.num_blocks} must be in 1..{MAX_PROGRAMS}")

    @property
    def threads(self) -> int:
        """Threads per program (block)."""
        return self.num_warps * WARP_SIZE

    @property
    def record(self) -> "Algorithm":
        """The algorithm's record (autosymm.backends.triton_all_reduce.ALGORITHMS)."""
        return family_algorithms(self.FAMILY)[self.algorithm]


@dataclass(frozen=True)
class MoEConfig(AnyConfig):
    """One launch of a MoE token conversion kernel (dp->ep or ep->dp).

    ``block_n`` is the BLOCK width along d_model (elements per inner iteration);
    ``rows_per_program`` token rows are copied by each program; ``num_blocks`` > 0 switches to a
    persistent grid of that many programs striding over the rows (0: one program per
    ``rows_per_program`` rows).
    """

    block_n: int
    num_warps: int
    rows_per_program: int = 1
    num_blocks: int = 0

    def __post_init__(self) -> None:
        _check_ints(self, "block_n", "num_warps", "rows_per_program", "num_blocks")
        _check_num_warps(self.num_warps)
        _check_block("block_n", self.block_n, 16)
        if self.block_n < self.num_warps * WARP_SIZE:
            raise ValueError(
                f"block_n={self.block_n} is smaller than the {self.num_warps * WARP_SIZE} threads "
                f"of num_warps={self.num_warps}"
            )
        if self.rows_per_program < 1 or self.rows_per_program > 64:
            raise ValueError(f"rows_per_program={self.rows_per_program} must be in 1..64")
        if self.num_blocks < 0 or self.num_blocks > 4 * 1024:
            raise ValueError(f"num_blocks={self.num_blocks} must be 0 (one program per row group) or 1..4096")


#: Most fp32 values of a [rows_per_program, block_size] tile one thread holds (more spill).
FUSED_MAX_TILE_PER_THREAD = 64


@dataclass(frozen=True)
class FusedConfig(AnyConfig):
    """One launch of a fused all-reduce + residual add + RMSNorm kernel
    (autosymm.kernels.fused_rmsnorm).

    A program owns whole rows: groups of ``rows_per_program`` rows held in registers as one
    [rows_per_program, block_size] tile (``block_size`` >= the hidden size:
    autosymm.backends.triton_fused.fused_block_size; more than :data:`FUSED_MAX_TILE_PER_THREAD`
    values a thread only with one row); ``num_blocks`` programs stride over the row groups.
    ``double_buffer`` (one-shots): staged in the halves of the all-reduce double buffer without
    an end barrier, as AllReduceConfig's. ``row_split`` (one-shots, one row per program):
    programs sharing a row, each holding
    ``block_size / row_split`` columns, the row's last one normalising it; calls of more than
    :data:`autosymm.geometry.FUSED_SPLIT_MAX_ROWS` rows run with whole rows instead.
    ``eager_launch``, ``spin`` (Lamport): as AllReduceConfig's.
    """

    algorithm: str
    block_size: int
    num_warps: int
    num_blocks: int
    rows_per_program: int = 1
    double_buffer: bool = False
    row_split: int = field(default=1, metadata={"json_omit_default": True})
    eager_launch: str = field(default="replay", metadata={"json_omit_default": True})
    spin: bool = field(default=False, metadata={"json_omit_default": True})
    #: The module whose ``ALGORITHMS`` names the algorithms (not a field).
    FAMILY: ClassVar[str] = "autosymm.backends.triton_fused:ALGORITHMS"  # an entry (autosymm.entries)

    def __post_init__(self) -> None:
        record = _check_algorithm(self)
        _check_spin(self, record)
        _check_eager_launch(self)
        _check_ints(self, "block_size", "num_warps", "num_blocks", "rows_per_program", "row_split")
        _check_num_warps(self.num_warps)
        _check_block("block_size", self.block_size, 16)
        threads = self.num_warps * WARP_SIZE
        if self.block_size < threads:
            raise ValueError(f"block_size={self.block_size} is smaller than the {threads} threads of "
                             f"num_warps={self.num_warps}")
        if not 1 <= self.num_blocks <= MAX_PROGRAMS:
            raise ValueError(f"num_blocks={self.num_blocks} must be in 1..{MAX_PROGRAMS}")
        if not _is_pow2(self.rows_per_program) or self.rows_per_program > 16:
            raise ValueError(f"rows_per_program={self.rows_per_program} must be a power of two in 1..16")
        if self.rows_per_program > 1 and self.rows_per_program * self.block_size > FUSED_MAX_TILE_PER_THREAD * threads:
            raise ValueError(f"rows_per_program={self.rows_per_program} x block_size={self.block_size} is more than "
                             f"{FUSED_MAX_TILE_PER_THREAD} values per thread of num_warps={self.num_warps}")
        self._check_row_split(record, threads)

    @property
    def record(self) -> "Algorithm":
        """The algorithm's record (autosymm.backends.triton_fused.ALGORITHMS)."""
        return family_algorithms(self.FAMILY)[self.algorithm]

    def _check_row_split(self, record: "Algorithm", threads: int) -> None:
        if not _is_pow2(self.row_split) or self.row_split > FUSED_SPLIT_MAX:
            raise ValueError(f"row_split={self.row_split} must be a power of two in 1..{FUSED_SPLIT_MAX}")
        if self.row_split == 1:
            return
        if not record.row_split:
            raise ValueError(f"row_split={self.row_split} is only for the one-shots, not algorithm={self.algorithm!r}")
        if self.rows_per_program != 1:
            raise ValueError(f"row_split={self.row_split} needs rows_per_program=1, not {self.rows_per_program}")
        if self.block_size // self.row_split < threads:
            raise ValueError(f"row_split={self.row_split} leaves block_size={self.block_size} / row_split columns, "
                             f"fewer than the {threads} threads of num_warps={self.num_warps}")


@dataclass(frozen=True)
class FlashInferFusedConfig(AnyConfig):
    """One call of FlashInfer's fused all-reduce (autosymm.backends.flashinfer_fused): its
    ``use_oneshot`` flag (True: one-shot Lamport all-reduce; False: two-shot reduce-scatter +
    all-gather) and ``fp32_acc`` (accumulate the peers' sum in fp32)."""

    use_oneshot: bool
    fp32_acc: bool

    def __post_init__(self) -> None:
        for name in ("use_oneshot", "fp32_acc"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")


REDUCE_SCATTER_ALGORITHMS = ("pull", "push")
ALL_GATHER_ALGORITHMS = ("push", "pull")


@dataclass(frozen=True)
class _LaunchConfig(AnyConfig):
    """One launch of a reduce-scatter or all-gather kernel: ``block_size`` units per program
    and chunk (a power of two, at least one per thread), ``num_blocks`` programs striding over
    the chunks of every segment, ``num_warps`` warps a program."""

    algorithm: str
    block_size: int
    num_blocks: int
    num_warps: int

    ALGORITHMS = ()
    UNIT = "elements"

    def __post_init__(self) -> None:
        if not isinstance(self.algorithm, str) or self.algorithm not in self.ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r} is not one of {self.ALGORITHMS}")
        for name in ("block_size", "num_blocks", "num_warps"):
            object.__setattr__(self, name, as_int(name, getattr(self, name)))  # the dataclass is frozen
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two in 1..32")
        threads = self.num_warps * WARP_SIZE
        block = self.block_size
        if block & (block - 1) or not threads <= block <= MAX_BLOCK:
            raise ValueError(f"block_size={block} must be a power of two in {threads}..{MAX_BLOCK} ({self.UNIT}; "
                             f"at least one per thread of num_warps={self.num_warps})")
        if not 1 <= self.num_blocks <= MAX_PROGRAMS:
            raise ValueError(f"num_blocks={self.num_blocks} must be in 1..{MAX_PROGRAMS}")


@dataclass(frozen=True)
class ReduceScatterConfig(_LaunchConfig):
    """A reduce-scatter launch (autosymm.kernels.reduce_scatter; its layout:
    autosymm.backends.rs_ag_layout); ``block_size`` in elements."""

    ALGORITHMS = REDUCE_SCATTER_ALGORITHMS


@dataclass(frozen=True)
class AllGatherConfig(_LaunchConfig):
    """An all-gather launch (autosymm.kernels.all_gather); ``block_size`` in bytes."""

    ALGORITHMS = ALL_GATHER_ALGORITHMS
    UNIT = "bytes"


def config_types() -> dict[str, type]:
    """Every config class a database row may hold, by name: the config types of the registered ops
    (autosymm.spec.OpSpec.config_types), in registry order."""
    return {cls.__name__: cls for record in registered_specs() for cls in record.config_types}


def config_to_json(config: AnyConfig | None) -> str:
    """Serialise a config (or None, for backends without one) as JSON with its type name."""
    if config is None:
        return "{}"
    # fields added later are omitted at their default: older rows' JSON is unchanged
    return json.dumps({"type": type(config).__name__, **config_fields(config)}, sort_keys=True)


def config_from_json(text: str | None) -> AnyConfig | None:
    """Inverse of :func:`config_to_json`; unknown keys are ignored.

    Empty text or ``{}`` is None (a config-less backend). Anything malformed (not JSON, not an
    object, an unknown or missing ``type``, missing or ill-typed fields) raises ValueError.
    """
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise ValueError(f"config {text!r} is not JSON text ({type(text).__name__})")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"config {text[:200]!r} is not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config {text[:200]!r} is not a JSON object")
    if not data:
        return None
    type_name = data.pop("type", None)
    types = config_types()
    cls = types.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ValueError(f"unknown config type {type_name!r} in {text[:200]!r}: "
                         f"expected one of {sorted(types)}")
    fields = dataclasses.fields(cls)
    missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"config {text[:200]!r} lacks {type_name} field(s) {missing}")
    return cls(**{f.name: data[f.name] for f in fields if f.name in data})


# --------------------------------------------------------------------------------------------
# Search spaces
# --------------------------------------------------------------------------------------------

def useful_counts(counts: tuple[int, ...], work_items: int) -> list[int]:
    """The counts below ``work_items`` plus the first one that covers it (more only idle)."""
    below = [c for c in counts if c < work_items]
    covering = [c for c in counts if c >= work_items]
    return below + covering[:1]


# Row copies are bandwidth-bound: 1-2 warps cannot keep enough 16-byte stores in flight for rows
# of thousands of elements, so the space starts at 4 warps; kept small so the default sweep
# (4 shapes x 8 token counts x 2 ops, autosymm.spec.kinds.TOKEN_COUNTS) fits in minutes.
MOE_BLOCK_N = (256, 512, 1024, 2048, 4096)
MOE_NUM_WARPS = (4, 8, 16)
MOE_ROWS_PER_PROGRAM = (1, 2, 4)
MOE_NUM_BLOCKS = (0, 132, 264)


def moe_space(d_model: int, n_rows: int) -> list[MoEConfig]:
    """Valid configs of a MoE conversion moving ``n_rows`` rows of ``d_model`` elements.

    BLOCK widths far beyond d_model are dropped (they only mask), as are persistent grids with
    more programs than row groups. Never empty.
    """
    space: list[MoEConfig] = []
    for block_n in MOE_BLOCK_N:
        if block_n > 2 * max(d_model, MOE_BLOCK_N[0]) and block_n != MOE_BLOCK_N[0]:
            continue
        for num_warps in MOE_NUM_WARPS:
            if num_warps * WARP_SIZE > block_n:
                continue
            for rows in MOE_ROWS_PER_PROGRAM:
                groups = max(1, -(-n_rows // rows))
                for num_blocks in MOE_NUM_BLOCKS:
                    if num_blocks and num_blocks >= groups:
                        continue  # a persistent grid wider than the row groups is the plain grid
                    space.append(MoEConfig(block_n, num_warps, rows, num_blocks))
    return space


def iter_space_fields(space: list[AnyConfig]) -> Iterator[tuple[str, list[Any]]]:
    """(field, sorted distinct values) of a space: the axes an Optuna study suggests over."""
    if not space:
        return
    for axis in dataclasses.fields(space[0]):
        values = sorted({getattr(c, axis.name) for c in space}, key=lambda v: (str(type(v)), v))
        yield axis.name, values

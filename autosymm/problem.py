"""What a collective call is (`Problem`), the size the tuning database keys it under, and the
parsing of sizes and size ranges.

Bucket rule (the database's ``bucket`` column; relied on by the tuner and the dispatcher): a
problem's bucket is its exact size, in its op's unit (autosymm.spec: bytes of the full tensor, at
least 1, for the all-reduce, reduce-scatter and all-gather; tokens per rank for the MoE
conversions and the fused all-reduce + RMSNorm, whose shape is a column of its own). A bucket is
a tuned point, not a range: a call between tuned points is served from its neighbours
(autosymm.runtime.neighbours).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .dist_compat import REDUCE_OP_NAMES
from .units import format_size, parse_size

MODES = ("eager", "graph")

#: The dtypes autosymm's kernels compute in, by the names its database rows carry.
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """'bf16' | 'fp16' | 'fp32' for a supported dtype; ValueError naming it otherwise."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported (supported: {sorted(DTYPES)})") from None


def any_dtype_name(dtype: torch.dtype) -> str:
    """The name a Problem carries for any torch dtype: :data:`DTYPES`' for the kernels' dtypes,
    else torch's own ('float64', 'int32', 'float8_e4m3fn', 'bool', ...)."""
    return DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a Problem's dtype name (:func:`any_dtype_name`); ValueError naming it."""
    dtype = DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, str(name), None) if str(name).isidentifier() else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={name!r} is not one of {sorted(DTYPES)} nor a torch dtype name")
    return dtype


def next_pow2(value: int) -> int:
    """Smallest power of two >= value (1 for value <= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


@dataclass(frozen=True)
class MoEShape:
    """A MoE layer's routing shape: hidden size, experts in total, experts per token (top-k)."""

    d_model: int
    n_expts_tot: int
    n_expts_act: int

    def __post_init__(self) -> None:
        if self.d_model < 1 or self.n_expts_tot < 1:
            raise ValueError(f"d_model={self.d_model} and n_expts_tot={self.n_expts_tot} must be >= 1")
        if not 1 <= self.n_expts_act <= self.n_expts_tot:
            raise ValueError(f"top-k n_expts_act={self.n_expts_act} must be in 1..n_expts_tot={self.n_expts_tot}")

    @property
    def key(self) -> str:
        """Stable text form, e.g. 'd7168_e256_k8' (database column `shape`)."""
        return f"d{self.d_model}_e{self.n_expts_tot}_k{self.n_expts_act}"

    @classmethod
    def from_key(cls, key: str) -> "MoEShape":
        """Inverse of :attr:`key`; a ValueError naming ``key`` for any other text."""
        match = re.fullmatch(r"d([1-9][0-9]*)_e([1-9][0-9]*)_k([1-9][0-9]*)", str(key))
        if match is None:
            raise ValueError(f"{key!r} is not a MoE shape key like 'd7168_e256_k8'")
        return cls(*(int(group) for group in match.groups()))


#: The MoE shapes tuned by default: (d_model, experts, top-k) of public model configs.
MODEL_SHAPES: dict[str, MoEShape] = {
    "deepseek-v3": MoEShape(7168, 256, 8),
    "qwen3-30b-a3b": MoEShape(2048, 128, 8),
    "gpt-oss-120b": MoEShape(2880, 128, 4),
    "mixtral-8x7b": MoEShape(4096, 8, 2),
}


#: op name -> its spec (autosymm.spec.base.OpSpec), in registry order: the op registry, filled by
#: autosymm.spec.register (the shipped ops when the package loads; the specs build Problems, so they
#: import this module, not the reverse). Every other registry (doors, backends, tuning modules,
#: benches, config types) is read off the specs registered here.
_SPECS: dict[str, Any] = {}


def register_specs(specs) -> None:
    """Register op specs (autosymm.spec.register: its checks first)."""
    _SPECS.update((spec.name, spec) for spec in specs)


def registered_specs() -> tuple:
    """Every registered op spec, in registry order."""
    return tuple(_SPECS.values())


def spec_of(op: str):
    """The registered spec of op ``op``; ValueError naming the registered ops otherwise."""
    spec = _SPECS.get(op)
    if spec is None:
        raise ValueError(f"op={op!r} is not one of {tuple(_SPECS)}")
    return spec


@dataclass(frozen=True)
class Problem:
    """One collective call, as the tuner and the dispatcher see it.

    For ``all_reduce``: ``nbytes`` is the tensor's size in bytes. For the MoE ops: ``shape`` and
    ``n_tokens_local`` (tokens per rank) describe it and ``nbytes`` is the bytes of local tokens.
    For ``all_reduce_rmsnorm``: ``n_tokens_local`` rows of ``hidden`` elements (``nbytes`` = their
    bytes, the all-reduced tensor's).
    """

    op: str
    #: 'bf16' | 'fp16' | 'fp32' (:data:`DTYPES`, the kernels' and the database's), or any other
    #: torch dtype by torch's name (:func:`any_dtype_name`), which only the fallbacks serve
    dtype: str
    world_size: int
    nbytes: int = 0
    #: the op's shape record where its key has one (MoEShape for the MoE conversions; an op with a
    #: new kind of shape declares its record in its spec, autosymm.spec)
    shape: Any = None
    n_tokens_local: int = 0
    hidden: int = 0  # all_reduce_rmsnorm only: elements per row
    #: all_reduce_rmsnorm only: its autosymm.epilogue.Epilogue (None: the default, set by the op's spec)
    epilogue: Any = None
    #: the reduction of a reducing op (all_reduce, reduce_scatter), by its name
    #: (autosymm.dist_compat.REDUCE_OP_NAMES); the kernels sum, the fallbacks serve the others
    reduce_op: str = "sum"
    #: The op's registered spec (autosymm.spec), found once: it keys and describes the problem.
    record: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        record = spec_of(self.op)  # ValueError naming the registered ops
        object.__setattr__(self, "record", record)
        torch_dtype(self.dtype)  # ValueError naming an unknown dtype
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an integer >= 1")
        if self.reduce_op not in REDUCE_OP_NAMES:
            raise ValueError(f"reduce_op={self.reduce_op!r} is not one of {REDUCE_OP_NAMES}")
        record.check_problem(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def elem_bytes(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @property
    def numel(self) -> int:
        """Elements of ``nbytes`` (the bytes-keyed ops' full tensor)."""
        return self.nbytes // self.elem_bytes

    @property
    def bucket(self) -> int:
        """The database bucket: the exact size, tokens per rank for MoE and the fused op, bytes
        (at least 1) for all-reduce (see the module docstring; the op's spec decides)."""
        return self.record.bucket(self)

    @property
    def shape_key(self) -> str:
        """The database `shape` column: '' for all-reduce, reduce-scatter and all-gather,
        MoEShape.key for MoE, 'h{hidden}' for all_reduce_rmsnorm, 'h{hidden}_{epilogue}' for its
        other epilogues (the op's spec decides)."""
        return self.record.shape_key(self)

    @classmethod
    def all_reduce(cls, nbytes: int, dtype: str = "bf16", world_size: int = 2) -> "Problem":
        return cls("all_reduce", dtype, world_size, nbytes=nbytes)

    @classmethod
    def moe(cls, op: str, shape: MoEShape, n_tokens_local: int, dtype: str = "bf16", world_size: int = 2) -> "Problem":
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
        return cls(op, dtype, world_size, nbytes=n_tokens_local * shape.d_model * elem, shape=shape,
                   n_tokens_local=n_tokens_local)

    @classmethod
    def all_reduce_rmsnorm(cls, n_tokens_local: int, hidden: int, dtype: str = "bf16",
                           world_size: int = 2, epilogue: Any = None) -> "Problem":
        """The fused all-reduce + residual add + RMSNorm of [n_tokens_local, hidden] per rank, with
        ``epilogue`` (autosymm.epilogue.Epilogue; None: the default, residual add and x's dtype)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
        return cls("all_reduce_rmsnorm", dtype, world_size, nbytes=n_tokens_local * hidden * elem,
                   n_tokens_local=n_tokens_local, hidden=hidden, epilogue=epilogue)

    def describe(self) -> str:
        return self.record.describe(self)


def parse_bytes(text: str) -> int:
    """Bytes of a size: '3MB' -> 3000000 (SI units decimal), '16KiB' -> 16384 (IEC units binary),
    '4096' -> 4096 (autosymm.units.parse_size: 'K' alone is refused as ambiguous)."""
    return parse_size(text)


#: Points per octave a range may ask for (``low:high:N``): N evenly spaced in each octave.
POINTS_PER_OCTAVE = (1, 2, 4, 8)


def octave_points(low: int, high: int, per_octave: int = 1) -> list[int]:
    """Sizes from ``low`` to ``high`` (inclusive): each power of two p >= next_pow2(low) and, with
    ``per_octave`` = N > 1, also p * (1 + j / N) for j = 1..N-1 (N = 2: p and 1.5 p), rounded down
    to integers, ascending and distinct. ValueError naming the bad bound or N."""
    if low < 1 or high < low:
        raise ValueError(f"size range {low}:{high} must be low:high with 1 <= low <= high")
    if per_octave not in POINTS_PER_OCTAVE:
        raise ValueError(f"{per_octave} points per octave: choose one of {POINTS_PER_OCTAVE}")
    points, base = [], next_pow2(low)
    while base <= high:
        points += [base * (per_octave + j) // per_octave for j in range(per_octave)]
        base *= 2
    return sorted({p for p in points if low <= p <= high})


def parse_range(text: str, parse=int) -> tuple[int, int, int]:
    """'low:high' or 'low:high:N' -> (low, high, N) with ``parse`` reading the bounds (N = 1 when
    absent). ValueError naming ``text``."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{text!r} is not a range low:high or low:high:N (N points per octave)")
    try:
        low, high = parse(parts[0]), parse(parts[1])
        per_octave = int(parts[2]) if len(parts) == 3 else 1
    except ValueError as exc:
        raise ValueError(f"cannot read range {text!r}: {exc}") from None
    return low, high, per_octave


def parse_size_range(text: str) -> list[int]:
    """'4KiB:256MiB' -> powers of two from 4 KiB to 256 MiB; '4KiB:256MiB:2' -> two points per
    octave (2^k and 1.5 * 2^k, :func:`octave_points`); '1MiB,3000000' -> those sizes."""
    if ":" in text:
        return octave_points(*parse_range(text, parse_bytes))
    sizes = [parse_bytes(t) for t in text.split(",") if t.strip()]
    if not sizes:
        raise ValueError(f"no sizes in {text!r} (examples: 4KiB:256MiB, 4KiB:256MiB:2, 1MiB,3000000)")
    return sizes


def format_bytes(nbytes: int) -> str:
    """4096 -> '4KiB', 1572864 -> '1.5MiB', 3000000 -> '3MB', 1023 -> '1023B': binary units where
    exact, else decimal ones, else bytes (autosymm.units.format_size; parse_bytes reads it back)."""
    return format_size(nbytes)



"""Tuning-database schema: columns, the Key and Row records and their validation, errors and the
trust rules (see autosymm.db.store; opening a file is autosymm.db.open, creating and migrating
its tables autosymm.db.migrations).

Kept apart from the TuningDB class so the schema and its migrations read in one place. Tables
and the view are created through sqlite-utils (``Table.create``, ``Database.create_view``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, NamedTuple, Optional, Union

import sqlite_utils

from .. import spec
from ..backends import STACK_PATHS, backend_names, get_backend
from ..configs import AnyConfig, as_int, config_from_json, config_to_json, config_types
from ..problem import DTYPES, MODES, MoEShape


if not hasattr(sqlite_utils.Database, "atomic"):  # 3.x commits an open transaction on every write
    raise ImportError("autosymm.db.store needs sqlite-utils >= 4.0 (nested transactions): pip install -U sqlite-utils")

SCHEMA_VERSION = 4
BUSY_TIMEOUT_S = 30.0
KEY_COLUMNS = ("hardware", "world_size", "op", "dtype", "bucket", "shape", "mode")
PK_COLUMNS = KEY_COLUMNS + ("backend",)
FILTER_COLUMNS = PK_COLUMNS + ("gpu",)
_VERSION_COLUMNS = ("autosymm_version", "torch_version", "triton_version", "cuda_version", "driver_version")
#: Where a row was measured (autosymm.hardware.provenance): the versions; ``comm_env``, the
#: multicast/NVLS environment variables as the tune saw them (e.g. 'NCCL_NVLS_ENABLE=0 ...'),
#: which decide whether NCCL's baseline in that row could use NVLink SHARP; and
#: ``nccl_version``, the NCCL whose time ``nccl_us`` is (e.g. '2.28.9'; NULL: not recorded).
PROVENANCE_COLUMNS = _VERSION_COLUMNS + ("comm_env", "nccl_version")
#: The largest tensor a call can have, bytes: 1 TiB. A collective's tensor lives in one GPU's
#: memory (an all-gather's output, a reduce-scatter's input too), and no GPU holds 1 TiB (the
#: largest, B300, has 288 GB). A row's bucket is bounded by it: bytes as they are, tokens per
#: rank times the bytes of one token of the row's shape (autosymm.problem).
MAX_TENSOR_BYTES = 1 << 40
_NCCL_VERSION = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}(\.[0-9]{1,4})?")

#: The results table, in on-disk column order (sqlite-utils types: str TEXT, int INTEGER, float REAL).
RESULTS_COLUMNS: dict[str, type] = {
    "hardware": str, "gpu": str, "world_size": int, "op": str, "dtype": str, "bucket": int, "shape": str,
    "mode": str, "backend": str, "config": str, "median_us": float, "p10_us": float, "p90_us": float,
    "nccl_us": float, "speedup": float, "trials": int, "autosymm_version": str, "torch_version": str,
    "triton_version": str, "cuda_version": str, "driver_version": str, "created": str, "comm_env": str,
    "nccl_version": str, "stack": str, "stack_us": float, "stack_note": str,
}
RESULTS_NOT_NULL = PK_COLUMNS + ("gpu", "config", "median_us", "created")
RESULTS_DEFAULTS = {"gpu": "", "shape": "", "config": "{}"}
#: The ``winners`` view, kept in every file for the ``sqlite3`` command line: results' fastest row
#: per key (ties: backend name), bad rows included. autosymm never reads it (a file's view is the
#: file's own code): its winners come from the results table (autosymm.db.read).
WINNERS_SQL = f"""SELECT * FROM (
  SELECT results.*, ROW_NUMBER() OVER (PARTITION BY {', '.join(KEY_COLUMNS)}
                                       ORDER BY median_us, backend) AS place
  FROM results) WHERE place = 1"""
ROW_ORDER = "hardware, world_size, op, dtype, shape, mode, bucket, median_us, backend"
#: Columns a version-0 database (pre-release: no meta table) must have to be recognised.
V0_COLUMNS = frozenset(PK_COLUMNS + ("config", "median_us", "created"))


class TuningDBError(ValueError):
    """A tuning database cannot be used as asked (the message names the file)."""


class DatabaseVersionError(TuningDBError):
    """The database was written by a newer autosymm (a schema this version cannot read)."""


class CorruptDatabaseError(TuningDBError):
    """The file is not SQLite, not an autosymm tuning database, or cannot be read safely."""


class ReadOnlyDatabaseError(TuningDBError):
    """A write to a database opened with ``readonly=True``."""


class BadRowWarning(UserWarning):
    """A stored row does not parse or validate: every read skips it (warned once per file and key)."""


class Key(NamedTuple):
    """What a row is stored under and a lookup reads by: the tuner writes each row at
    ``Key.for_problem(hardware, problem, mode)`` (autosymm.tuning.outcome), the dispatcher reads
    the key of the call (autosymm.db.read)."""

    hardware: str
    world_size: int
    op: str
    dtype: str
    bucket: int
    shape: str = ""
    mode: str = "eager"

    @classmethod
    def for_problem(cls, hardware: str, problem: Any, mode: str = "eager") -> "Key":
        """The key of an autosymm.problem.Problem on ``hardware`` in ``mode`` (its dtype: the rows'
        that decide it, autosymm.spec.OpSpec.key_dtype)."""
        return cls(hardware, problem.world_size, problem.op, problem.record.key_dtype(problem), problem.bucket,
                   problem.shape_key, mode)


class MergeCounts(NamedTuple):
    """What a merge did with one source's rows (:func:`autosymm.db.merge.merge_files`)."""

    inserted: int  # new keys/backends
    replaced: int  # faster than the target's row (or the target's row was bad)
    kept: int  # the target's row was at least as fast
    skipped: int  # bad source rows (each warned about)


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _int(name: str, value: Any, smallest: int) -> int:
    """``value`` as an int (numpy's too, never a bool, float or str) of at least ``smallest``."""
    value = as_int(f"Row.{name}", value)
    if value < smallest:
        raise ValueError(f"Row.{name}={value} must be >= {smallest}")
    return value


def _positive(name: str, value: Any) -> float:
    """``value`` as a finite float > 0 (a time in microseconds when ``name`` ends in _us)."""
    what = "time > 0 (microseconds)" if name.endswith("_us") else "number > 0"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"Row.{name}={value!r} must be a finite {what}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"Row.{name}={value!r} must be a finite {what}")
    return value


#: Parsed configs by JSON text: a database holds few distinct configs, and configs are frozen.
_config_of = functools.lru_cache(maxsize=4096)(config_from_json)


def _opt(convert: Callable[[str, Any], Any], name: str, value: Any, *args: Any) -> Any:
    return None if value is None else convert(name, value, *args)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measured (key, backend): its best config and times in microseconds, with provenance.

    ``config`` is the JSON text of the launch config; a config object (or None) given instead
    is serialised. ``speedup`` defaults to ``nccl_us / median_us`` when NCCL was measured.
    Every field is validated (the config parsed into its dataclass): a bad value is a
    ValueError naming the field.
    """

    hardware: str
    world_size: int
    op: str
    dtype: str
    bucket: int
    backend: str
    median_us: float
    shape: str = ""
    mode: str = "eager"
    gpu: str = ""
    config: Union[str, AnyConfig, None] = "{}"
    p10_us: Optional[float] = None
    p90_us: Optional[float] = None
    nccl_us: Optional[float] = None
    speedup: Optional[float] = None
    trials: Optional[int] = None
    autosymm_version: Optional[str] = None
    torch_version: Optional[str] = None
    triton_version: Optional[str] = None
    cuda_version: Optional[str] = None
    driver_version: Optional[str] = None
    created: str = field(default_factory=_utc_now)
    comm_env: Optional[str] = None
    nccl_version: Optional[str] = None
    #: the serving stack whose own path the row's tune timed beside NCCL ('vllm', 'sglang';
    #: None: a tune outside a stack), its time (us, MAX over ranks) in ``stack_us``, or in
    #: ``stack_note`` why it could not be timed (autosymm.tuning.warmup)
    stack: Optional[str] = None
    stack_us: Optional[float] = None
    stack_note: Optional[str] = None

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # the dataclass is frozen
            object.__setattr__(self, name, value)

        for name in ("hardware", "op", "dtype", "mode", "backend", "created", "shape", "gpu"):
            value = getattr(self, name)
            if not isinstance(value, str) or not (value or name in ("shape", "gpu")):
                raise ValueError(f"Row.{name}={value!r} must be a string (non-empty but for shape, gpu)")
        put("world_size", _int("world_size", self.world_size, 1))
        put("bucket", _int("bucket", self.bucket, 1))
        put("trials", _opt(_int, "trials", self.trials, 0))
        put("median_us", _positive("median_us", self.median_us))
        for name in ("p10_us", "p90_us", "nccl_us", "speedup", "stack_us"):
            put(name, _opt(_positive, name, getattr(self, name)))
        for name in ("stack", "stack_note"):
            put(name, getattr(self, name) or None)
        if self.stack is not None and self.stack not in STACK_PATHS:
            raise ValueError(f"Row.stack={self.stack!r} is not one of {STACK_PATHS} (or NULL: no stack)")
        if self.stack is None and (self.stack_us is not None or self.stack_note is not None):
            raise ValueError("Row.stack_us and Row.stack_note need Row.stack (the stack whose path they describe)")
        if self.speedup is None and self.nccl_us is not None:
            put("speedup", self.nccl_us / self.median_us)
        for name in PROVENANCE_COLUMNS:
            value = getattr(self, name)
            put(name, None if value is None else str(value))
        put("nccl_version", self.nccl_version or None)  # '' (the tuner without NCCL): not recorded
        if self.nccl_version is not None and not _NCCL_VERSION.fullmatch(self.nccl_version):
            raise ValueError(f"Row.nccl_version={self.nccl_version!r} must be a version like '2.28.9'")
        self._check_vocabulary()
        if self.config is None or (not isinstance(self.config, str)
                                   and isinstance(self.config, tuple(config_types().values()))):
            put("config", config_to_json(self.config))
        if not isinstance(self.config, str) or not self.config.strip():
            raise ValueError(f"Row.config={self.config!r} must be a config's JSON text ('{{}}' for none)")
        try:
            put("_config_obj", _config_of(self.config))  # parsed once per text: validated and cached
        except ValueError as exc:
            raise ValueError(f"Row.config: {exc}") from None
        # the config type of the op's rows (its spec's): a row of another op's type is refused
        record = spec.get(self.op) if self.op in spec.names() else None
        kind = record.config_type if record is not None else None
        kinds = (kind, *record.other_config_types) if kind is not None else ()
        if self._config_obj is not None and kind is not None and not isinstance(self._config_obj, kinds):
            raise ValueError(f"Row.config: config type {type(self._config_obj).__name__} does not belong to op "
                             f"{self.op!r} (its rows hold {kind.__name__})")

    def _check_vocabulary(self) -> None:
        """The key's words are autosymm's: a registered op, a dtype and mode it serves, a shape
        of the op's kind, a bucket no larger than a tensor can be (MAX_TENSOR_BYTES), and a key
        some call has: the op's spec builds its Problem (``OpSpec.problem_of_row``), so the op's
        and its epilogue's own rules hold (e.g. NVFP4 packs a hidden size of whole 16-blocks)."""
        if self.op not in spec.names():
            raise ValueError(f"Row.op={self.op!r} is not one of {spec.names()}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Row.dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.mode not in MODES:
            raise ValueError(f"Row.mode={self.mode!r} is not one of {MODES}")
        record = spec.get(self.op)
        if not record.shape and self.shape:
            raise ValueError(f"Row.shape={self.shape!r}: op {self.op} has no shape ('' only)")
        per_unit = 1  # bytes per bucket unit: a shaped op's bucket counts tokens of the shape's row
        if record.shape:
            try:
                shape = record.shape_of_key(self.shape)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"Row.shape={self.shape!r}: {exc}") from None
            per_unit = record.shape.row_elements(shape) * DTYPES[self.dtype].itemsize
        if self.bucket * per_unit > MAX_TENSOR_BYTES:
            what = "bytes" if per_unit == 1 else f"tokens per rank of {per_unit} bytes each"
            raise ValueError(f"Row.bucket={self.bucket} {what} is over the largest tensor a call can have "
                             f"({MAX_TENSOR_BYTES} bytes, 1 TiB)")
        try:  # the op's and its epilogue's own rules, as a call of this key would meet them
            record.problem_of_row(self)
        except ValueError as exc:
            raise ValueError(f"Row.shape={self.shape!r} at bucket {self.bucket}: no {self.op} call has this key "
                             f"({exc})") from None

    @property
    def key(self) -> Key:
        return Key(*(getattr(self, c) for c in KEY_COLUMNS))

    @property
    def pk(self) -> tuple:
        """The primary key: ``key`` plus ``backend``."""
        return tuple(getattr(self, c) for c in PK_COLUMNS)

    @property
    def config_obj(self) -> Optional[AnyConfig]:
        """The config as an AllReduceConfig / MoEConfig / FusedConfig (None for config-less backends)."""
        return self._config_obj

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Row":
        """A validated Row from a mapping (a database row); keys that are not fields (extra
        columns) are ignored, None values take the field's default. A missing, malformed or
        out-of-range value raises ValueError naming the field."""
        values = {k: v for k, v in data.items() if k in ROW_FIELDS and v is not None}
        missing = [name for name in _REQUIRED_FIELDS if name not in values]
        if missing:
            raise ValueError(f"Row.{missing[0]} is missing (NULL)")
        return cls(**values)


def backend_fault(row: Row) -> Optional[str]:
    """Why ``row`` (a Row, its fields valid) is still unusable: its backend unknown, not serving
    its op, or holding another algorithm's config; None when it is usable."""
    if row.backend not in backend_names():
        return f"unknown backend {row.backend!r} (known: {', '.join(backend_names())})"
    if row.backend not in spec.get(row.op).backends:
        return f"backend {row.backend} does not serve op {row.op!r}"
    try:
        backend = get_backend(row.backend)
    except Exception:  # registered, not importable here (a broken optional piece): only its name is checked
        return None
    config = row.config_obj
    if config is None and backend.needs.compiles_kernels:
        return f"backend {row.backend} needs a launch config, the row holds none"
    want, have = getattr(backend, "algorithm", None), getattr(config, "algorithm", None)
    if config is not None and want is not None and have != want:
        return f"backend {row.backend} runs algorithm {want!r}, the config holds {have!r}"
    return None


def checked_row(data: Union[Row, dict[str, Any]]) -> Row:
    """The one row validator: ``data`` (a stored row's columns, or a Row) as a Row that every
    read, merge, export, ``show`` and the dispatcher may use. Its fields as Row checks them
    (types, ranges, the op/dtype/mode vocabulary, the bucket's bound MAX_TENSOR_BYTES, a key some
    call has, the config), then its backend (:func:`backend_fault`). ValueError saying what is wrong."""
    row = data if isinstance(data, Row) else Row.from_dict(data)
    fault = backend_fault(row)
    if fault is not None:
        raise ValueError(f"Row.backend: {fault}")
    return row


ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Row))
_REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(Row)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
assert set(ROW_FIELDS) == set(RESULTS_COLUMNS)


def version_mismatch(row: Row, torch_version: Optional[str], triton_version: Optional[str]) -> Optional[str]:
    """Why ``row``'s times may not hold here, e.g. "measured with torch 2.11.0, triton 3.6.0
    (running torch 2.13.0, triton 3.9.0)"; None when every version known on both sides agrees."""
    known = [(name, measured, running) for name, measured, running in
             (("torch", row.torch_version, torch_version), ("triton", row.triton_version, triton_version))
             if measured and running]
    if all(measured == running for _, measured, running in known):
        return None
    measured = ", ".join(f"{name} {version}" for name, version, _ in known)
    running = ", ".join(f"{name} {version}" for name, _, version in known)
    return f"measured with {measured} (running {running})"


#: The trust rule under an NCCL change. A row's speed-up is over the NCCL of its run, and NCCL's
#: small-message time moves between major.minor versions (2.28 -> 2.29 regressed, nccl#2094;
#: symmetric kernels arrived in 2.27), by tens of percent in the reported cases. Where the
#: running NCCL's major.minor differs from the row's, the row stays trusted only if it beat its
#: NCCL by at least this factor (speedup = nccl_us / median_us): NCCL would have to have become
#: 1.5x faster for it to lose. Others are passed over, so the call falls back towards NCCL.
NCCL_TRUST_MARGIN = 1.5


def _major_minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


def nccl_trust(row: Row, running: Optional[str]) -> tuple[bool, str]:
    """(whether dispatch may use ``row`` under the running NCCL ``running``, what to say of it).

    The one rule (NCCL_TRUST_MARGIN), a pure function of the row and the NCCL version the ranks
    agreed on (autosymm.hardware.nccl_version; every rank decides alike). No check, nothing
    said, where either version is unknown ('' or None: torch without NCCL, a row that did not
    record it) or their major.minor agree. Else: the op's NCCL baseline row (its ``fallback``)
    and a row without an NCCL time (NCCL could not serve that call) stay, said; another row stays
    if its speed-up over its NCCL is >= NCCL_TRUST_MARGIN, else it is not trusted."""
    measured = row.nccl_version
    if not running or not measured or _major_minor(running) == _major_minor(measured):
        return True, ""
    versions = f"measured with NCCL {measured}, running {running}"
    if row.backend == spec.get(row.op).fallback:
        return True, f"{versions}: the NCCL baseline itself"
    if row.speedup is None:
        return True, f"{versions}: no NCCL time in its run, NCCL's version does not bear on it"
    margin = f"{row.speedup:.2f}x over that NCCL"
    if row.speedup >= NCCL_TRUST_MARGIN:
        return True, f"{versions}: kept, {margin} >= {NCCL_TRUST_MARGIN:g}x"
    return False, f"{versions}: only {margin} (< {NCCL_TRUST_MARGIN:g}x), not trusted across NCCL versions"


_ANY_OF = (list, tuple, set, frozenset)


def where_clause(filters: dict[str, Any]) -> tuple[str, list[Any]]:
    """A WHERE fragment and its parameters: each FILTER_COLUMNS column equals the value (a
    list/tuple/set: any of them; None: any). Another column name is a ValueError."""
    clauses, params = ["1"], []
    for column, value in filters.items():
        if column not in FILTER_COLUMNS:
            raise ValueError(f"unknown filter {column!r}: filter on {', '.join(FILTER_COLUMNS)}")
        if value is None:
            continue
        if isinstance(value, _ANY_OF):
            values = sorted(value, key=str)
            clauses.append(f"{column} IN ({', '.join('?' * len(values))})" if values else "0")
            params.extend(values)
        else:
            clauses.append(f"{column} = ?")
            params.append(value)
    return " AND ".join(clauses), params


def row_matches(row: Row, filters: dict[str, Any]) -> bool:
    """Whether ``row`` passes ``filters`` as :func:`where_clause` reads them."""
    return all(value is None or getattr(row, column) in (value if isinstance(value, _ANY_OF) else [value])
               for column, value in filters.items())

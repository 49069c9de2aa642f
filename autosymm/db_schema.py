"""Tuning-database schema: columns, the Row record and its validation, errors, opening a file
(read-only, hot journals), schema versions and migrations (see autosymm.db).

Kept apart from the TuningDB class so the schema and its migrations read in one place. Tables
and the view are created through sqlite-utils (``Table.create``, ``Database.create_view``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union

import sqlite_utils

from .configs import AllReduceConfig, AnyConfig, FusedConfig, MoEConfig, as_int, config_from_json, config_to_json

#: The config type of each op's rows (a row of another op's type is refused when read).
_CONFIG_OF_OP = {"all_reduce": AllReduceConfig, "dp_to_ep": MoEConfig, "ep_to_dp": MoEConfig,
                 "all_reduce_rmsnorm": FusedConfig}

if not hasattr(sqlite_utils.Database, "atomic"):  # 3.x commits an open transaction on every write
    raise ImportError("autosymm.db needs sqlite-utils >= 4.0 (nested transactions): pip install -U sqlite-utils")

SCHEMA_VERSION = 2
BUSY_TIMEOUT_S = 30.0
KEY_COLUMNS = ("hardware", "world_size", "op", "dtype", "bucket", "shape", "mode")
PK_COLUMNS = KEY_COLUMNS + ("backend",)
FILTER_COLUMNS = PK_COLUMNS + ("gpu",)
_VERSION_COLUMNS = ("autosymm_version", "torch_version", "triton_version", "cuda_version", "driver_version")
#: Where a row was measured (autosymm.hardware.provenance): the versions, and ``comm_env``, the
#: multicast/NVLS environment variables as the tune saw them (e.g. 'NCCL_NVLS_ENABLE=0 ...'),
#: which decide whether NCCL's baseline in that row could use NVLink SHARP.
PROVENANCE_COLUMNS = _VERSION_COLUMNS + ("comm_env",)

#: The results table, in on-disk column order (sqlite-utils types: str TEXT, int INTEGER, float REAL).
RESULTS_COLUMNS: dict[str, type] = {
    "hardware": str, "gpu": str, "world_size": int, "op": str, "dtype": str, "bucket": int, "shape": str,
    "mode": str, "backend": str, "config": str, "median_us": float, "p10_us": float, "p90_us": float,
    "nccl_us": float, "speedup": float, "trials": int, "autosymm_version": str, "torch_version": str,
    "triton_version": str, "cuda_version": str, "driver_version": str, "created": str, "comm_env": str,
}
RESULTS_NOT_NULL = PK_COLUMNS + ("gpu", "config", "median_us", "created")
RESULTS_DEFAULTS = {"gpu": "", "shape": "", "config": "{}"}
#: The ``winners`` view: results' fastest row per key (ties: backend name).
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
    """What a lookup is keyed on: ``best(key)``, ``ranked(key)``."""

    hardware: str
    world_size: int
    op: str
    dtype: str
    bucket: int
    shape: str = ""
    mode: str = "eager"

    @classmethod
    def for_problem(cls, hardware: str, problem: Any, mode: str = "eager") -> "Key":
        """The key of an autosymm.problem.Problem on ``hardware`` in ``mode``."""
        return cls(hardware, problem.world_size, problem.op, problem.dtype, problem.bucket,
                   problem.shape_key, mode)


class MergeCounts(NamedTuple):
    """What a merge did with the source's rows (:meth:`autosymm.db.TuningDB.merge_from`)."""

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
        for name in ("p10_us", "p90_us", "nccl_us", "speedup"):
            put(name, _opt(_positive, name, getattr(self, name)))
        if self.speedup is None and self.nccl_us is not None:
            put("speedup", self.nccl_us / self.median_us)
        for name in PROVENANCE_COLUMNS:
            value = getattr(self, name)
            put(name, None if value is None else str(value))
        if self.config is None or isinstance(self.config, (AllReduceConfig, MoEConfig, FusedConfig)):
            put("config", config_to_json(self.config))
        if not isinstance(self.config, str) or not self.config.strip():
            raise ValueError(f"Row.config={self.config!r} must be a config's JSON text ('{{}}' for none)")
        try:
            put("_config_obj", config_from_json(self.config))  # parsed once: validated and cached
        except ValueError as exc:
            raise ValueError(f"Row.config: {exc}") from None
        kind = _CONFIG_OF_OP.get(self.op)
        if self._config_obj is not None and kind is not None and not isinstance(self._config_obj, kind):
            raise ValueError(f"Row.config: config type {type(self._config_obj).__name__} does not belong to op "
                             f"{self.op!r} (its rows hold {kind.__name__})")

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


# -------------------------------------------------------------------- opening, versions, migrations


def _is_hot_journal(path: Path, exc: sqlite3.DatabaseError) -> bool:
    """Whether ``exc``, from a read-only read of ``path``, is SQLite refusing a hot journal."""
    name = getattr(exc, "sqlite_errorname", None)  # Python >= 3.11
    return name == "SQLITE_READONLY_ROLLBACK" if name else Path(f"{path}-journal").exists()


def _roll_back_hot_journal(path: Path, timeout_s: float) -> None:
    """Let SQLite roll back the journal a killed writer left next to ``path``: open it once
    read-write (a read does it). Without write access, a CorruptDatabaseError says what to do."""
    journal = Path(f"{path}-journal")
    advice = (f"{path} has a hot journal {journal} left by a writer that stopped mid-write: open the "
              f"database once with write access (e.g. `sqlite3 {path} 'PRAGMA quick_check'` as its owner) "
              f"so SQLite rolls the unfinished write back; do not delete the journal (the file would "
              f"keep half-written pages)")
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        raise CorruptDatabaseError(advice)
    try:
        with contextlib.closing(sqlite3.connect(str(path), timeout=timeout_s)) as conn:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.Error as exc:
        raise CorruptDatabaseError(f"{advice} ({exc})") from exc


def connect(path: Optional[Path], readonly: bool, timeout_s: float) -> sqlite3.Connection:
    """A connection to ``path`` (None: in memory), waiting up to ``timeout_s`` seconds for locks.

    Writable: parent folders are created. ``readonly``: SQLite's ``mode=ro``, the file must
    exist; a hot journal is rolled back first where the file is writable (else explained).
    """
    if path is None:
        return sqlite3.connect(":memory:")
    if not readonly:
        path.parent.mkdir(parents=True, exist_ok=True)
        return sqlite3.connect(str(path), timeout=timeout_s)
    if not path.is_file():
        raise FileNotFoundError(f"tuning database {path} does not exist")
    uri = path.resolve().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, timeout=timeout_s)
    try:
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # a hot journal shows here
    except sqlite3.DatabaseError as exc:
        if _is_hot_journal(path, exc):
            conn.close()
            _roll_back_hot_journal(path, timeout_s)
            return sqlite3.connect(uri, uri=True, timeout=timeout_s)
    return conn  # any other error: the schema check reports it


def read_schema_version(db: sqlite_utils.Database, where: str) -> Optional[int]:
    """The schema version stored in ``db`` (``where``: its file, for messages); None when empty.

    A newer version raises DatabaseVersionError (never misread); a file that is not SQLite or
    not a tuning database raises CorruptDatabaseError; a locked file raises sqlite3's error.
    """
    try:
        tables = {t for t in db.table_names() if not t.startswith("sqlite_")}
        if "meta" in tables:
            found = next(db["meta"].rows_where("key = ?", ["schema_version"], select="value"), None)
            try:
                version = int(found["value"])
            except (TypeError, ValueError):
                raise CorruptDatabaseError(f"{where}: meta has no valid schema_version ({found!r})") from None
        elif not tables:
            return None
        elif "results" in tables and V0_COLUMNS <= set(db["results"].columns_dict):
            version = 0
        else:
            raise CorruptDatabaseError(f"{where} is not an autosymm tuning database (tables: {sorted(tables)})")
    except sqlite3.OperationalError:  # locked, cannot open: not a statement about the file
        raise
    except sqlite3.DatabaseError as exc:
        raise CorruptDatabaseError(f"{where} is not a readable SQLite database ({exc})") from exc
    if version > SCHEMA_VERSION:
        raise DatabaseVersionError(
            f"{where} has tuning-database schema version {version}, newer than version "
            f"{SCHEMA_VERSION} that this autosymm reads: upgrade autosymm to use it")
    return version


def _create_meta_and_winners(db: sqlite_utils.Database) -> None:
    db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
    db.create_view("winners", WINNERS_SQL, ignore=True)


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the current schema's tables and view in an empty database."""
    db["results"].create(RESULTS_COLUMNS, pk=PK_COLUMNS, not_null=RESULTS_NOT_NULL, defaults=RESULTS_DEFAULTS)
    _create_meta_and_winners(db)


def _migrate_0_to_1(db: sqlite_utils.Database) -> None:
    """Version 0 (pre-release) had no meta table, no winners view, no p10_us/p90_us/trials."""
    results = db.table("results")
    for column in ("p10_us", "p90_us", "trials"):
        if column not in results.columns_dict:
            results.add_column(column, RESULTS_COLUMNS[column])
    _create_meta_and_winners(db)


def _migrate_1_to_2(db: sqlite_utils.Database) -> None:
    """Version 1 had no ``comm_env`` (its rows read it as NULL: environment not recorded)."""
    if "results" not in db.table_names():
        raise CorruptDatabaseError("a version-1 tuning database without its results table")
    results = db.table("results")
    if "comm_env" not in results.columns_dict:
        results.add_column("comm_env", RESULTS_COLUMNS["comm_env"])


#: MIGRATIONS[n] turns a version-n database into version n + 1 (inside one transaction).
MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_migrate_0_to_1, _migrate_1_to_2]
assert len(MIGRATIONS) == SCHEMA_VERSION

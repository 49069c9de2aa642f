"""Tuning-database schema: columns, DDL, the Row record, errors and migrations (see autosymm.db).

Kept apart from the TuningDB class so the schema and its migrations read in one place.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, NamedTuple, Optional, Union

import sqlite_utils

from .configs import AnyConfig, config_from_json, config_to_json

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
KEY_COLUMNS = ("hardware", "world_size", "op", "dtype", "bucket", "shape", "mode")
PK_COLUMNS = KEY_COLUMNS + ("backend",)
FILTER_COLUMNS = PK_COLUMNS + ("gpu",)
_VERSION_COLUMNS = ("autosymm_version", "torch_version", "triton_version", "cuda_version", "driver_version")

RESULTS_DDL = """CREATE TABLE IF NOT EXISTS results (
  hardware TEXT NOT NULL, gpu TEXT NOT NULL DEFAULT '', world_size INTEGER NOT NULL,
  op TEXT NOT NULL, dtype TEXT NOT NULL, bucket INTEGER NOT NULL, shape TEXT NOT NULL DEFAULT '',
  mode TEXT NOT NULL, backend TEXT NOT NULL, config TEXT NOT NULL DEFAULT '{}',
  median_us REAL NOT NULL, p10_us REAL, p90_us REAL, nccl_us REAL, speedup REAL, trials INTEGER,
  autosymm_version TEXT, torch_version TEXT, triton_version TEXT, cuda_version TEXT,
  driver_version TEXT, created TEXT NOT NULL,
  PRIMARY KEY (hardware, world_size, op, dtype, bucket, shape, mode, backend))"""
META_DDL = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)"
WINNERS_DDL = f"""CREATE VIEW IF NOT EXISTS winners AS SELECT * FROM (
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
    """The file is not SQLite, not an autosymm tuning database, or holds unreadable rows."""


class ReadOnlyDatabaseError(TuningDBError):
    """A write to a database opened with ``readonly=True``."""


class Key(NamedTuple):
    """What a lookup is keyed on: ``best(*key)``, ``ranked(*key)``."""

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


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _opt(convert: Callable[[Any], Any], value: Any) -> Any:
    return None if value is None else convert(value)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One measured (key, backend): its best config and times in microseconds, with provenance.

    ``config`` is the JSON text of the launch config; a config object (or None) given instead
    is serialised. ``speedup`` defaults to ``nccl_us / median_us`` when NCCL was measured.
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

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # the dataclass is frozen
            object.__setattr__(self, name, value)

        for name in ("hardware", "op", "dtype", "mode", "backend", "created", "shape", "gpu"):
            value = getattr(self, name)
            if not isinstance(value, str) or not (value or name in ("shape", "gpu")):
                raise ValueError(f"Row.{name}={value!r} must be a string (non-empty but for shape, gpu)")
        for name in ("world_size", "bucket"):  # operator.index: ints (numpy's too), never floats
            put(name, operator.index(getattr(self, name)))
            if getattr(self, name) < 1:
                raise ValueError(f"Row.{name}={getattr(self, name)} must be >= 1")
        put("trials", _opt(operator.index, self.trials))
        put("median_us", float(self.median_us))
        if not (math.isfinite(self.median_us) and self.median_us > 0):
            raise ValueError(f"Row.median_us={self.median_us!r} must be a finite time > 0 (microseconds)")
        for name in ("p10_us", "p90_us", "nccl_us", "speedup"):
            put(name, _opt(float, getattr(self, name)))
        if self.speedup is None and self.nccl_us is not None:
            put("speedup", self.nccl_us / self.median_us)
        for name in _VERSION_COLUMNS:
            put(name, _opt(str, getattr(self, name)))
        if not isinstance(self.config, str):
            put("config", config_to_json(self.config))
        try:
            is_object = isinstance(json.loads(self.config), dict)
        except ValueError:
            is_object = False
        if not is_object:
            raise ValueError(f"Row.config={self.config!r} is not a JSON object")

    @property
    def key(self) -> Key:
        return Key(*(getattr(self, c) for c in KEY_COLUMNS))

    @property
    def pk(self) -> tuple:
        """The primary key: ``key`` plus ``backend``."""
        return tuple(getattr(self, c) for c in PK_COLUMNS)

    @property
    def config_obj(self) -> Optional[AnyConfig]:
        """The config as an AllReduceConfig / MoEConfig (None for config-less backends)."""
        return config_from_json(self.config)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Row":
        """A Row from a mapping; keys that are not fields (extra columns) are ignored."""
        return cls(**{k: v for k, v in data.items() if k in ROW_FIELDS and v is not None})


ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Row))
UPSERT_SQL = (
    f"INSERT INTO results ({', '.join(ROW_FIELDS)}) VALUES ({', '.join(':' + f for f in ROW_FIELDS)}) "
    f"ON CONFLICT ({', '.join(PK_COLUMNS)}) DO UPDATE SET "
    + ", ".join(f"{f} = excluded.{f}" for f in ROW_FIELDS if f not in PK_COLUMNS)
)


def _migrate_0_to_1(db: sqlite_utils.Database) -> None:
    """Version 0 (pre-release) had no meta table, no winners view, no p10_us/p90_us/trials."""
    have = {r[1] for r in db.execute("PRAGMA table_info(results)").fetchall()}
    for column, sql_type in (("p10_us", "REAL"), ("p90_us", "REAL"), ("trials", "INTEGER")):
        if column not in have:
            db.execute(f"ALTER TABLE results ADD COLUMN {column} {sql_type}")
    db.execute(META_DDL)
    db.execute(WINNERS_DDL)


#: MIGRATIONS[n] turns a version-n database into version n + 1 (inside one transaction).
MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_migrate_0_to_1]
assert len(MIGRATIONS) == SCHEMA_VERSION

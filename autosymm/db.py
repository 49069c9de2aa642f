"""The tuning database: measured winners in one SQLite file, read by the dispatcher.

Schema version 1 (open any file with the ``sqlite3`` CLI)::

    CREATE TABLE results (          -- one row per key and backend: that backend's best config
      hardware TEXT NOT NULL,       -- hardware slug, e.g. 'nvidia-h200-nvlink'
      gpu TEXT NOT NULL DEFAULT '', -- GPU name (descriptive, not part of the key)
      world_size INTEGER NOT NULL,
      op TEXT NOT NULL,             -- 'all_reduce' | 'dp_to_ep' | 'ep_to_dp'
      dtype TEXT NOT NULL,          -- 'bf16' | 'fp16' | 'fp32'
      bucket INTEGER NOT NULL,      -- all_reduce: bytes (power of two); MoE: tokens per rank
      shape TEXT NOT NULL DEFAULT '',  -- '' for all_reduce; MoEShape.key ('d7168_e256_k8') for MoE
      mode TEXT NOT NULL,           -- 'eager' | 'graph' (CUDA-graph replay)
      backend TEXT NOT NULL,        -- backend name, e.g. 'nccl'
      config TEXT NOT NULL,         -- launch config as JSON (configs.config_to_json), '{}' if none
      median_us REAL NOT NULL,      -- median time of one call, microseconds (max over ranks)
      p10_us REAL, p90_us REAL,     -- 10th / 90th percentile, microseconds
      nccl_us REAL,                 -- NCCL measured in the same run (NULL if not measured)
      speedup REAL,                 -- nccl_us / median_us
      trials INTEGER,               -- configs the search evaluated for this backend (failed too)
      autosymm_version TEXT, torch_version TEXT, triton_version TEXT,
      cuda_version TEXT, driver_version TEXT,
      created TEXT NOT NULL,        -- ISO 8601 date-time, UTC
      PRIMARY KEY (hardware, world_size, op, dtype, bucket, shape, mode, backend));
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);  -- 'schema_version' and notes
    CREATE VIEW winners AS ...      -- results' fastest row per key (ties: backend name)

For example::

    sqlite3 ~/.cache/autosymm/tuning.sqlite "SELECT world_size, bucket, backend, median_us,
      speedup FROM winners WHERE op = 'all_reduce' AND dtype = 'bf16' ORDER BY 1, 2"

A database is data: values are always bound parameters, no pickle or eval, unknown extra
columns are ignored. An older schema is migrated in one transaction (in memory when opened
read-only); a newer one raises :class:`DatabaseVersionError`; a file that is not a tuning
database raises :class:`CorruptDatabaseError`. Writers take ``BEGIN IMMEDIATE`` and wait up to
30 s for each other, so several tune processes can share one file. The user's database is
``$AUTOSYMM_DB`` or ``~/.cache/autosymm/tuning.sqlite`` (:func:`user_db_path`); shipped ones are
``tuning_db/<slug>.sqlite`` in the package (:func:`shipped_db_paths`), opened read-only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import operator
import os
import re
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Union

import sqlite_utils

from .configs import AnyConfig, config_from_json, config_to_json

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
KEY_COLUMNS = ("hardware", "world_size", "op", "dtype", "bucket", "shape", "mode")
PK_COLUMNS = KEY_COLUMNS + ("backend",)
FILTER_COLUMNS = PK_COLUMNS + ("gpu",)
_VERSION_COLUMNS = ("autosymm_version", "torch_version", "triton_version", "cuda_version", "driver_version")

_RESULTS_DDL = """CREATE TABLE IF NOT EXISTS results (
  hardware TEXT NOT NULL, gpu TEXT NOT NULL DEFAULT '', world_size INTEGER NOT NULL,
  op TEXT NOT NULL, dtype TEXT NOT NULL, bucket INTEGER NOT NULL, shape TEXT NOT NULL DEFAULT '',
  mode TEXT NOT NULL, backend TEXT NOT NULL, config TEXT NOT NULL DEFAULT '{}',
  median_us REAL NOT NULL, p10_us REAL, p90_us REAL, nccl_us REAL, speedup REAL, trials INTEGER,
  autosymm_version TEXT, torch_version TEXT, triton_version TEXT, cuda_version TEXT,
  driver_version TEXT, created TEXT NOT NULL,
  PRIMARY KEY (hardware, world_size, op, dtype, bucket, shape, mode, backend))"""
_META_DDL = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)"
_WINNERS_DDL = f"""CREATE VIEW IF NOT EXISTS winners AS SELECT * FROM (
  SELECT results.*, ROW_NUMBER() OVER (PARTITION BY {', '.join(KEY_COLUMNS)}
                                       ORDER BY median_us, backend) AS place
  FROM results) WHERE place = 1"""
_ORDER = "hardware, world_size, op, dtype, shape, mode, bucket, median_us, backend"
#: Columns a version-0 database (pre-release: no meta table) must have to be recognised.
_V0_COLUMNS = frozenset(PK_COLUMNS + ("config", "median_us", "created"))


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
        return cls(**{k: v for k, v in data.items() if k in _FIELDS and v is not None})


_FIELDS = tuple(f.name for f in dataclasses.fields(Row))
_UPSERT_SQL = (
    f"INSERT INTO results ({', '.join(_FIELDS)}) VALUES ({', '.join(':' + f for f in _FIELDS)}) "
    f"ON CONFLICT ({', '.join(PK_COLUMNS)}) DO UPDATE SET "
    + ", ".join(f"{f} = excluded.{f}" for f in _FIELDS if f not in PK_COLUMNS)
)


def _migrate_0_to_1(db: sqlite_utils.Database) -> None:
    """Version 0 (pre-release) had no meta table, no winners view, no p10_us/p90_us/trials."""
    have = {r[1] for r in db.execute("PRAGMA table_info(results)").fetchall()}
    for column, sql_type in (("p10_us", "REAL"), ("p90_us", "REAL"), ("trials", "INTEGER")):
        if column not in have:
            db.execute(f"ALTER TABLE results ADD COLUMN {column} {sql_type}")
    db.execute(_META_DDL)
    db.execute(_WINNERS_DDL)


#: MIGRATIONS[n] turns a version-n database into version n + 1 (inside one transaction).
MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_migrate_0_to_1]
assert len(MIGRATIONS) == SCHEMA_VERSION


class TuningDB:
    """The tuning database at ``path`` (created with its parent folders if missing),
    ``':memory:'``, or an open ``sqlite_utils.Database``.

    ``readonly=True`` opens the file with SQLite's ``mode=ro`` (shipped databases are never
    written; an older schema is migrated in an in-memory copy).
    """

    def __init__(self, path: Union[str, os.PathLike, sqlite_utils.Database] = ":memory:", *,
                 readonly: bool = False, timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.readonly, self.path = readonly, None
        self._owns_connection = not isinstance(path, sqlite_utils.Database)
        if isinstance(path, sqlite_utils.Database):
            self.db = path
            self.db.conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        else:
            if str(path) != ":memory:":
                self.path = Path(path).expanduser()
            conn = self._connect(self.path, readonly, timeout_s)
            try:
                self.db = sqlite_utils.Database(conn)
            except BaseException:
                conn.close()
                raise
        try:
            self._open_schema()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _connect(path: Optional[Path], readonly: bool, timeout_s: float) -> sqlite3.Connection:
        if path is None:
            return sqlite3.connect(":memory:")
        if readonly:
            if not path.is_file():
                raise FileNotFoundError(f"tuning database {path} does not exist")
            return sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=timeout_s)
        path.parent.mkdir(parents=True, exist_ok=True)
        return sqlite3.connect(str(path), timeout=timeout_s)

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path or ':memory:')!r}, readonly={self.readonly})"

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_connection:
            self.db.conn.close()

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM results").fetchone()[0]

    # ---------------------------------------------------------------- schema and transactions

    @property
    def _where(self) -> str:
        return str(self.path or ":memory:")

    def _stored_version(self) -> Optional[int]:
        """The schema version in the file; None for an empty database."""
        try:
            tables = {t for t in self.db.table_names() if not t.startswith("sqlite_")}
            if "meta" in tables:
                found = self.db.execute("SELECT value FROM meta WHERE key = ?", ["schema_version"]).fetchone()
                try:
                    return int(found[0])
                except (TypeError, ValueError):
                    raise CorruptDatabaseError(f"{self._where}: meta has no valid schema_version ({found!r})") from None
            if not tables:
                return None
            if "results" in tables and _V0_COLUMNS <= self._columns():
                return 0
        except sqlite3.OperationalError:  # locked, cannot open: not a statement about the file
            raise
        except sqlite3.DatabaseError as exc:
            raise CorruptDatabaseError(f"{self._where} is not a readable SQLite database ({exc})") from exc
        raise CorruptDatabaseError(f"{self._where} is not an autosymm tuning database (tables: {sorted(tables)})")

    def _columns(self) -> set[str]:
        return {r[1] for r in self.db.execute("PRAGMA table_info(results)").fetchall()}

    def _readable_version(self) -> Optional[int]:
        """The stored schema version, refused (never misread) when newer than this code's."""
        version = self._stored_version()
        if version is not None and version > SCHEMA_VERSION:
            raise DatabaseVersionError(
                f"{self._where} has tuning-database schema version {version}, newer than version "
                f"{SCHEMA_VERSION} that this autosymm reads: upgrade autosymm to use it")
        return version

    def _open_schema(self) -> None:
        version = self._readable_version()
        if version != SCHEMA_VERSION:
            if self.readonly:
                if version is None:
                    raise CorruptDatabaseError(f"{self._where} is empty, not an autosymm tuning database")
                memory = sqlite3.connect(":memory:")  # migrate a copy: the file is never written
                self.db.conn.backup(memory)
                self.close()
                self.db, self._owns_connection = sqlite_utils.Database(memory), True
            with self._transaction():  # re-read under the write lock: another process may be first
                version = self._readable_version()
                if version is None:
                    for ddl in (_RESULTS_DDL, _META_DDL, _WINNERS_DDL):
                        self.db.execute(ddl)
                    version = SCHEMA_VERSION
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](self.db)
                self._put_meta("schema_version", str(SCHEMA_VERSION))
        missing = set(_FIELDS) - self._columns()
        if missing:
            raise CorruptDatabaseError(f"{self._where}: table results lacks columns {sorted(missing)}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction; BEGIN IMMEDIATE takes the write lock up front (no deadlock)."""
        conn = self.db.conn
        if conn.in_transaction:  # inside a caller's transaction: nest
            conn.execute("SAVEPOINT autosymm_db")
            try:
                yield
            except BaseException:
                conn.execute("ROLLBACK TO autosymm_db")
                conn.execute("RELEASE autosymm_db")
                raise
            conn.execute("RELEASE autosymm_db")
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _require_writable(self) -> None:
        if self.readonly:
            raise ReadOnlyDatabaseError(f"{self._where} was opened read-only")

    def _put_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                        "ON CONFLICT (key) DO UPDATE SET value = excluded.value", [key, value])

    @property
    def schema_version(self) -> int:
        return int(self.meta()["schema_version"])

    def meta(self) -> dict[str, str]:
        """The meta table as a dict."""
        return {r["key"]: r["value"] for r in self.db.query("SELECT key, value FROM meta")}

    def set_meta(self, key: str, value: str) -> None:
        """Store a note in the meta table ('schema_version' is reserved)."""
        self._require_writable()
        if key == "schema_version":
            raise ValueError("meta key 'schema_version' is managed by autosymm.db")
        with self._transaction():
            self._put_meta(str(key), str(value))

    # ---------------------------------------------------------------- writing

    def record(self, row: Row) -> None:
        """Insert ``row``, replacing the row of the same key and backend."""
        self.record_many([row])

    def record_many(self, rows: Iterable[Row]) -> int:
        """Insert or replace ``rows`` in one transaction; returns how many."""
        self._require_writable()
        rows = list(rows)
        for row in rows:
            row.config_obj  # a config this autosymm cannot read back never enters the DB
        with self._transaction():
            self.db.conn.executemany(_UPSERT_SQL, [row.to_dict() for row in rows])
        return len(rows)

    def merge_from(self, other: Union["TuningDB", str, os.PathLike]) -> tuple[int, int, int]:
        """Merge ``other`` (a TuningDB or a path) in: per key and backend the faster row wins.

        Returns (inserted, replaced, kept): rows new here, rows ``other`` improved, rows where
        this database's row was at least as fast. Rows of other keys are never touched.
        """
        self._require_writable()
        if isinstance(other, TuningDB):
            incoming = other.rows()
        else:
            with TuningDB(other, readonly=True) as source:
                incoming = source.rows()
        inserted = replaced = kept = 0
        where = " AND ".join(f"{c} = ?" for c in PK_COLUMNS)
        with self._transaction():
            for row in incoming:
                found = self.db.conn.execute(f"SELECT median_us FROM results WHERE {where}", row.pk).fetchone()
                if found is not None and found[0] <= row.median_us:
                    kept += 1
                    continue
                self.db.conn.execute(_UPSERT_SQL, row.to_dict())
                inserted, replaced = (inserted + 1, replaced) if found is None else (inserted, replaced + 1)
        return inserted, replaced, kept

    def export(self, path: Union[str, os.PathLike], *, overwrite: bool = False, **filters: Any) -> int:
        """Write the rows matching ``filters`` (see :meth:`rows`) to a new database file.

        The file is written aside and renamed into place; an existing file is an error unless
        ``overwrite``. Returns the number of rows written.
        """
        path = Path(path).expanduser()
        if self.path is not None and path.resolve() == self.path.resolve():
            raise ValueError(f"cannot export {self.path} onto itself")
        if path.exists() and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        rows = self.rows(**filters)
        notes = {k: v for k, v in self.meta().items() if k != "schema_version"}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            with TuningDB(tmp) as out, out._transaction():
                out.db.conn.executemany(_UPSERT_SQL, [row.to_dict() for row in rows])
                for key, value in notes.items():
                    out._put_meta(key, value)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return len(rows)

    # ---------------------------------------------------------------- reading

    def _read(self, sql: str, params: Iterable[Any] = ()) -> list[Row]:
        rows = []
        for data in self.db.query(sql, list(params)):
            try:
                rows.append(Row.from_dict(data))
            except (TypeError, ValueError) as exc:
                key = tuple(data.get(c) for c in PK_COLUMNS)
                raise CorruptDatabaseError(f"{self._where}: unreadable row {key}: {exc}") from exc
        return rows

    @staticmethod
    def _filter(filters: dict[str, Any]) -> tuple[str, list[Any]]:
        clauses, params = ["1"], []
        for column, value in filters.items():
            if column not in FILTER_COLUMNS:
                raise ValueError(f"unknown filter {column!r}: filter on {', '.join(FILTER_COLUMNS)}")
            if value is None:
                continue
            if isinstance(value, (list, tuple, set, frozenset)):
                values = sorted(value, key=str)
                clauses.append(f"{column} IN ({', '.join('?' * len(values))})" if values else "0")
                params.extend(values)
            else:
                clauses.append(f"{column} = ?")
                params.append(value)
        return " AND ".join(clauses), params

    def rows(self, **filters: Any) -> list[Row]:
        """Rows whose columns equal the given values (a list/tuple/set: any of them; None: any).

        Filter columns: the key columns, ``backend`` and ``gpu``; another name is a ValueError.
        """
        where, params = self._filter(filters)
        return self._read(f"SELECT * FROM results WHERE {where} ORDER BY {_ORDER}", params)

    def winners(self, **filters: Any) -> list[Row]:
        """The fastest row of each key (the ``winners`` view), filtered like :meth:`rows`."""
        where, params = self._filter(filters)
        return self._read(f"SELECT * FROM winners WHERE {where} ORDER BY {_ORDER}", params)

    def ranked(self, hardware: str, world_size: int, op: str, dtype: str, bucket: int, shape: str = "",
               mode: str = "eager", exclude_backends: Iterable[str] = ()) -> list[Row]:
        """Every backend's row for the key, fastest first (ties: backend name)."""
        excluded = [exclude_backends] if isinstance(exclude_backends, str) else sorted(set(exclude_backends))
        params = [hardware, world_size, op, dtype, bucket, shape, mode, *excluded]
        sql = "SELECT * FROM results WHERE " + " AND ".join(f"{c} = ?" for c in KEY_COLUMNS)
        if excluded:
            sql += f" AND backend NOT IN ({', '.join('?' * len(excluded))})"
        return self._read(sql + " ORDER BY median_us, backend", params)

    def best(self, hardware: str, world_size: int, op: str, dtype: str, bucket: int, shape: str = "",
             mode: str = "eager", exclude_backends: Iterable[str] = ()) -> Optional[Row]:
        """The fastest row for the key (None if the key was not tuned)."""
        ranked = self.ranked(hardware, world_size, op, dtype, bucket, shape, mode, exclude_backends)
        return ranked[0] if ranked else None

    def buckets(self, hardware: str, world_size: int, op: str, dtype: str, shape: str = "",
                mode: str = "eager") -> list[int]:
        """The tuned buckets of a key without its bucket, ascending."""
        sql = ("SELECT DISTINCT bucket FROM results WHERE hardware = ? AND world_size = ? AND op = ? "
               "AND dtype = ? AND shape = ? AND mode = ? ORDER BY bucket")
        return [r[0] for r in self.db.execute(sql, [hardware, world_size, op, dtype, shape, mode]).fetchall()]

    def hardware_slugs(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT DISTINCT hardware FROM results ORDER BY hardware")]

    def digest(self, **filters: Any) -> str:
        """sha256 of the rows' key, backend, config and median: equal for equal data, whatever
        the file, insertion order or provenance (ranks compare it before trusting a lookup)."""
        entries = sorted(
            [*row.pk, json.dumps(json.loads(row.config), sort_keys=True), row.median_us.hex()]
            for row in self.rows(**filters))
        return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


# -------------------------------------------------------------------- locating databases

_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def user_db_path() -> Path:
    """$AUTOSYMM_DB, else ($XDG_CACHE_HOME or ~/.cache)/autosymm/tuning.sqlite."""
    if os.environ.get("AUTOSYMM_DB"):
        return Path(os.environ["AUTOSYMM_DB"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "autosymm" / "tuning.sqlite"


def shipped_db_dir() -> Optional[Path]:
    """The installed package data ``autosymm.tuning_db``, else <repo>/tuning_db (a checkout)."""
    try:
        from importlib.resources import files

        installed = Path(str(files("autosymm.tuning_db")))
        if installed.is_dir():
            return installed
    except (ImportError, OSError, TypeError, ValueError):
        pass
    checkout = Path(__file__).resolve().parent.parent / "tuning_db"
    return checkout if checkout.is_dir() else None


def shipped_db_paths() -> list[Path]:
    """The shipped databases (``*.sqlite``), sorted by name."""
    folder = shipped_db_dir()
    return sorted(folder.glob("*.sqlite")) if folder is not None else []


def shipped_db_for(slug: str) -> Optional[Path]:
    """The shipped database ``<slug>.sqlite``, or None if there is none."""
    if not _SLUG.fullmatch(slug):
        raise ValueError(f"{slug!r} is not a hardware slug (letters, digits, '.', '_', '-')")
    folder = shipped_db_dir()
    path = folder / f"{slug}.sqlite" if folder is not None else None
    return path if path is not None and path.is_file() else None

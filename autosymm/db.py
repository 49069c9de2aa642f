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
import hashlib
import json
import os
import re
import sqlite3
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

import sqlite_utils

from .db_schema import (  # the schema's public names are re-exported (__all__)
    BUSY_TIMEOUT_S,
    FILTER_COLUMNS,
    KEY_COLUMNS,
    MIGRATIONS,
    PK_COLUMNS,
    SCHEMA_VERSION,
    CorruptDatabaseError,
    DatabaseVersionError,
    Key,
    ReadOnlyDatabaseError,
    Row,
    TuningDBError,
    ROW_FIELDS,
    META_DDL,
    ROW_ORDER,
    RESULTS_DDL,
    UPSERT_SQL,
    V0_COLUMNS,
    WINNERS_DDL,
)



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
            if "results" in tables and V0_COLUMNS <= self._columns():
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
                    for ddl in (RESULTS_DDL, META_DDL, WINNERS_DDL):
                        self.db.execute(ddl)
                    version = SCHEMA_VERSION
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](self.db)
                self._put_meta("schema_version", str(SCHEMA_VERSION))
        missing = set(ROW_FIELDS) - self._columns()
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
            self.db.conn.executemany(UPSERT_SQL, [row.to_dict() for row in rows])
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
                self.db.conn.execute(UPSERT_SQL, row.to_dict())
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
                out.db.conn.executemany(UPSERT_SQL, [row.to_dict() for row in rows])
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
        return self._read(f"SELECT * FROM results WHERE {where} ORDER BY {ROW_ORDER}", params)

    def winners(self, **filters: Any) -> list[Row]:
        """The fastest row of each key (the ``winners`` view), filtered like :meth:`rows`."""
        where, params = self._filter(filters)
        return self._read(f"SELECT * FROM winners WHERE {where} ORDER BY {ROW_ORDER}", params)

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


__all__ = [
    "BUSY_TIMEOUT_S", "FILTER_COLUMNS", "KEY_COLUMNS", "MIGRATIONS", "PK_COLUMNS", "SCHEMA_VERSION",
    "CorruptDatabaseError", "DatabaseVersionError", "Key", "ReadOnlyDatabaseError", "Row", "TuningDB",
    "TuningDBError", "shipped_db_dir", "shipped_db_for", "shipped_db_paths", "user_db_path",
]

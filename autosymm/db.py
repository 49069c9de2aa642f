"""The tuning database: measured winners in one SQLite file, read by the dispatcher.

Schema version 2 (open any file with the ``sqlite3`` CLI)::

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
      comm_env TEXT,                -- multicast/NVLS variables as the tune saw them (NULL: not recorded)
      PRIMARY KEY (hardware, world_size, op, dtype, bucket, shape, mode, backend));
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);  -- 'schema_version' and notes
    CREATE VIEW winners AS ...      -- results' fastest row per key (ties: backend name)

For example::

    sqlite3 ~/.cache/autosymm/tuning.sqlite "SELECT world_size, bucket, backend, median_us,
      speedup FROM winners WHERE op = 'all_reduce' AND dtype = 'bf16' ORDER BY 1, 2"

A database is data: values are always bound parameters, no pickle or eval, unknown extra
columns are ignored; a row that does not validate (config included) is skipped by every read,
digest and merge, with one :class:`BadRowWarning` per file and key. An older schema is migrated
in one transaction (in memory when opened read-only; a hot journal is rolled back first where
the file is writable); a newer one raises :class:`DatabaseVersionError`; a file that is not a
tuning database raises :class:`CorruptDatabaseError`. Writers take ``BEGIN IMMEDIATE`` and wait
up to 30 s for each other, so several tune processes can share one file. The user's database is
``$AUTOSYMM_DB`` or ``~/.cache/autosymm/tuning.sqlite`` (:func:`user_db_path`); shipped ones are
``tuning_db/<slug>.sqlite`` in the package (:func:`shipped_db_paths`), opened read-only.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import sqlite3
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import sqlite_utils

from . import settings
from .db_schema import (  # the schema's public names are re-exported (__all__)
    BUSY_TIMEOUT_S, FILTER_COLUMNS, KEY_COLUMNS, MIGRATIONS, PK_COLUMNS, ROW_FIELDS, ROW_ORDER, SCHEMA_VERSION,
    BadRowWarning, CorruptDatabaseError, DatabaseVersionError, Key, MergeCounts, ReadOnlyDatabaseError, Row,
    TuningDBError, connect, create_schema, read_schema_version, row_matches, version_mismatch, where_clause,
)

#: Bad rows already warned about, per database file (a row is named once per process).
_WARNED: dict[str, set[tuple]] = {}


class TuningDB:
    """The tuning database at ``path`` (created with its parent folders if missing),
    ``':memory:'``, or an open ``sqlite_utils.Database``.

    ``readonly=True`` opens the file with SQLite's ``mode=ro`` (shipped databases are never
    written; an older schema is migrated in an in-memory copy).
    """

    def __init__(self, path: Union[str, os.PathLike, sqlite_utils.Database] = ":memory:", *,
                 readonly: bool = False, timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.readonly, self.path, self._where = readonly, None, ":memory:"  # _where: for messages
        self._owns_connection = not isinstance(path, sqlite_utils.Database)
        if isinstance(path, sqlite_utils.Database):
            self.db = path
            self.db.conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        else:
            if str(path) != ":memory:":
                self.path = Path(path).expanduser()
                self._where = str(self.path)
            conn = connect(self.path, readonly, timeout_s)
            try:
                self.db = sqlite_utils.Database(conn)
            except BaseException:
                conn.close()
                raise
        self._warned = _WARNED.setdefault(str(self.path), set()) if self.path else set()
        try:
            self._open_schema()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"TuningDB({self._where!r}, readonly={self.readonly})"

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_connection:
            self.db.conn.close()

    def __len__(self) -> int:
        """Stored rows, valid or not."""
        return self._results.count

    # ---------------------------------------------------------------- schema and transactions

    @property
    def _results(self) -> sqlite_utils.db.Table:
        return self.db.table("results")

    def _open_schema(self) -> None:
        version = read_schema_version(self.db, self._where)
        if version != SCHEMA_VERSION:
            if self.readonly:
                if version is None:
                    raise CorruptDatabaseError(f"{self._where} is empty, not an autosymm tuning database")
                memory = sqlite3.connect(":memory:")  # migrate a copy: the file is never written
                self.db.conn.backup(memory)
                self.close()
                self.db, self._owns_connection = sqlite_utils.Database(memory), True
            with self._transaction():  # re-read under the write lock: another process may be first
                version = read_schema_version(self.db, self._where)
                if version is None:
                    create_schema(self.db)
                    version = SCHEMA_VERSION
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](self.db)
                self._put_meta("schema_version", str(SCHEMA_VERSION))
        missing = set(ROW_FIELDS) - set(self._results.columns_dict)
        if missing:
            raise CorruptDatabaseError(f"{self._where}: table results lacks columns {sorted(missing)}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction; BEGIN IMMEDIATE takes the write lock up front (no deadlock)."""
        if self.db.conn.in_transaction:  # inside a caller's transaction: a savepoint
            with self.db.atomic():
                yield
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    def _require_writable(self) -> None:
        if self.readonly:
            raise ReadOnlyDatabaseError(f"{self._where} was opened read-only")

    def _put_meta(self, key: str, value: str) -> None:
        self.db.table("meta").upsert({"key": key, "value": value}, pk="key")

    @property
    def schema_version(self) -> int:
        return int(self.meta()["schema_version"])

    def meta(self) -> dict[str, str]:
        """The meta table as a dict."""
        return {r["key"]: r["value"] for r in self.db.table("meta").rows}

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
        """Insert or replace ``rows`` (validated Row objects) in one transaction; returns how many."""
        self._require_writable()
        rows = list(rows)
        with self._transaction():
            self._results.upsert_all([row.to_dict() for row in rows], pk=PK_COLUMNS)
        return len(rows)

    def merge_from(self, other: Union["TuningDB", str, os.PathLike]) -> MergeCounts:
        """Merge ``other`` (a TuningDB or a path, read in full first) in: per key and backend the
        faster row wins; bad source rows are skipped (each warned about) and counted.

        Rows of other keys are never touched; a bad row here is replaced by a valid one.
        """
        self._require_writable()
        if isinstance(other, TuningDB):
            incoming, bad = other._select(other._results)
        else:
            with TuningDB(other, readonly=True) as source:
                incoming, bad = source._select(source._results)
        return self._merge_rows(incoming, len(bad))

    def _merge_rows(self, incoming: list[Row], skipped: int) -> MergeCounts:
        with self._transaction():  # read and write under the write lock
            valid, bad = self._select(self._results)
            mine, stale = {row.pk: row.median_us for row in valid}, set(bad)
            new = [row for row in incoming if row.pk not in mine and row.pk not in stale]
            faster = [row for row in incoming if row.pk in stale or mine.get(row.pk, -1.0) > row.median_us]
            self._results.upsert_all([row.to_dict() for row in new + faster], pk=PK_COLUMNS)
        return MergeCounts(len(new), len(faster), len(incoming) - len(new) - len(faster), skipped)

    def export(self, path: Union[str, os.PathLike], *, overwrite: bool = False, **filters: Any) -> int:
        """Write the valid rows matching ``filters`` (see :meth:`rows`) to a new database file.

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
            with TuningDB(tmp) as out:
                out.record_many(rows)
                for key, value in notes.items():
                    out.set_meta(key, value)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return len(rows)

    # ---------------------------------------------------------------- reading

    def _select(self, source: sqlite_utils.db.Queryable, where: str = "1", params: Sequence[Any] = (),
                order_by: str = ROW_ORDER) -> tuple[list[Row], list[tuple]]:
        """The valid rows of table or view ``source`` matching ``where``, and the primary keys
        of the bad ones skipped (each warned about once per process)."""
        rows, bad = [], []
        for data in source.rows_where(where, list(params), order_by=order_by):
            try:
                rows.append(Row.from_dict(data))
            except ValueError as exc:
                pk = tuple(data.get(c) for c in PK_COLUMNS)
                bad.append(pk)
                if pk not in self._warned:
                    self._warned.add(pk)
                    named = ", ".join(f"{c}={v!r}" for c, v in zip(PK_COLUMNS, pk))
                    warnings.warn(f"autosymm: skipping a bad row of tuning database {self._where} "
                                  f"({named}): {exc}", BadRowWarning, stacklevel=3)
        return rows, bad

    def rows(self, **filters: Any) -> list[Row]:
        """Valid rows whose columns equal the given values (a list/tuple/set: any of them; None: any).

        Filter columns: the key columns, ``backend`` and ``gpu``; another name is a ValueError.
        """
        return self._select(self._results, *where_clause(filters))[0]

    def winners(self, **filters: Any) -> list[Row]:
        """The fastest valid row of each key (the ``winners`` view), filtered like :meth:`rows`."""
        where_clause(filters)  # checks the names
        by_key = {c: v for c, v in filters.items() if c in KEY_COLUMNS}
        winners, bad = self._select(self.db.view("winners"), *where_clause(by_key))
        if bad:  # a bad row tops its key in the view: the key's fastest valid row wins instead
            ranked = self.rows(**by_key)  # ROW_ORDER: per key, fastest first
            winners = [next(rows) for _, rows in itertools.groupby(ranked, key=lambda r: r.key)]
        others = {c: v for c, v in filters.items() if c not in KEY_COLUMNS}
        return [row for row in winners if row_matches(row, others)]

    def ranked(self, key: Key, *, exclude_backends: Iterable[str] = ()) -> list[Row]:
        """Every backend's valid row for ``key``, fastest first (ties: backend name)."""
        if not isinstance(key, Key):
            raise TypeError(f"ranked() takes an autosymm.db.Key, not {key!r}")
        excluded = [exclude_backends] if isinstance(exclude_backends, str) else sorted(set(exclude_backends))
        where, params = where_clause(key._asdict())
        if excluded:
            where += f" AND backend NOT IN ({', '.join('?' * len(excluded))})"
        return self._select(self._results, where, params + excluded, "median_us, backend")[0]

    def best(self, key: Key, *, exclude_backends: Iterable[str] = ()) -> Optional[Row]:
        """The fastest valid row for ``key`` (None if the key has none)."""
        return next(iter(self.ranked(key, exclude_backends=exclude_backends)), None)

    def buckets(self, hardware: str, world_size: int, op: str, dtype: str, shape: str = "",
                mode: str = "eager") -> list[int]:
        """The buckets of a key without its bucket that have a valid row, ascending."""
        rows = self.rows(hardware=hardware, world_size=world_size, op=op, dtype=dtype, shape=shape, mode=mode)
        return sorted({row.bucket for row in rows})

    def hardware_slugs(self) -> list[str]:
        """The hardware slugs of the valid rows, sorted."""
        return sorted({row.hardware for row in self.rows()})

    def digest(self, **filters: Any) -> str:
        """sha256 of the valid rows' key, backend, config and median: equal for equal data,
        whatever the file, insertion order, provenance or bad rows (ranks compare it before
        trusting a lookup)."""
        entries = sorted(
            [*row.pk, json.dumps(json.loads(row.config), sort_keys=True), row.median_us.hex()]
            for row in self.rows(**filters))
        return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def merge_files(sources: Sequence[Union[str, os.PathLike]], target: Union[str, os.PathLike]) -> list[MergeCounts]:
    """Merge the database files ``sources`` into ``target`` (created if absent), in order, in one
    transaction; per key and backend the faster row wins. One MergeCounts per source.

    Every source is opened and read before ``target`` is touched: an unreadable, corrupt or
    newer source raises and leaves ``target`` as it was (no new file when it did not exist).
    """
    loaded = []
    for source in sources:
        with TuningDB(source, readonly=True) as db:
            loaded.append(db._select(db._results))
    target = Path(target).expanduser()
    created = not target.exists()
    try:
        with TuningDB(target) as into, into._transaction():
            return [into._merge_rows(rows, len(bad)) for rows, bad in loaded]
    except BaseException:
        if created:
            target.unlink(missing_ok=True)
        raise


# -------------------------------------------------------------------- locating databases

_SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def user_db_path() -> Path:
    """$AUTOSYMM_DB, else ($XDG_CACHE_HOME or ~/.cache)/autosymm/tuning.sqlite."""
    path = settings.get("AUTOSYMM_DB")
    if path is not None:
        return path
    cache = settings.raw("XDG_CACHE_HOME") or Path.home() / ".cache"
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
    "BadRowWarning", "CorruptDatabaseError", "DatabaseVersionError", "Key", "MergeCounts",
    "ReadOnlyDatabaseError", "Row", "TuningDB", "TuningDBError", "merge_files", "shipped_db_dir",
    "shipped_db_for", "shipped_db_paths", "user_db_path", "version_mismatch",
]

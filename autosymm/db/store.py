"""The tuning database: measured rows in one SQLite file, written by the tuner, read by the dispatcher.

Schema version 3: table ``results`` (one row per key and backend: its best config as JSON, times
in microseconds, versions), ``meta`` (``schema_version``), the view ``winners`` (never read by
autosymm). The key (autosymm.db.schema.Key: the primary key without ``backend``) is written by the
tuner through ``Key.for_problem`` and read by the dispatcher the same way (autosymm.db.read).
A database is untrusted data: bound parameters only, no pickle or eval, unknown columns ignored; a
row that does not validate (autosymm.db.schema.checked_row) is skipped by every read with one
:class:`BadRowWarning` per file and key, and never written; every query is bounded in time; a
path is a file's name, never a URI: one that is not a regular file (or a link to one) nor free
is refused, and a write removes only what it made (autosymm.db.open). The user's database is
``$AUTOSYMM_DB`` or ``~/.cache/autosymm/tuning.sqlite`` (:func:`user_db_path`); shipped ones
``tuning_db/<slug>.sqlite`` (:func:`shipped_db_paths`), opened read-only.

Design notes: docs/DISPATCH.md#db-store
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sqlite3
import tempfile
import warnings
from importlib.resources import files
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import sqlite_utils

from .. import settings
from .open import (FILE, LOCK_WAIT_S, MISSING, Claim, DatabaseLockedError, NotADatabaseFileError, QueryTimeoutError,
                   connect, db_error, harden, make_folders, path_kind, place, read_schema_version, refusal)
from .migrations import MIGRATIONS, create_schema
from .schema import (BUSY_TIMEOUT_S, FILTER_COLUMNS, KEY_COLUMNS, PK_COLUMNS, ROW_FIELDS, ROW_ORDER, SCHEMA_VERSION,
                     BadRowWarning, CorruptDatabaseError, DatabaseVersionError, Key, MergeCounts,
                     ReadOnlyDatabaseError, Row, TuningDBError, checked_row, version_mismatch, where_clause)

#: Rows per write statement (batch): the query clock times each statement from its start
#: (autosymm.db.open.QueryClock), so a write of any size is many short statements.
WRITE_CHUNK = 2000

#: Bad rows already warned about, per database file (a row is named once per process).
_WARNED: dict[str, set[tuple]] = {}


class TuningDB:
    """The tuning database in the file ``path`` (created with its parent folders if missing; a path
    that is not a regular file, a link to one, or free is NotADatabaseFileError), in memory for
    the string ``':memory:'`` (a Path is always a file), or an open ``sqlite_utils.Database``.

    ``readonly=True`` opens the file with SQLite's ``mode=ro`` (shipped databases are never
    written; an older schema is migrated in an in-memory copy). ``timeout_s``: how long to wait
    for another process's lock (default ``LOCK_WAIT_S`` read-only, ``BUSY_TIMEOUT_S`` writable).
    """

    def __init__(self, path: Union[str, os.PathLike, sqlite_utils.Database] = ":memory:", *,
                 readonly: bool = False, timeout_s: Optional[float] = None) -> None:
        self.readonly, self.path, self.location = readonly, None, ":memory:"  # location: for messages
        self._wait_s = timeout_s if timeout_s is not None else (LOCK_WAIT_S if readonly else BUSY_TIMEOUT_S)
        self._owns_connection = not isinstance(path, sqlite_utils.Database)
        if isinstance(path, sqlite_utils.Database):
            self.db = path
            self.db.conn.execute(f"PRAGMA busy_timeout = {int(self._wait_s * 1000)}")
        else:
            if not (isinstance(path, str) and path == ":memory:"):
                self.path = Path(path).expanduser()
                self.location = str(self.path)
            conn = connect(self.path, readonly, self._wait_s)
            try:
                self.db = sqlite_utils.Database(conn)
            except BaseException:
                conn.close()
                raise
        self._clock = harden(self.db.conn)
        self._warned = _WARNED.setdefault(str(self.path), set()) if self.path else set()
        try:
            with self._guarded():
                self._open_schema()
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"TuningDB({self.location!r}, readonly={self.readonly})"

    def __enter__(self) -> "TuningDB":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_connection:
            self.db.conn.close()

    def __len__(self) -> int:
        """Stored rows, valid or not."""
        with self._guarded():
            return self._results.count

    # ---------------------------------------------------------------- schema and transactions

    @property
    def _results(self) -> sqlite_utils.db.Table:
        return self.db.table("results")

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """One operation on the file: its statements bounded in time (QUERY_LIMIT_S), a lock or
        a stopped query raised as the TuningDBError naming the file."""
        self._clock.arm()
        try:
            yield
        except sqlite3.OperationalError as exc:
            error = db_error(exc, self.location, self._wait_s, self._clock.limit_s)
            if error is exc:
                raise
            raise error from exc

    def _open_schema(self) -> None:
        version = read_schema_version(self.db, self.location)
        if version != SCHEMA_VERSION:
            if self.readonly:
                if version is None:
                    raise CorruptDatabaseError(f"{self.location} is empty, not an autosymm tuning database")
                memory = sqlite3.connect(":memory:")  # migrate a copy: the file is never written
                self.db.conn.backup(memory)
                self.close()
                self.db, self._owns_connection = sqlite_utils.Database(memory), True
                self._clock = harden(memory)
            with self._transaction():  # re-read under the write lock: another process may be first
                version = read_schema_version(self.db, self.location)
                if version is None:
                    create_schema(self.db)
                    version = SCHEMA_VERSION
                for step in range(version, SCHEMA_VERSION):
                    MIGRATIONS[step](self.db)
                self._put_meta("schema_version", str(SCHEMA_VERSION))
        missing = set(ROW_FIELDS) - set(self._results.columns_dict)
        if missing:
            raise CorruptDatabaseError(f"{self.location}: table results lacks columns {sorted(missing)}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction; BEGIN IMMEDIATE takes the write lock up front (no deadlock)."""
        if self.db.conn.in_transaction:  # inside a caller's transaction: a savepoint
            with self.db.atomic():
                yield
            return
        self.db.execute("BEGIN IMMEDIATE")
        self._clock.arm()  # the wait for the write lock is the busy timeout's, not the clock's
        try:
            yield
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    def _require_writable(self) -> None:
        if self.readonly:
            raise ReadOnlyDatabaseError(f"{self.location} was opened read-only")

    def _put_meta(self, key: str, value: str) -> None:
        self.db.table("meta").upsert({"key": key, "value": value}, pk="key")

    @property
    def schema_version(self) -> int:
        return int(self.meta()["schema_version"])

    def meta(self) -> dict[str, str]:
        """The meta table as a dict."""
        with self._guarded():
            return {r["key"]: r["value"] for r in self.db.table("meta").rows}

    def set_meta(self, key: str, value: str) -> None:
        """Store a note in the meta table ('schema_version' is reserved)."""
        self._require_writable()
        if key == "schema_version":
            raise ValueError("meta key 'schema_version' is managed by autosymm.db.store")
        with self._guarded(), self._transaction():
            self._put_meta(str(key), str(value))

    # ---------------------------------------------------------------- writing

    def record_many(self, rows: Iterable[Row]) -> int:
        """Insert or replace ``rows`` (Row objects) in one transaction, each under its key and
        backend (a row of the same key and backend is replaced); returns how many. A row the
        reads would skip (autosymm.db.schema.checked_row) is a ValueError naming it: nothing is written."""
        self._require_writable()
        rows = list(rows)
        for row in rows:
            try:
                checked_row(row)
            except ValueError as exc:
                raise ValueError(f"not recording {_named(row.pk)} in {self.location}: {exc}") from None
        with self._guarded(), self._transaction():
            self._upsert(rows)
        return len(rows)

    def _upsert(self, rows: list[Row]) -> None:
        """Upsert ``rows`` in statements of WRITE_CHUNK rows (inside the caller's transaction)."""
        for start in range(0, len(rows), WRITE_CHUNK):
            self._results.upsert_all([row.to_dict() for row in rows[start:start + WRITE_CHUNK]], pk=PK_COLUMNS,
                                     batch_size=WRITE_CHUNK)

    def _merge_rows(self, incoming: list[Row], skipped: int) -> MergeCounts:
        """Merge ``incoming`` in: per key and backend the faster row wins (a bad row here is replaced)."""
        with self._guarded(), self._transaction():  # read and write under the write lock
            valid, bad = self._select()
            mine, stale = {row.pk: row.median_us for row in valid}, set(bad)
            new = [row for row in incoming if row.pk not in mine and row.pk not in stale]
            faster = [row for row in incoming if row.pk in stale or mine.get(row.pk, -1.0) > row.median_us]
            self._upsert(new + faster)
        return MergeCounts(len(new), len(faster), len(incoming) - len(new) - len(faster), skipped)

    def export(self, path: Union[str, os.PathLike], *, overwrite: bool = False, **filters: Any) -> int:
        """Write the valid rows matching ``filters`` (see :meth:`rows`) to a new database file.

        The file is written aside (a temp file created exclusively in the target's folder) and
        put in place (autosymm.db.open.place): at a free name only while it is free; over an
        existing regular file only with ``overwrite`` (a link to one: the file it names is
        replaced, the link stays). Any other path (a folder, a FIFO, a dangling link, a link loop)
        is NotADatabaseFileError, an existing file without ``overwrite`` FileExistsError, no
        matching row a ValueError naming what the source holds: then nothing is written. Returns
        the rows written.
        """
        path = Path(path).expanduser()
        kind = path_kind(path)
        if kind not in (FILE, MISSING):
            raise refusal(path, kind)
        if kind == FILE and self.path is not None and os.path.samefile(path, self.path):
            raise ValueError(f"cannot export {self.path} onto itself")
        if kind == FILE and not overwrite:
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
        rows = self.rows(**filters)
        if not rows:
            held = sorted({(r.hardware, r.world_size) for r in self.rows()})
            holds = ", ".join(f"{hw} world size {ws}" for hw, ws in held) or "no valid row"
            asked = ", ".join(f"{k}={v!r}" for k, v in filters.items()) or "any"
            raise ValueError(f"nothing to export: {self.location} has no valid row with {asked} (it holds {holds}); "
                             f"{path} was not written")
        notes = {k: v for k, v in self.meta().items() if k != "schema_version"}
        final = Path(os.path.realpath(path)) if kind == FILE else path
        made = Claim(final, folders=make_folders(final))  # only its folders: undone on failure
        try:
            fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
            try:
                os.fchmod(fd, plain_file_mode())  # mkstemp's is 0600; an export is a file like any other
            finally:
                os.close(fd)
            try:
                with TuningDB(Path(name)) as out:
                    out.record_many(rows)
                    for key, value in notes.items():
                        out.set_meta(key, value)
                place(Path(name), final, replace=kind == FILE)
            finally:
                Path(name).unlink(missing_ok=True)
        except BaseException:
            made.undo()
            raise
        return len(rows)

    # ---------------------------------------------------------------- reading

    def _select(self, where: str = "1", params: Sequence[Any] = ()) -> tuple[list[Row], list[tuple]]:
        """The valid rows of the results table matching ``where`` (ROW_ORDER: per key fastest
        first, ties by backend name), and the primary keys of the bad ones skipped (each warned
        about once per process)."""
        rows, bad = [], []
        with self._guarded():
            for data in self._results.rows_where(where, list(params), order_by=ROW_ORDER):
                try:
                    rows.append(checked_row(data))
                except ValueError as exc:
                    pk = tuple(data.get(c) for c in PK_COLUMNS)
                    bad.append(pk)
                    if pk not in self._warned:
                        self._warned.add(pk)
                        warnings.warn(f"autosymm: skipping a bad row of tuning database {self.location} "
                                      f"({_named(pk)}): {exc}", BadRowWarning, stacklevel=3)
                self._clock.arm()  # a row came back: progress; the clock bounds the wait for the next
        return rows, bad

    def rows(self, **filters: Any) -> list[Row]:
        """Valid rows whose columns equal the given values (a list/tuple/set: any of them; None: any),
        per key fastest first (ties: backend name).

        Filter columns: the key columns, ``backend`` and ``gpu``; another name is a ValueError.
        """
        return self._select(*where_clause(filters))[0]

    def digest(self, **filters: Any) -> str:
        """:func:`rows_digest` of the valid rows matching ``filters``."""
        return rows_digest(self.rows(**filters))


def _named(pk: tuple) -> str:
    """A row's primary key as messages name it: "hardware='...', world_size=2, ..."."""
    return ", ".join(f"{c}={v!r}" for c, v in zip(PK_COLUMNS, pk))


def plain_file_mode() -> int:
    """The mode a new plain file gets under this process's umask: 0o666 & ~umask."""
    try:
        with open("/proc/self/status") as status:  # Linux: read without changing it
            for line in status:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, and put it back at once
    os.umask(mask)
    return 0o666 & ~mask


def rows_digest(rows: Iterable[Row]) -> str:
    """sha256 of the rows' key, backend, config and median: equal for equal data, whatever the
    file, order, provenance or bad rows (ranks compare it before trusting a lookup)."""
    entries = sorted([*row.pk, json.dumps(json.loads(row.config), sort_keys=True), row.median_us.hex()]
                     for row in rows)
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def verdict(path: Union[str, os.PathLike]) -> Optional[str]:
    """None when the file ``path`` is a usable tuning database, else why not, naming it: missing,
    not a regular file (a folder, a FIFO, a dangling link...), locked, not SQLite, empty, foreign,
    of a newer schema, a hot journal it cannot roll back, a query that does not end. `autosymm
    show`, `explain` and `info` all judge a file by it."""
    try:
        with TuningDB(Path(path), readonly=True) as db:
            len(db)
    except (TuningDBError, OSError, sqlite3.Error) as exc:
        text = str(exc)
        return text if str(path) in text else f"{path}: {text}"
    return None


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
    "BUSY_TIMEOUT_S", "FILTER_COLUMNS", "KEY_COLUMNS", "LOCK_WAIT_S", "MIGRATIONS", "PK_COLUMNS", "SCHEMA_VERSION",
    "BadRowWarning", "CorruptDatabaseError", "DatabaseLockedError", "DatabaseVersionError", "Key", "MergeCounts",
    "NotADatabaseFileError",
    "QueryTimeoutError", "ReadOnlyDatabaseError", "Row", "TuningDB", "TuningDBError", "rows_digest", "shipped_db_dir",
    "shipped_db_for", "shipped_db_paths", "user_db_path", "verdict", "version_mismatch",
]

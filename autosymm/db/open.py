"""Opening a tuning-database file as untrusted data (see autosymm.db.store): what a path is,
connections, locks, a bound on query time, hot journals, and which schema version a file holds.

A path is data: every file is opened through the URI naming exactly it (:func:`path_uri`); one
that is neither a regular file nor free raises :class:`NotADatabaseFileError` before anything is
opened; a new file is made exclusively (:func:`claim`). A file's schema never runs code on
autosymm's behalf (``trusted_schema=OFF``; only ``results`` and ``meta`` are read; a trigger
refuses the file); every statement runs under a :class:`QueryClock` (:class:`QueryTimeoutError`
after ``QUERY_LIMIT_S``); a locked file raises :class:`DatabaseLockedError` naming it.

Design notes: docs/DISPATCH.md#db-open
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import sqlite_utils

from .schema import SCHEMA_VERSION, V0_COLUMNS, CorruptDatabaseError, DatabaseVersionError, TuningDBError

#: How long a read (and `autosymm db merge`'s write) waits for another process's lock, seconds.
LOCK_WAIT_S = 3.0
#: The most one statement may run, or wait for its next row, seconds (QueryClock).
QUERY_LIMIT_S = 10.0
#: SQLite virtual-machine steps between two looks at the clock.
_CLOCK_STEPS = 1000
_BUSY, _LOCKED, _INTERRUPT = 5, 6, 9  # SQLite's primary result codes


class DatabaseLockedError(TuningDBError):
    """Another process holds the file's lock for longer than the wait (the message names the file)."""


class QueryTimeoutError(TuningDBError):
    """A statement on the file ran past ``QUERY_LIMIT_S`` and was interrupted."""


class NotADatabaseFileError(TuningDBError):
    """A path names something a tuning database cannot be (a folder, a FIFO, a device, a socket, a
    dangling link, a link loop): the message names it and what it is; it is left as it was."""


# ---------------------------------------------------------------------------------------- paths

#: What :func:`path_kind` says of a regular file (or a link to one), and of a name nothing has.
FILE, MISSING = "a regular file", "missing"
_MODES = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _mode_kind(mode: int) -> str:
    return FILE if stat.S_ISREG(mode) else next((kind for test, kind in _MODES if test(mode)), "not a file")


def _link_kind(path: Path) -> str:
    """What the symbolic link ``path`` leads to: FILE, or a description naming where it points."""
    try:
        to = repr(os.readlink(path))
    except OSError:
        to = "somewhere unreadable"
    try:
        kind = _mode_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return f"a dangling symbolic link to {to} (nothing is there)"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a symbolic link to {to} that loops (a link loop)"
        return f"a symbolic link to {to}, which cannot be looked up ({exc.strerror})"
    return FILE if kind == FILE else f"a symbolic link to {kind} ({to})"


def path_kind(path: Path) -> str:
    """What ``path`` is, without opening it: :data:`FILE` (a regular file or a link to one),
    :data:`MISSING` (no file and no link), or else a description for messages ('a folder', 'a
    named pipe (FIFO)', "a dangling symbolic link to '/mnt/x.sqlite' ...", a link loop, a path
    inside something that is not a folder)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return MISSING
    except OSError as exc:  # ENOTDIR, ELOOP, EACCES...: name the part of the path that is wrong
        for folder in reversed(path.parents):
            if os.path.lexists(folder) and not os.path.isdir(folder):
                return f"a path inside {folder} ({path_kind(folder)}, not a folder)"
        return f"a path that cannot be looked up ({exc.strerror})"
    return _link_kind(path) if stat.S_ISLNK(mode) else _mode_kind(mode)


def refusal(path: Path, kind: str) -> NotADatabaseFileError:
    """The error for ``path``, which is ``kind`` (path_kind), not a database file."""
    return NotADatabaseFileError(f"{path} is {kind}, not a tuning database file (a regular file, or a link to "
                                 f"one); it was left as it is")


def path_uri(path: Path, mode: str) -> str:
    """The SQLite URI naming exactly the file ``path`` (absolute, '?', '#' and '%' escaped), opened
    in ``mode`` ('ro', 'rw')."""
    return (path if path.is_absolute() else Path.cwd() / path).as_uri() + f"?mode={mode}"


@dataclass
class Claim:
    """A writable database path, as :func:`claim` found or made it: ``made``, (device, inode) of
    the file it created (None: the file was there), and the folders it created, outermost first."""

    path: Path
    made: Optional[tuple[int, int]] = None
    folders: list[Path] = field(default_factory=list)

    def undo(self) -> None:
        """Remove what the claim made: its file (if that very file is still at the path) and the
        folders it made (each only while empty); never anything else."""
        try:
            now = os.lstat(self.path)
        except OSError:
            now = None
        if self.made is not None and now is not None and stat.S_ISREG(now.st_mode) \
                and (now.st_dev, now.st_ino) == self.made:
            self.path.unlink()
        for folder in reversed(self.folders):
            try:
                os.rmdir(folder)
            except OSError:  # not empty (another process's file) or gone: it stays
                break


def make_folders(path: Path) -> list[Path]:
    """Create ``path``'s folder and its missing parents; the folders made, outermost first. One
    that is there and not a folder raises NotADatabaseFileError naming it (nothing is made)."""
    missing, folder = [], path.parent
    while not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise _not_a_folder(path, folder)
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
                made.append(folder)
            except FileExistsError:  # another process made it first: a folder, or refused
                if not os.path.isdir(folder):
                    raise _not_a_folder(path, folder) from None
    except BaseException:
        Claim(path, folders=made).undo()
        raise
    return made


def _not_a_folder(path: Path, folder: Path) -> NotADatabaseFileError:
    return NotADatabaseFileError(f"{path}: its folder {folder} is {path_kind(folder)}, not a folder; it was left "
                                 f"as it is")


def place(new: Path, path: Path, replace: bool) -> None:
    """Put the file ``new`` at ``path`` (same folder): over the regular file there (``replace``), or
    at a free name only while it is free (a hard link, atomic; where the file system has none, a
    rename after looking again), never over anything that appeared there meanwhile."""
    if replace:
        os.replace(new, path)
        return
    try:
        os.link(new, path)
        return
    except FileExistsError:
        pass
    except OSError:  # no hard links on this file system
        if path_kind(path) == MISSING:
            os.replace(new, path)
            return
    raise FileExistsError(f"{path} appeared while it was written ({path_kind(path)}); it was left as it is")


def claim(path: Path) -> Claim:
    """``path`` as a file to write a database in: a regular file (or a link to one) as it is, or
    where nothing is, a new empty file made exclusively (the mode a plain file gets under the
    umask), with its missing folders. Anything else raises NotADatabaseFileError (nothing made)."""
    kind = path_kind(path)
    if kind == FILE:
        return Claim(path)
    if kind != MISSING:
        raise refusal(path, kind)
    folders = make_folders(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)  # & ~umask
    except FileExistsError:  # another process made it since (a concurrent merge or tune): a file, or refused
        kind = path_kind(path)
        if kind != FILE:
            Claim(path, folders=folders).undo()
            raise refusal(path, kind) from None
        return Claim(path, folders=folders)
    except BaseException:
        Claim(path, folders=folders).undo()
        raise
    try:
        made = os.fstat(fd)
    finally:
        os.close(fd)
    return Claim(path, (made.st_dev, made.st_ino), folders)


class QueryClock:
    """A deadline that interrupts the connection's statement once it passes: set (``arm``) as each
    statement starts (SQLite's statement trace) and by a reader each time a row comes back. So
    it bounds one statement's run, or its wait for its next row, never a whole bulk operation of
    many statements and rows: a merge of any size passes, a statement that spins is stopped."""

    def __init__(self, conn: sqlite3.Connection, limit_s: Optional[float] = None) -> None:
        self.limit_s = QUERY_LIMIT_S if limit_s is None else limit_s
        self.deadline = time.monotonic() + self.limit_s
        conn.set_progress_handler(self._late, _CLOCK_STEPS)
        conn.set_trace_callback(self._started)

    def arm(self) -> None:
        self.deadline = time.monotonic() + self.limit_s

    def _started(self, statement: str) -> None:
        self.arm()

    def _late(self) -> int:
        return 1 if time.monotonic() > self.deadline else 0  # non-zero: SQLite interrupts


def harden(conn: sqlite3.Connection, limit_s: Optional[float] = None) -> QueryClock:
    """Make ``conn`` safe for an untrusted file: no trusted schema, a bound on each operation's
    time (``limit_s``, default QUERY_LIMIT_S; the returned clock's ``arm`` starts one)."""
    conn.execute("PRAGMA trusted_schema = OFF")
    return QueryClock(conn, limit_s)


def db_error(exc: sqlite3.OperationalError, where: str, wait_s: float, limit_s: Optional[float] = None) -> Exception:
    """``exc`` as the TuningDBError it means (a lock, a query stopped by the clock), naming ``where``;
    ``exc`` itself when it is neither."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11; older ones: the message
    code = code & 0xFF if code is not None else None
    text = str(exc)
    if code in (_BUSY, _LOCKED) or (code is None and "locked" in text):
        return DatabaseLockedError(
            f"{where} is locked by another process (waited {wait_s:g} s): a tune or merge writing it, or a "
            f"program holding it in a transaction; retry once it is done")
    if code == _INTERRUPT or (code is None and text == "interrupted"):
        return QueryTimeoutError(
            f"reading {where} took over {QUERY_LIMIT_S if limit_s is None else limit_s:g} s and was stopped: a file whose schema makes queries "
            f"spin, or one far larger than a tuning database")
    return exc


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
        with contextlib.closing(sqlite3.connect(path_uri(path, "rw"), uri=True, timeout=timeout_s)) as conn:
            harden(conn)
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as exc:
        error = db_error(exc, str(path), timeout_s)
        raise (error if error is not exc else CorruptDatabaseError(f"{advice} ({exc})")) from exc
    except sqlite3.Error as exc:
        raise CorruptDatabaseError(f"{advice} ({exc})") from exc


def connect(path: Optional[Path], readonly: bool, timeout_s: float) -> sqlite3.Connection:
    """A connection to the file ``path`` (None: in memory), waiting up to ``timeout_s`` seconds
    for locks; a path that is not a regular file (or a link to one) raises NotADatabaseFileError.

    Writable: a missing file is made with its folders (:func:`claim`). ``readonly``: SQLite's
    ``mode=ro``, the file must exist; a hot journal is rolled back first where the file is
    writable (else explained); a lock held past ``timeout_s`` raises DatabaseLockedError.
    """
    if path is None:
        return sqlite3.connect(":memory:")
    if not readonly:
        claim(path)
        return _opened(path, "rw", timeout_s)
    kind = path_kind(path)
    if kind == MISSING:
        raise FileNotFoundError(f"tuning database {path} does not exist")
    if kind != FILE:
        raise refusal(path, kind)
    conn = _opened(path, "ro", timeout_s)
    try:
        harden(conn)
        conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # a hot journal or a lock shows here
    except sqlite3.DatabaseError as exc:
        error = db_error(exc, str(path), timeout_s) if isinstance(exc, sqlite3.OperationalError) else exc
        if error is not exc:
            conn.close()
            raise error from exc
        if _is_hot_journal(path, exc):
            conn.close()
            _roll_back_hot_journal(path, timeout_s)
            return _opened(path, "ro", timeout_s)
    return conn  # any other error: the schema check reports it


def _opened(path: Path, mode: str, timeout_s: float) -> sqlite3.Connection:
    """sqlite3's connection to the file ``path`` in ``mode``; a failure to open names the file."""
    try:
        return sqlite3.connect(path_uri(path, mode), uri=True, timeout=timeout_s)
    except sqlite3.OperationalError as exc:  # gone since it was looked at, no permission...
        raise TuningDBError(f"cannot open {path} as a tuning database: {exc}") from exc


def _check_objects(db: sqlite_utils.Database, where: str) -> set[str]:
    """The names of ``db``'s own tables; CorruptDatabaseError for what autosymm's files never hold:
    a trigger (code the file would run on a write), a ``results`` or ``meta`` that is not a table."""
    objects = db.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall()
    triggers = sorted(name for kind, name in objects if kind == "trigger")
    if triggers:
        raise CorruptDatabaseError(f"{where} has trigger(s) {', '.join(triggers)}: autosymm's tuning databases "
                                   f"have none, and a file that would run its own code is refused")
    not_tables = sorted(f"{name} ({kind})" for kind, name in objects if name in ("results", "meta") and kind != "table")
    if not_tables:
        raise CorruptDatabaseError(f"{where} is not an autosymm tuning database: {', '.join(not_tables)} "
                                   f"must be a table")
    return {name for kind, name in objects if kind == "table"}


def read_schema_version(db: sqlite_utils.Database, where: str) -> Optional[int]:
    """The schema version stored in ``db`` (``where``: its file, for messages); None when empty.

    A newer version raises DatabaseVersionError (never misread); a file that is not SQLite or
    not a tuning database raises CorruptDatabaseError; a locked file raises sqlite3's error.
    """
    try:
        tables = _check_objects(db, where)
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
    except sqlite3.OperationalError:  # locked, interrupted, cannot open: not a statement about the file
        raise
    except sqlite3.DatabaseError as exc:
        raise CorruptDatabaseError(f"{where} is not a readable SQLite database ({exc})") from exc
    if version > SCHEMA_VERSION:
        raise DatabaseVersionError(
            f"{where} has tuning-database schema version {version}, newer than version "
            f"{SCHEMA_VERSION} that this autosymm reads: upgrade autosymm to use it")
    return version

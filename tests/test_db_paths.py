"""A database path is data (autosymm.db.open): the audit's reproductions of `db merge`, `db export` and
the read-only opens on paths that are not regular files (link loops, dangling links, FIFOs, folders,
devices, sockets), on names SQLite would read as URIs, and on new targets a failed write removes.
A refused target is left exactly as it was (the folder's every entry, link and byte); a written
file is byte for byte what a plain name gets and passes PRAGMA integrity_check (temp-file SQLite
in the test's folder, relative names as the audit typed them; CliRunner for the CLI)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import sqlite3
import stat
import threading
import time
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from autosymm.cli.main import main
from autosymm.db import open as db_open
from autosymm.db.merge import merge_files
from autosymm.db.open import NotADatabaseFileError, claim, place
from autosymm.db.read import open_sources
from autosymm.db.store import TuningDB, verdict

from _db_rows import make_row

GOOD = [make_row(), make_row(backend="nccl", median_us=20.0, config=None)]


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The test's folder as the current one, holding good.sqlite (GOOD)."""
    monkeypatch.chdir(tmp_path)
    with TuningDB(Path("good.sqlite")) as tdb:
        tdb.record_many(GOOD)
    return tmp_path


def snapshot(folder: Path) -> dict:
    """Every entry under ``folder``: its type, inode, mode and times, a link's text, a file's bytes."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root, name)
            info = os.lstat(path)
            seen[str(path.relative_to(folder))] = (
                stat.S_IFMT(info.st_mode), info.st_ino, info.st_mode, info.st_size,
                None if stat.S_ISDIR(info.st_mode) else info.st_mtime_ns,
                os.readlink(path) if stat.S_ISLNK(info.st_mode) else None,
                hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(info.st_mode) else None)
    return seen


def integrity(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)) as conn:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]


def make_odd(kind: str) -> str:
    """Make, in the current folder, a path of ``kind`` (ODD) that is no database file; its name."""
    if kind in ("link loop", "inside a link loop"):
        os.symlink("b", "a")
        os.symlink("a", "b")
    elif kind == "dangling link to an unmounted share":
        os.symlink("/nonexistent_dir/x.sqlite", "t.sqlite")
    elif kind == "dangling link beside it":
        os.symlink("absent.sqlite", "t.sqlite")
    elif kind == "inside a dangling link":
        os.symlink("/nonexistent_dir", "t")
    elif kind == "FIFO":
        os.mkfifo("p")
    elif kind in ("folder", "link to a folder"):
        os.mkdir("d")
        os.symlink("d", "l")
    elif kind == "link to a device":
        os.symlink(os.devnull, "n")
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind("s")
        server.close()  # the socket file stays
    elif kind == "inside a regular file":
        Path("plain.txt").write_text("notes\n")
    return ODD[kind][0]


#: kind -> (the path, what the refusal says it is)
ODD = {
    "link loop": ("a", "a is a symbolic link to 'b' that loops (a link loop)"),
    "dangling link to an unmounted share": (
        "t.sqlite", "t.sqlite is a dangling symbolic link to '/nonexistent_dir/x.sqlite' (nothing is there)"),
    "dangling link beside it": ("t.sqlite", "t.sqlite is a dangling symbolic link to 'absent.sqlite'"),
    "FIFO": ("p", "p is a named pipe (FIFO)"),
    "folder": ("d", "d is a folder"),
    "link to a folder": ("l", "l is a symbolic link to a folder ('d')"),
    "link to a device": ("n", f"n is a symbolic link to a character device ('{os.devnull}')"),
    "socket": ("s", "s is a socket"),
    "inside a regular file": ("plain.txt/x.sqlite", "plain.txt/x.sqlite is a path inside plain.txt (a regular file, "
                                                    "not a folder)"),
    "inside a link loop": ("a/x.sqlite", "a/x.sqlite is a path inside a (a symbolic link to 'b' that loops"),
    "inside a dangling link": ("t/x.sqlite", "t/x.sqlite: its folder t is a dangling symbolic link to "
                                             "'/nonexistent_dir' (nothing is there), not a folder"),
}
#: Paths click's own checks refuse before autosymm sees them (`--into` and export's output are dir_okay=False).
CLICK_REFUSES = {"folder", "link to a folder"}


@contextlib.contextmanager
def nobody_opens(name: str):
    """Fail if anything opens the FIFO ``name`` for reading meanwhile (and unblock it if so: a
    writer comes and goes, so a read that would wait forever sees the end instead)."""
    opened, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            try:
                os.close(os.open(name, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while a reader is there
                opened.append(True)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
    assert not opened, f"{name} was opened"


# ------------------------------------------------------------------ targets that are not files


@pytest.mark.parametrize("kind", ODD)
def test_merge_refuses_a_target_that_is_no_file_and_leaves_it_as_it_was(here, kind):
    name = make_odd(kind)
    before = snapshot(here)
    with pytest.raises(NotADatabaseFileError) as refused:
        merge_files([Path("good.sqlite")], name)
    assert ODD[kind][1] in str(refused.value) and "left as it is" in str(refused.value)
    assert snapshot(here) == before  # the link, loop, pipe... as it was; nothing made, nothing removed


@pytest.mark.parametrize("kind", ODD)
def test_the_merge_and_export_commands_name_the_path_and_what_it_is(here, kind):
    name = make_odd(kind)
    before = snapshot(here)
    runner = CliRunner()
    for args in (["db", "merge", "good.sqlite", "--into", name], ["db", "export", name, "--db", "good.sqlite"],
                 ["db", "export", name, "--db", "good.sqlite", "--overwrite"]):
        result = runner.invoke(main, args)
        if kind in CLICK_REFUSES:
            assert result.exit_code == 2 and f"'{name}' is a directory" in result.stderr, result.output
        else:
            assert result.exit_code == 1 and result.stderr.startswith(f"Error: {ODD[kind][1]}"), result.output
            assert len(result.stderr.splitlines()) == 1 and result.stdout == ""
        assert snapshot(here) == before


@pytest.mark.parametrize("kind", ["link loop", "dangling link to an unmounted share", "FIFO", "folder",
                                  "link to a device", "socket"])
def test_read_only_opens_refuse_a_path_that_is_no_file_naming_it(here, kind):
    name = make_odd(kind)
    before = snapshot(here)
    with nobody_opens(name) if kind == "FIFO" else contextlib.nullcontext():
        with pytest.raises(NotADatabaseFileError, match=re.escape(ODD[kind][1])):
            TuningDB(Path(name), readonly=True)
        assert ODD[kind][1] in verdict(name)  # what `show`, `explain` and `info` say of it
    assert snapshot(here) == before


@pytest.mark.parametrize("kind", ["link loop", "dangling link to an unmounted share", "FIFO"])
def test_the_dispatcher_skips_a_user_db_that_is_no_file_with_a_warning_naming_it(here, kind):
    name = make_odd(kind)
    before = snapshot(here)
    with nobody_opens(name) if kind == "FIFO" else contextlib.nullcontext():
        with pytest.warns(UserWarning, match=f"ignoring tuning database {name}: {re.escape(ODD[kind][1])}"):
            (source,) = open_sources(Path(name), [Path("good.sqlite")])
    assert source.label == "good.sqlite" and set(source._rows) == set(GOOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a user DB that is not there: skipped without a word
        assert [s.label for s in open_sources(Path("absent.sqlite"), [Path("good.sqlite")])] == ["good.sqlite"]
    assert snapshot(here) == before


def test_the_audits_fifo_target_is_refused_at_once_naming_it(here):
    # the audit: `db merge good.sqlite --into p` (p a FIFO) ended after 2.5 s with "disk I/O error"
    os.mkfifo("p")
    before = snapshot(here)
    runner = CliRunner()
    with nobody_opens("p"):
        start = time.monotonic()
        merged = runner.invoke(main, ["db", "merge", "good.sqlite", "--into", "p"])
        assert time.monotonic() - start < 1.0
        as_source = runner.invoke(main, ["db", "merge", "p", "--into", "new.sqlite"])
        shown = runner.invoke(main, ["show", "--db", "p"])
    assert merged.exit_code == 1 and merged.stderr == ("Error: p is a named pipe (FIFO), not a tuning database file "
                                                       "(a regular file, or a link to one); it was left as it is\n")
    for result in (as_source, shown):
        assert result.exit_code == 1 and "p is a named pipe (FIFO)" in result.stderr, result.output
    assert snapshot(here) == before


def test_the_audits_link_loop_and_dangling_link_stay(here):
    # the audit: both merges exited 1 ("unable to open database file") and deleted the link
    os.symlink("b", "a")
    os.symlink("a", "b")
    os.symlink("/nonexistent_dir/x.sqlite", "t.sqlite")
    before = snapshot(here)
    for target in ("a", "t.sqlite"):
        result = CliRunner().invoke(main, ["db", "merge", "good.sqlite", "--into", target])
        assert result.exit_code == 1 and result.stderr.startswith(f"Error: {target} is a "), result.output
    assert snapshot(here) == before
    assert os.readlink("a") == "b" and os.readlink("t.sqlite") == "/nonexistent_dir/x.sqlite"


# ------------------------------------------------------------------ names SQLite would read as URIs


@pytest.mark.parametrize("name", ["file:x.sqlite?mode=memory", "file:sub/x.sqlite?nolock=1", ":memory:",
                                  "file:x.sqlite?immutable=1&vfs=unix-none", "a%3Fb #1.sqlite"])
def test_a_name_sqlite_would_read_as_a_uri_is_a_file_name(here, name):
    runner = CliRunner()
    assert runner.invoke(main, ["db", "merge", "good.sqlite", "--into", "plain.sqlite"]).exit_code == 0
    merged = runner.invoke(main, ["db", "merge", "good.sqlite", "--into", name])
    assert merged.exit_code == 0 and merged.stdout == "good.sqlite: 2 new, 0 replaced by faster rows, 0 kept\n"
    written = here / name
    assert stat.S_ISREG(os.lstat(written).st_mode) and integrity(written) == "ok"
    assert written.read_bytes() == (here / "plain.sqlite").read_bytes()  # locking, mode, vfs: as for a plain name
    expected = {"good.sqlite", "plain.sqlite", name, *(str(p) for p in Path(name).parents if str(p) != ".")}
    assert {str(p.relative_to(here)) for p in here.rglob("*")} == expected  # no stray folder ('sub')
    with TuningDB(Path(name), readonly=True) as tdb:  # read back as the file of that name too
        assert tdb.rows() == GOOD
    shown = runner.invoke(main, ["show", "--all", "--json", "--db", name])
    assert shown.exit_code == 0, shown.output
    assert sorted(row["backend"] for row in json.loads(shown.stdout)) == ["nccl", "triton_one_shot"]
    exported = runner.invoke(main, ["db", "export", f"{name}.out", "--db", name])
    assert exported.exit_code == 0 and integrity(here / f"{name}.out") == "ok", exported.output
    assert TuningDB(Path(f"{name}.out"), readonly=True).rows() == GOOD


def test_the_user_db_named_like_a_uri_is_that_file(here, monkeypatch):
    Path("file:u.sqlite?mode=memory").write_bytes(Path("good.sqlite").read_bytes())
    monkeypatch.setenv("AUTOSYMM_DB", "file:u.sqlite?mode=memory")
    exported = CliRunner().invoke(main, ["db", "export", "out.sqlite"])  # from the user DB
    assert exported.exit_code == 0 and exported.stdout == "exported 2 rows to out.sqlite\n", exported.output
    assert integrity(here / "out.sqlite") == "ok" and TuningDB(Path("out.sqlite"), readonly=True).rows() == GOOD


# ------------------------------------------------------------------ what a write may remove


def test_a_failed_merge_removes_the_file_and_folders_it_made_and_nothing_else(here, monkeypatch):
    Path("kept").mkdir()
    Path("kept/notes.txt").write_text("mine\n")
    before = snapshot(here)

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(TuningDB, "_merge_rows", fail)
    for target in ("new/deeper/t.sqlite", "kept/new/t.sqlite", "kept/t.sqlite"):
        with pytest.raises(OSError, match="disk full"):
            merge_files([Path("good.sqlite")], target)
        assert snapshot(here) == before  # 'kept' and its file stay; 'new', 'deeper', 't.sqlite' are gone


def test_a_failed_merge_into_a_link_to_a_file_leaves_both(here, monkeypatch):
    Path("real").mkdir()
    with TuningDB(Path("real/x.sqlite")) as tdb:
        tdb.record_many([make_row(bucket=4096)])
    os.symlink("real/x.sqlite", "l.sqlite")
    before = snapshot(here)
    monkeypatch.setattr(TuningDB, "_merge_rows", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        merge_files([Path("good.sqlite")], "l.sqlite")
    assert snapshot(here) == before


def test_merge_writes_through_a_link_to_a_file_and_the_link_stays(here):
    Path("real").mkdir()
    with TuningDB(Path("real/x.sqlite")) as tdb:
        tdb.record_many([make_row(bucket=4096)])
    os.symlink("real/x.sqlite", "l.sqlite")
    result = CliRunner().invoke(main, ["db", "merge", "good.sqlite", "--into", "l.sqlite"])
    assert result.exit_code == 0 and "2 new" in result.stdout, result.output
    assert os.readlink("l.sqlite") == "real/x.sqlite" and integrity(here / "real/x.sqlite") == "ok"
    assert len(TuningDB(Path("real/x.sqlite"), readonly=True).rows()) == 3


def test_export_over_a_link_to_a_file_replaces_that_file_and_keeps_the_link(here):
    Path("real").mkdir()
    Path("real/x.sqlite").write_bytes(b"an older export")
    os.symlink("real/x.sqlite", "l.sqlite")
    runner = CliRunner()
    refused = runner.invoke(main, ["db", "export", "l.sqlite", "--db", "good.sqlite"])
    assert refused.exit_code == 1 and "l.sqlite exists" in refused.stderr
    assert Path("real/x.sqlite").read_bytes() == b"an older export"
    done = runner.invoke(main, ["db", "export", "l.sqlite", "--db", "good.sqlite", "--overwrite"])
    assert done.exit_code == 0, done.output
    assert os.path.islink("l.sqlite") and os.readlink("l.sqlite") == "real/x.sqlite"
    assert integrity(here / "real/x.sqlite") == "ok" and TuningDB(Path("l.sqlite"), readonly=True).rows() == GOOD
    assert sorted(os.listdir("real")) == ["x.sqlite"]  # no temp file left


def test_a_failed_export_removes_the_folders_it_made(here, monkeypatch):
    before = snapshot(here)
    monkeypatch.setattr("autosymm.db.store.place", lambda *args, **kwargs: 1 / 0)
    with TuningDB(Path("good.sqlite"), readonly=True) as tdb, pytest.raises(ZeroDivisionError):
        tdb.export("new/deeper/out.sqlite")
    assert snapshot(here) == before


def test_a_path_that_appears_meanwhile_is_never_replaced(here, monkeypatch):
    # claim: a FIFO made between the look at the free name and the exclusive create
    made = db_open.make_folders

    def race(path):
        os.mkfifo(path)
        return made(path)

    monkeypatch.setattr(db_open, "make_folders", race)
    with pytest.raises(NotADatabaseFileError, match="new.sqlite is a named pipe"):
        claim(Path("new.sqlite"))
    assert stat.S_ISFIFO(os.lstat("new.sqlite").st_mode)
    # place: a link made at the free name before the new file is put there, hard links or not
    os.symlink("/nonexistent_dir/x.sqlite", "out.sqlite")
    for no_hard_links in (False, True):
        if no_hard_links:
            monkeypatch.setattr(os, "link", lambda *args: (_ for _ in ()).throw(OSError(errno.EPERM, "no links")))
        with pytest.raises(FileExistsError, match="out.sqlite appeared while it was written"):
            place(Path("good.sqlite"), Path("out.sqlite"), replace=False)
        assert os.readlink("out.sqlite") == "/nonexistent_dir/x.sqlite"
    place(Path("good.sqlite"), Path("free.sqlite"), replace=False)  # no hard links: a rename
    assert integrity(here / "free.sqlite") == "ok" and not Path("good.sqlite").exists()

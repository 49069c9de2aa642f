"""`autosymm db export` writes a file with the mode a plain file gets under the user's umask
(0o666 & ~umask), not mkstemp's 0600 (temp-file SQLite; CliRunner)."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from autosymm.cli.main import main
from autosymm.db.store import TuningDB, plain_file_mode

from _db_rows import make_row


@pytest.fixture
def umask():
    """Set the process umask for one test (put back afterwards)."""
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664), (0o000, 0o666)])
def test_export_takes_the_mode_of_a_plain_file(tmp_path, umask, mask, mode):
    source = tmp_path / "source.sqlite"
    with TuningDB(source) as tdb:
        tdb.record_many([make_row()])
    umask(mask)
    assert plain_file_mode() == mode
    plain = tmp_path / "plain"
    plain.write_text("")  # what the user's other files get
    out = tmp_path / "out.sqlite"
    result = CliRunner().invoke(main, ["db", "export", str(out), "--db", str(source)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == mode == stat.S_IMODE(plain.stat().st_mode)
    again = CliRunner().invoke(main, ["db", "export", str(out), "--db", str(source), "--overwrite"])
    assert again.exit_code == 0 and stat.S_IMODE(out.stat().st_mode) == mode
    assert TuningDB(out, readonly=True).rows() == [make_row()]

"""AUTOSYMM_LOG (autosymm.logs): level names and numbers; a bad value is one warning, never an error."""

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autosymm import logs


@pytest.fixture
def autosymm_logger(monkeypatch):
    """The autosymm logger's level restored, and the bad values already warned about forgotten."""
    level = logs.logger.level
    monkeypatch.setattr(logs, "_warned_values", set())
    yield logs.logger
    logs.logger.setLevel(level)


def test_configure_from_env_sets_the_level(autosymm_logger):
    assert logs.configure_from_env({"AUTOSYMM_LOG": "debug"}) == logging.DEBUG
    assert autosymm_logger.level == logging.DEBUG and logs.debug_enabled()
    assert logs.configure_from_env({"AUTOSYMM_LOG": "40"}) == 40
    assert autosymm_logger.level == 40 and not logs.debug_enabled()


def test_unset_or_empty_changes_nothing(autosymm_logger):
    autosymm_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert logs.configure_from_env({}) is None
        assert logs.configure_from_env({"AUTOSYMM_LOG": "  "}) is None
    assert autosymm_logger.level == logging.ERROR


def test_a_bad_value_is_warned_about_once_and_ignored(autosymm_logger):
    autosymm_logger.setLevel(logging.ERROR)
    with pytest.warns(RuntimeWarning) as record:
        assert logs.configure_from_env({"AUTOSYMM_LOG": "nonsense"}) is None
    (message,) = [str(w.message) for w in record]
    assert "AUTOSYMM_LOG='nonsense'" in message and "debug, info, warning, error, critical" in message
    assert autosymm_logger.level == logging.ERROR
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert logs.configure_from_env({"AUTOSYMM_LOG": "nonsense"}) is None  # once per value


def test_import_and_cli_help_survive_a_bad_autosymm_log():
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, AUTOSYMM_LOG="nonsense", PYTHONPATH=str(repo))
    code = "import autosymm; from autosymm.cli.main import main; main(['--help'], prog_name='autosymm')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage: autosymm" in done.stdout
    assert "AUTOSYMM_LOG='nonsense'" in done.stderr and "Traceback" not in done.stderr

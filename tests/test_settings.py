"""autosymm.settings: every variable declared once, one switch vocabulary, errors that name the
variable, and docs/ENVIRONMENT.md's table listing exactly the declared variables."""

import logging
import re
from pathlib import Path

import pytest
import torch

from autosymm.runtime import agreement
from autosymm import settings
from autosymm.runtime.group import LocalSetup

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT = ROOT / "docs" / "ENVIRONMENT.md"
SWITCHES = [v.name for v in settings.VARIABLES if v.parse is settings.parse_bool]


@pytest.fixture
def no_env(monkeypatch):
    """Every declared variable unset."""
    for variable in settings.VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    return monkeypatch


def test_the_switches_are_the_ones_that_say_on_or_off():
    assert sorted(SWITCHES) == ["AUTOSYMM_CHECK_CALLS", "AUTOSYMM_DETERMINISTIC", "AUTOSYMM_DISABLE",
                                "AUTOSYMM_EAGER_REPLAY",
                                "TORCH_SYMM_MEM_DISABLE_MULTICAST"]


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), ("TRUE", True), (" Yes ", True), ("on", True), ("On", True),
    ("0", False), ("false", False), ("False", False), ("NO", False), ("off", False), (" 0 ", False),
])
def test_every_switch_reads_one_vocabulary(no_env, name, text, value):
    no_env.setenv(name, text)
    assert settings.get(name) is value


@pytest.mark.parametrize("name", SWITCHES)
def test_unset_or_empty_switches_take_their_default(no_env, name):
    default = settings.BY_NAME[name].default
    assert settings.get(name) is default
    for text in ("", "   "):
        no_env.setenv(name, text)
        assert settings.get(name) is default


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("text", ["2", "maybe", "enable", "y", "n", "1.0", "offf"])
def test_any_other_switch_value_is_an_error_naming_it(no_env, name, text):
    no_env.setenv(name, text)
    with pytest.raises(ValueError) as info:
        settings.get(name)
    assert f"{name}={text!r} is not a switch" in str(info.value) and "1, true, yes, on" in str(info.value)


def test_the_three_vocabularies_that_disagreed_now_agree(no_env):
    no_env.setenv("AUTOSYMM_DISABLE", "no")  # used to disable autosymm
    assert settings.disabled() is False
    no_env.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "false")  # used to mean off to the fingerprint
    assert settings.multicast_disabled_by_env() is False
    no_env.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert settings.multicast_disabled_by_env() is True
    no_env.setenv("AUTOSYMM_EAGER_REPLAY", "off")
    assert settings.get("AUTOSYMM_EAGER_REPLAY") is False


@pytest.mark.parametrize("name, text, value", [
    ("AUTOSYMM_BARRIER_MAX_POLLS", "4096", 4096), ("AUTOSYMM_BARRIER_MAX_POLLS", "0x100", 256),
    ("AUTOSYMM_AGREE_TIMEOUT_S", "2.5", 2.5), ("AUTOSYMM_COMPILE_THREADS", "0", 1),
    ("AUTOSYMM_DB", "~/x.sqlite", Path("~/x.sqlite").expanduser()), ("AUTOSYMM_WORKSPACE_BYTES", "2GiB", 2 << 30),
    ("AUTOSYMM_LOG", "warn", logging.WARNING), ("NCCL_NVLS_ENABLE", "2", "2"),
])
def test_values_parse_to_their_settings(no_env, name, text, value):
    no_env.setenv(name, text)
    assert settings.get(name) == value


@pytest.mark.parametrize("name, text, message", [
    ("AUTOSYMM_BARRIER_MAX_POLLS", "abc", "AUTOSYMM_BARRIER_MAX_POLLS='abc' must be an integer in 1..2**31-1"),
    ("AUTOSYMM_BARRIER_MAX_POLLS", str(1 << 31), "must be an integer in 1..2**31-1"),
    ("AUTOSYMM_AGREE_TIMEOUT_S", "0", "AUTOSYMM_AGREE_TIMEOUT_S='0' must be a number of seconds in [1, 86400]"),
    ("AUTOSYMM_AGREE_TIMEOUT_S", "1e-9", "AUTOSYMM_AGREE_TIMEOUT_S='1e-9' must be a number of seconds in [1, 86400]: "
                                         "a shorter deadline gives up on healthy peers"),
    ("AUTOSYMM_AGREE_TIMEOUT_S", "0.5", "must be a number of seconds in [1, 86400]"),
    ("AUTOSYMM_AGREE_TIMEOUT_S", "nan", "must be a number of seconds"),
    ("AUTOSYMM_COMPILE_THREADS", "many", "AUTOSYMM_COMPILE_THREADS='many' must be a whole number of threads"),
    ("AUTOSYMM_WORKSPACE_BYTES", "lots", "AUTOSYMM_WORKSPACE_BYTES='lots' is not a size"),
    ("AUTOSYMM_LOG", "loud", "AUTOSYMM_LOG='loud': give a level name"),
])
def test_bad_values_name_the_variable_and_the_value(no_env, name, text, message):
    no_env.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(message)):
        settings.get(name)
    default, error = settings.get_or_default(name)  # the lenient read: the default and the message
    assert default == settings.BY_NAME[name].default and message in error


@pytest.mark.parametrize("text, level", [
    ("debug", logging.DEBUG), ("INFO", logging.INFO), (" Warning ", logging.WARNING), ("warn", logging.WARNING),
    ("error", logging.ERROR), ("critical", logging.CRITICAL), ("fatal", logging.CRITICAL), ("10", 10), ("25", 25),
    ("0", 0),
])
def test_parse_log_level_accepts_names_and_numbers(text, level):
    assert settings.parse_log_level(text) == level


@pytest.mark.parametrize("text", ["nonsense", "-5", "1.5", "debug,info", "basicConfig", "NOTSET1", "lower"])
def test_parse_log_level_rejects_anything_else(text):
    assert settings.parse_log_level(text) is None


def test_check_names_every_bad_runtime_variable_and_only_those(no_env):
    settings.check()  # nothing set: nothing wrong
    no_env.setenv("AUTOSYMM_DISABLE", "maybe")
    no_env.setenv("AUTOSYMM_EAGER_REPLAY", "sometimes")
    no_env.setenv("AUTOSYMM_COMPILE_THREADS", "many")  # the tuner's: not a serving error
    no_env.setenv("AUTOSYMM_LOG", "loud")  # only warned about
    with pytest.raises(ValueError) as info:
        settings.check()
    message = str(info.value)
    assert "AUTOSYMM_DISABLE='maybe'" in message and "AUTOSYMM_EAGER_REPLAY='sometimes'" in message
    assert "COMPILE_THREADS" not in message and "AUTOSYMM_LOG" not in message
    assert settings.errors("tuning") == ["AUTOSYMM_COMPILE_THREADS='many' must be a whole number of threads"]


def test_a_bad_value_goes_into_the_first_call_report_never_raises(no_env, tmp_path):
    no_env.setenv("AUTOSYMM_DB", str(tmp_path / "none.sqlite"))
    no_env.setenv("AUTOSYMM_EAGER_REPLAY", "maybe")
    local = LocalSetup(torch.device("cpu"), 2)
    assert local.report["ok"] is False
    assert local.report["error"].startswith("ValueError: AUTOSYMM_EAGER_REPLAY='maybe' is not a switch")
    no_env.delenv("AUTOSYMM_EAGER_REPLAY")
    no_env.setenv("AUTOSYMM_DISABLE", "yes")
    local = LocalSetup(torch.device("cpu"), 2)
    assert local.report["ok"] and local.report["settings"]["disabled"] is True
    assert {"region_bytes", "barrier_max_polls", "multicast_off"} <= set(local.report["settings"])


def test_a_bad_agree_timeout_waits_the_default_and_is_reported(no_env):
    no_env.setenv("AUTOSYMM_AGREE_TIMEOUT_S", "-1")
    assert agreement.timeout_s() == settings.DEFAULT_AGREE_TIMEOUT_S
    with pytest.raises(ValueError, match="AUTOSYMM_AGREE_TIMEOUT_S='-1'"):
        settings.check()
    no_env.setenv("AUTOSYMM_AGREE_TIMEOUT_S", "30")
    assert agreement.timeout_s() == 30.0


def test_only_declared_variables_are_read(no_env):
    with pytest.raises(KeyError, match="declares no environment variable 'AUTOSYMM_NOPE'"):
        settings.get("AUTOSYMM_NOPE")
    with pytest.raises(KeyError):
        settings.raw("HOME")


def test_export_sets_variables_but_never_the_multicast_ones(no_env):
    no_env.setenv("AUTOSYMM_BARRIER_MAX_POLLS", "77")
    settings.export({"AUTOSYMM_BARRIER_MAX_POLLS": "99"}, overwrite=False)
    assert settings.get("AUTOSYMM_BARRIER_MAX_POLLS") == 77
    no_env.delenv("AUTOSYMM_BARRIER_MAX_POLLS")
    settings.export({"AUTOSYMM_BARRIER_MAX_POLLS": "99"}, overwrite=False)
    assert settings.get("AUTOSYMM_BARRIER_MAX_POLLS") == 99
    for name in settings.MULTICAST_VARIABLES:
        with pytest.raises(ValueError, match=f"autosymm never sets {name}"):
            settings.export({name: "1"})
        assert settings.raw(name) is None


def test_comm_env_records_the_multicast_variables_verbatim(no_env):
    no_env.setenv("NCCL_NVLS_ENABLE", "0")
    no_env.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert settings.comm_env() == "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=unset"


def _environment_table() -> str:
    """docs/ENVIRONMENT.md's table: its rows, from the header row on."""
    text = ENVIRONMENT.read_text()
    start = text.index("| variable | value | what it does |\n")
    end = text.find("\n\n", start)
    return text[start:] if end < 0 else text[start:end]


def test_the_environment_doc_documents_every_declared_variable_and_no_other():
    rows = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", _environment_table(), flags=re.MULTILINE)
    assert len(rows) == len(set(rows)), "a variable listed twice"
    assert set(rows) == set(settings.BY_NAME)


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
def test_the_docs_name_no_undeclared_variable(doc):
    mentioned = set(re.findall(r"\bAUTOSYMM_[A-Z0-9_]+", (ROOT / doc).read_text())) - {"AUTOSYMM_"}
    assert mentioned <= set(settings.BY_NAME), f"{doc} names undeclared variables: {mentioned - set(settings.BY_NAME)}"


def test_every_declaration_has_a_doc_line_and_a_known_scope():
    for variable in settings.VARIABLES:
        assert variable.doc and "\n" not in variable.doc, variable.name
        assert variable.scope in ("runtime", "tuning", "log", "foreign"), variable.name
        assert variable.scope != "foreign" or variable.owner != "autosymm", variable.name

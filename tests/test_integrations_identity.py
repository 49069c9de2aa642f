"""autosymm.integrations.identity: the code identity a stack keys compiles by is a str (vLLM hashes
it as JSON), the same in another process, and changes with the named modules' source."""

from __future__ import annotations

import json
import subprocess
import sys

from autosymm.integrations.identity import code_identity
from autosymm.integrations import fusion_pass, vllm_fusion

MODULES = ("autosymm.integrations.vllm_fusion", "autosymm.integrations.vllm_ops")


def test_a_str_json_takes_and_the_passes_return_it():
    ident = code_identity(*MODULES)
    assert isinstance(ident, str) and len(ident) == 64 and int(ident, 16) >= 0
    assert json.loads(json.dumps([ident])) == [ident]
    assert vllm_fusion.PASS.uuid() == code_identity("autosymm.integrations.vllm_fusion",
                                                    "autosymm.integrations.vllm_fusion_quant",
                                                    "autosymm.integrations.vllm_ops")
    assert isinstance(fusion_pass.AllReduceRMSNormPass().uuid(), str)


def test_the_same_in_another_process():
    code = f"from autosymm.integrations.identity import code_identity; print(code_identity(*{MODULES!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == code_identity(*MODULES)


def test_changes_with_a_modules_source(tmp_path, monkeypatch):
    source = tmp_path / "autosymm_identity_probe.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    source.write_text("X = 1\n")
    before = code_identity("autosymm_identity_probe")
    assert before != code_identity(*MODULES)
    source.write_text("X = 2\n")
    code_identity.cache_clear()
    assert code_identity("autosymm_identity_probe") != before
    monkeypatch.delitem(sys.modules, "autosymm_identity_probe")

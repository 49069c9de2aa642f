"""tests/stacks: autosymm against the real vLLM 0.33.0 and SGLang 0.5.23 Python sources.

scripts/test_real_stacks.sh fetches and unpacks them and runs this directory; the main suite
(``python3 -m pytest -q``) leaves it out (tests/conftest.py), since importing the stacks costs
tens of seconds on a small machine. Without the sources every module here skips, saying how to
get them. Test modules call ``stubs.require_real_sources()`` before importing vLLM or SGLang (their
spawned gloo ranks re-import them, so the stubs are installed there too).
"""

from __future__ import annotations

import pytest

import stubs

if stubs.missing_reason() is None:
    stubs.use_real_sources()


@pytest.fixture(scope="session")
def stacks_src():
    """The directory holding the unpacked ``vllm`` and ``sglang`` packages (skips without it)."""
    reason = stubs.missing_reason()
    if reason is not None:
        pytest.skip(reason)
    return stubs.cache_dir() / "src"

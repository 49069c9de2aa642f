"""What tests/stacks takes from somewhere other than the real vLLM / SGLang sources, listed and checked."""

from __future__ import annotations

import importlib.metadata
import sys
import zipfile

import stubs

stubs.require_real_sources()

import sglang  # noqa: E402
import vllm  # noqa: E402
import vllm.platforms.cuda  # noqa: E402,F401  (imports the compiled extension stubbed first)

_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23"}


def test_the_stacks_are_the_released_versions_from_the_unpacked_wheels():
    src = stubs.cache_dir() / "src"
    for module in (vllm, sglang):
        assert importlib.metadata.version(module.__name__) == _VERSIONS[module.__name__]
        assert module.__file__ == str(src / module.__name__ / "__init__.py")


def test_every_stub_is_a_compiled_extension_of_the_wheel():
    """A stub stands only for a .so the wheel ships (the sources unpacked without them)."""
    shipped = set()
    for wheel in stubs.cache_dir().glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            shipped |= {name.split(".")[0].replace("/", ".") for name in zf.namelist() if name.endswith(".so")}
    assert set(stubs.STUBS) <= shipped, sorted(set(stubs.STUBS) - shipped)
    assert all(reason.strip() for reason in stubs.STUBS.values())


def _where(module) -> str:
    """A module's file, or a namespace package's first directory."""
    return getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", None) or ()), "")


def test_the_stand_ins_in_use_are_the_listed_ones():
    """Print the list; every loaded vllm/sglang module is a real file or a listed stub, and every
    loaded module of a stand-in's name is its listed fake."""
    print("stubs:", *(f"  {name}: {why}" for name, why in sorted(stubs.STUBS.items())), sep="\n")
    print("stand-ins:", *(f"  {name}: {why}" for name, why in sorted(stubs.STAND_INS.items())), sep="\n")
    src = str(stubs.cache_dir() / "src")
    loaded = {name: mod for name, mod in sys.modules.items() if name.split(".")[0] in _VERSIONS and mod is not None}
    fake = {name for name, mod in loaded.items() if not _where(mod).startswith(src)}
    assert fake == {name for name in loaded if name in stubs.STUBS}
    assert all(getattr(sys.modules[name], "__stub_reason__", None) == stubs.STUBS[name] for name in fake)
    assert "vllm._C_stable_libtorch" in fake  # the CUDA platform imports it unconditionally
    for name in stubs.STAND_INS:
        module = sys.modules.get(name)
        assert module is None or getattr(module, "__stand_in__", False), f"{name} loaded but not the listed fake"


def _wheel_schemas(names) -> dict:
    """name -> the schemas (whitespace collapsed) the 0.33.0 wheel's ``vllm/_C_stable_libtorch.abi3.so``
    carries for it: the string literals of csrc/torch_bindings.cpp its ``ops.def`` calls register."""
    import re

    (wheel,) = stubs.cache_dir().glob("vllm-0.33.0-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        strings = zf.read("vllm/_C_stable_libtorch.abi3.so").split(b"\0")
    found: dict = {name: set() for name in names}
    for raw in strings:
        text = raw.decode("latin-1")
        head = text.split("(", 1)[0]
        if head in found and "->" in text:
            found[head].add(re.sub(r"\s+", " ", text).strip())
    return found


def test_the_declared_c_ops_have_the_schemas_of_the_real_extension():
    import torch

    declared = {**stubs.C_OPS, **stubs.C_QUERIES}
    found = _wheel_schemas(declared)
    for name, schema in declared.items():
        assert len(found[name]) == 1, (name, found[name])
        (real,) = found[name]
        assert torch._C.parse_schema(schema) == torch._C.parse_schema(real), (name, schema, real)

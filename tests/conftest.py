"""Test set-up: Triton kernels run under the interpreter (TRITON_INTERPRET=1), on CPU tensors,
whether or not the machine has CUDA, so the interpreter suites run on a GPU node too.

The one exception is a session of only GPU tests (``pytest tests/gpu``, what
scripts/run_gpu_tests.sh runs): their kernels must be compiled for the GPU, so the variable is
left as the environment has it. A session that collects both on a CUDA machine runs the
interpreter suites and skips tests/gpu, saying why (their worker processes would inherit the
interpreter). The variable must be set before any @triton.jit function is created, i.e. before
autosymm's kernels are imported: pytest_configure runs before any test module is collected.
NVLink multicast stays off everywhere.
"""

import os
from pathlib import Path

# One intra-op thread per process, read when torch loads: the tests' tensors are tiny, and each
# rank's idle OpenMP threads spin on the CPUs the other ranks and workers need.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

GPU_TESTS = Path(__file__).resolve().parent / "gpu"
STACK_TESTS = Path(__file__).resolve().parent / "stacks"  # scripts/test_real_stacks.sh runs them
GPU_SKIP_REASON = ("tests/gpu need kernels compiled for the GPU; this session runs the interpreter suites "
                   "(TRITON_INTERPRET=1): run scripts/run_gpu_tests.sh (pytest tests/gpu) for them")

os.environ.update({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's warning; same default
# torch.compile in the tests: every compile runs inductor's passes (a cached FX graph would skip the
# custom pass the tests count), in the compiling process (no pool of compile workers), and inductor's
# CPU kernels are scalar C++ (its vector ISA only shapes its own C++, never which op a graph calls;
# finding it compiles a probe per ISA, ~10 s, and vector code compiles slower).
os.environ.update({"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"})
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def _inside(arg: str, root: Path) -> bool:
    path = Path(arg.split("::", 1)[0]).resolve()
    return path == root or root in path.parents


def _inside_gpu_tests(arg: str) -> bool:
    return _inside(arg, GPU_TESTS)


def pytest_ignore_collect(collection_path, config):
    """Leave tests/stacks (the real vLLM / SGLang sources) to a session that names it."""
    if collection_path == STACK_TESTS and not any(_inside(arg, STACK_TESTS) for arg in config.args):
        return True
    return None


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: no workers for a session of only tests/gpu (they share the GPUs) or only
    tests/stacks; else one per CPU, at least 2 (rank processes spend much of their time waiting
    on each other, so a second worker fills the gaps even on one core)."""
    if config.args and all(_inside_gpu_tests(arg) or _inside(arg, STACK_TESTS) for arg in config.args):
        return 0
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return max(2, len(os.sched_getaffinity(0)))


def pytest_configure(config):
    only_gpu_tests = bool(config.args) and all(_inside_gpu_tests(arg) for arg in config.args)
    if not only_gpu_tests:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        import _interpreter

        _interpreter.install()


def _module_wide(item) -> bool:
    """Whether ``item`` uses a module- or package-scoped fixture (an sm_90 compile of every case,
    a gloo run shared by the module's tests)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "package")
                                    for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:  # a module-wide fixture runs once per worker: keep its module on one
        if _module_wide(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if GPU_TESTS in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def runner(tmp_path, monkeypatch):
    """click's CliRunner, the user database (AUTOSYMM_DB) in the test's own folder: a command run
    here never reads or writes the machine's."""
    from click.testing import CliRunner

    monkeypatch.setenv("AUTOSYMM_DB", str(tmp_path / "user.sqlite"))
    return CliRunner()

"""autosymm.backends.nccl_symm on the CPU: its gating on the NCCL in use, its eligibility, and
the checks made before any collective (the GPU test is tests/gpu/test_nccl_symm_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from autosymm.backends import get_backend
from autosymm.backends import nccl_symm as module
from autosymm.backends.base import BackendError, Capabilities, RunContext
from autosymm.problem import MODEL_SHAPES, Problem

CAPS = Capabilities(world_size=2, all_reduce_bytes=1 << 20, moe_bytes=1 << 20, intra_node=True,
                    compute_capability=(9, 0))


@pytest.fixture
def nccl_2_28(monkeypatch):
    monkeypatch.setattr(module, "nccl_version", lambda: (2, 28, 9))


def test_registered_under_its_name():
    assert get_backend("nccl_symm") is module.nccl_symm


def test_version_gate_names_the_nccl_in_use():
    assert module.version_reason((2, 27, 0)) is None and module.version_reason((2, 28, 9)) is None
    assert module.version_reason((2, 26, 5)) == ("NCCL 2.26.5 has no window registration "
                                                 "(symmetric kernels need NCCL >= 2.27.0)")
    assert module.version_reason(None) == "no NCCL in this torch build"


def test_nccl_version_is_none_without_nccl(monkeypatch):
    def missing():
        raise AttributeError("module 'torch._C' has no attribute '_nccl_version'")

    monkeypatch.setattr(torch.cuda.nccl, "version", missing)
    assert module.nccl_version() is None
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    assert module.nccl_version() == (2, 28, 9)


def test_serves_sums_that_fit_the_workspace_on_two_or_more_ranks(nccl_2_28):
    backend = module.nccl_symm
    for dtype in ("bf16", "fp16", "fp32"):
        assert backend.why_not(Problem.all_reduce(4096, dtype, 2), CAPS) is None
    assert backend.why_not(Problem.all_reduce(4096, "bf16", 8), CAPS, "graph") is None
    assert backend.why_not(Problem.all_reduce(1 << 20, "bf16", 2), CAPS) is None
    assert backend.why_not(Problem.all_reduce((1 << 20) + 1, "bf16", 2), CAPS) == (
        f"a {(1 << 20) + 256}-byte stage exceeds the {1 << 20}-byte all-reduce region")
    assert backend.why_not(Problem.all_reduce(4096, "bf16", 1), CAPS) == "one rank: nothing to exchange"
    assert backend.why_not(Problem.moe("dp_to_ep", MODEL_SHAPES["mixtral-8x7b"], 4), CAPS) == "does not serve dp_to_ep"
    no_workspace = Capabilities(world_size=2, intra_node=True)
    assert backend.why_not(Problem.all_reduce(4096), no_workspace) == "no symmetric workspace"
    assert backend.why_not(Problem.all_reduce(4096), Capabilities(2, all_reduce_bytes=1 << 20, intra_node=False)) == "group spans nodes"


def test_an_old_nccl_is_refused_with_its_version(monkeypatch):
    monkeypatch.setattr(module, "nccl_version", lambda: (2, 21, 5))
    reason = module.nccl_symm.why_not(Problem.all_reduce(4096), CAPS)
    assert reason == "NCCL 2.21.5 has no window registration (symmetric kernels need NCCL >= 2.27.0)"
    with pytest.raises(BackendError, match="nccl_symm: NCCL 2.21.5"):
        module.nccl_symm.prepare(Problem.all_reduce(4096), None, RunContext(group=object(), workspace=object()))


def test_prepare_needs_a_workspace_and_a_group(nccl_2_28):
    with pytest.raises(BackendError, match="needs the group's symmetric workspace"):
        module.nccl_symm.prepare(Problem.all_reduce(4096), None, RunContext(group=object(), workspace=None))
    with pytest.raises(BackendError, match="needs the group's symmetric workspace"):
        module.nccl_symm.prepare(Problem.all_reduce(4096), None, RunContext(group=None, workspace=object()))


def test_a_group_without_an_nccl_communicator_is_refused():
    gloo_like = SimpleNamespace(_get_backend=lambda device: SimpleNamespace())
    with pytest.raises(BackendError, match="exposes no _comm_ptr"):
        module.comm_pointer(gloo_like, torch.device("cpu"))
    assert not module.registered(gloo_like, torch.zeros(8, dtype=torch.uint8))


def test_the_library_is_the_one_loaded_or_the_soname():
    path = module.nccl_library()
    assert path == "libnccl.so.2" or "libnccl" in path

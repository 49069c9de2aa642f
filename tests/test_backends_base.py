"""autosymm.backends.base: the one eligibility contract and the one Capabilities builder."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from autosymm import spec
from autosymm.backends import STACK_PATHS, backend_names, get_backend
from autosymm.backends.base import Backend, Capabilities, Needs
from autosymm.backends.triton_moe import DEFAULT_MOE_CONFIG
from autosymm.problem import MODEL_SHAPES, Problem

CAPS = Capabilities(world_size=2, all_reduce_bytes=1 << 20, moe_bytes=256 << 20, intra_node=True,
                    torch_symm_ops=True, compute_capability=(9, 0))


def test_every_registered_backend_declares_needs_and_answers_why_not():
    problems = [Problem.all_reduce(4096), Problem.moe("dp_to_ep", MODEL_SHAPES["mixtral-8x7b"], 4)]
    for name in backend_names():
        backend = get_backend(name)
        assert isinstance(backend, Backend) and isinstance(backend.needs, Needs) and backend.name == name
        caps = replace(CAPS, stack=name) if name in STACK_PATHS else CAPS  # a stack's path: on its group
        for problem in problems:
            for mode in ("eager", "graph"):
                reason = backend.why_not(problem, caps, mode)
                assert (reason is None) == (name in problem.record.backends and not (
                    mode == "graph" and not backend.needs.graph_capturable) and backend.limits(problem, caps) is None
                    and not backend.needs.multicast)


def test_a_backend_serves_the_ops_whose_specs_list_it_and_their_entries_agree():
    for name in backend_names():
        entries = {record.backends[name] for record in spec.registered() if name in record.backends}
        assert len(entries) == (name != "noop"), (name, entries)  # noop: every op's, listed by none
    assert [record.name for record in spec.ALL if "triton_moe" in record.backends] == ["dp_to_ep", "ep_to_dp"]
    assert get_backend("triton_moe").serves(spec.EP_TO_DP) and not get_backend("triton_moe").serves(spec.ALL_REDUCE)
    clash = replace(spec.ALL_REDUCE, name="x", backends={**spec.ALL_REDUCE.backends, "triton_moe": "a.b:c"})
    with pytest.raises(ValueError, match=r"x lists backend\(s\) \['triton_moe'\] with other entries than dp_to_ep"):
        spec.register(clash)
    with pytest.raises(ValueError, match="reserved"):
        spec.register(replace(spec.ALL_REDUCE, name="x", backends={**spec.ALL_REDUCE.backends, "noop": "a.b:c"}))
    assert "x" not in spec.names()


def test_graph_mode_skips_backends_that_cannot_be_captured():
    problem = Problem.moe("ep_to_dp", MODEL_SHAPES["deepseek-v3"], 16)
    nccl = get_backend("nccl_all_to_all")
    assert nccl.why_not(problem, CAPS, "eager") is None
    assert nccl.why_not(problem, CAPS, "graph") == "not CUDA-graph capturable"
    with pytest.raises(ValueError, match="mode='bogus'"):
        nccl.why_not(problem, CAPS, "bogus")


def test_declared_needs_are_checked_generically():
    class Demanding(Backend):
        name = "demanding"
        needs = Needs(dtypes=("bf16",), workspace_region="moe", intra_node=True, torch_symm_ops=True, multicast=True,
                      min_compute_capability=(10, 0))

        def serves(self, record):
            return record.name == "all_reduce"

    backend, problem = Demanding(), Problem.all_reduce(4096)
    full = Capabilities(2, moe_bytes=1, has_multicast=True, torch_symm_ops=True, compute_capability=(10, 0))
    assert backend.why_not(problem, full) is None
    assert backend.why_not(Problem.all_reduce(4096, "fp16"), full) == "dtype fp16 (supports bf16)"
    cases = {"intra_node": (False, "group spans nodes"), "torch_symm_ops": (False, "ops unavailable"),
             "moe_bytes": (0, "no symmetric workspace"), "has_multicast": (False, "no multicast"),
             "compute_capability": ((9, 0), "needs sm_100+, got sm_90")}
    for field, (value, reason) in cases.items():
        caps = Capabilities(**{**full.__dict__, field: value})
        assert reason in backend.why_not(problem, caps), field


def test_capabilities_builder_from_a_workspace_offline_and_without():
    ws = SimpleNamespace(capacity=lambda region: {"all_reduce": 1024, "moe": 2048}[region], has_multicast=False)
    live = Capabilities.of(4, workspace=ws, compute_capability=(9, 0))
    assert (live.all_reduce_bytes, live.moe_bytes, live.has_multicast, live.compute_capability) == (1024, 2048, False,
                                                                                                    (9, 0))
    offline = Capabilities.of(8, region_bytes=(5, 6), intra_node=True)
    assert (offline.all_reduce_bytes, offline.moe_bytes, offline.torch_symm_ops, offline.has_multicast) == (5, 6, True,
                                                                                                            False)
    bare = Capabilities.of(16, intra_node=False)
    assert bare.region_bytes("all_reduce") == bare.region_bytes("moe") == 0 and not bare.intra_node


def test_each_backend_owns_its_fallback_config():
    problem = Problem.moe("dp_to_ep", MODEL_SHAPES["deepseek-v3"], 4)
    assert get_backend("triton_moe").fallback_config(problem) == DEFAULT_MOE_CONFIG
    assert all(get_backend(name).fallback_config(problem) is None for name in backend_names() if name != "triton_moe")
    for record in spec.ALL:
        assert record.fallback_order[-1] == record.fallback, "the op's always-serving backend ends the fallback order"


def test_base_imports_no_backend_module():
    """The backends import base, never the other way round (no import cycle)."""
    import ast
    from pathlib import Path

    import autosymm.backends.base as base

    tree = ast.parse(Path(base.__file__).read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1]
    assert imported == [], imported

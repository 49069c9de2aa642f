"""Backend ``flashinfer_fused`` (FlashInfer's fused all-reduce as a candidate of the fused op) on a
machine without FlashInfer or a GPU: every reason its why_not gives, its config space, the exact
arguments a launch hands FlashInfer's API, the workspace's lifetime, and a database row of it
passing the row validator and served by dispatch only where why_not is empty.

FlashInfer is not installed here, so :class:`FakeComm` stands in for ``flashinfer.comm``, installed
in ``sys.modules`` by name. It is a stand-in, not FlashInfer: its two functions copy the real
signatures (flashinfer/comm/allreduce.py:357-369 ``create_allreduce_fusion_workspace`` and
:547-582 ``allreduce_fusion``, commit fb28d72), record every call and check the argument names
(through the signature) and types; it computes nothing.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from autosymm.backends import Capabilities, RunContext, backend_names, get_backend
from autosymm.backends import flashinfer_fused as fi
from autosymm.backends.base import BackendError
from autosymm.configs import FlashInferFusedConfig, config_from_json, config_to_json
from autosymm.db.store import Row, TuningDB
from autosymm.db.read import DBSource
from autosymm.db.schema import checked_row
from autosymm.runtime.dispatch import decide
from autosymm.epilogue import Epilogue
from autosymm.problem import Problem

HW = "nvidia-h200-nvlink"
SM90 = Capabilities(2, compute_capability=(9, 0))
BACKEND = get_backend("flashinfer_fused")

#: allreduce_fusion's parameters in order (flashinfer/comm/allreduce.py:548-582).
REAL_FUSION_PARAMS = (
    "input", "workspace", "pattern", "launch_with_pdl", "trigger_completion_at_end", "output", "residual_out",
    "norm_out", "quant_out", "scale_out", "residual_in", "rms_gamma", "rms_eps", "scale_factor", "layout_code",
    "use_oneshot", "fp32_acc", "moe_reduction_device_num_experts", "moe_reduction_scale_input",
    "moe_reduction_active_experts_token_input", "moe_reduction_token_input", "expanded_idx_to_permuted_idx",
    "expert_scale_factor", "shared_expert_output", "block_quant_group_size", "weight_bias")
#: create_allreduce_fusion_workspace's parameters in order (allreduce.py:358-369).
REAL_WORKSPACE_PARAMS = ("backend", "world_size", "rank", "max_token_num", "hidden_dim", "dtype", "gpus_per_node",
                         "comm_backend", "force_oneshot_support", "group")
TENSOR_ARGS = ("output", "residual_out", "norm_out", "quant_out", "scale_out", "residual_in", "rms_gamma")


class AllReduceFusionPattern:
    """The pattern codes (flashinfer/comm/trtllm_ar.py:68-98), the ones this backend uses."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormDynamicFP8Quant = 10


class QuantizationSFLayout:
    """flashinfer/comm/trtllm_ar.py:100-116."""

    SWIZZLED_128x4 = 0
    SWIZZLED_8x4 = 1
    LINEAR = 2


class FakeWorkspace:
    """A TRTLLMAllReduceFusionWorkspace's surface (allreduce.py:109-274): backend, the size check, destroy."""

    def __init__(self, backend: str, world_size: int, max_token_num: int, hidden_dim: int, dtype) -> None:
        self.backend, self.world_size, self.max_token_num, self.hidden_dim = backend, world_size, max_token_num, hidden_dim
        self.use_fp32_lamport = dtype == torch.float32
        self.destroyed = False

    def is_buffer_size_sufficient(self, tp_size, num_tokens, hidden_dim, dtype, use_oneshot=None) -> bool:
        # check_trtllm_allreduce_fusion_workspace_metadata (trtllm_ar.py:989-1034)
        return (tp_size == self.world_size and num_tokens * hidden_dim <= self.max_token_num * self.hidden_dim
                and self.use_fp32_lamport == (dtype == torch.float32))

    def destroy(self) -> None:
        self.destroyed = True


class FakeComm(types.ModuleType):
    """Stand-in for ``flashinfer.comm`` (module docstring): records calls, checks names and types."""

    AllReduceFusionPattern = AllReduceFusionPattern
    QuantizationSFLayout = QuantizationSFLayout

    def __init__(self, workspace_backend: str = "trtllm") -> None:
        super().__init__("flashinfer.comm")
        self.fusion_calls: list[dict] = []
        self.workspaces: list[tuple[dict, FakeWorkspace]] = []
        self.workspace_backend = workspace_backend
        self.allreduce_fusion = self._allreduce_fusion
        self.create_allreduce_fusion_workspace = self._create_workspace

    def _create_workspace(self, backend="auto", world_size=None, rank=None, max_token_num=None, hidden_dim=None,
                          dtype=None, gpus_per_node=None, comm_backend=None, force_oneshot_support=False, group=None):
        kwargs = dict(backend=backend, world_size=world_size, rank=rank, max_token_num=max_token_num,
                      hidden_dim=hidden_dim, dtype=dtype, group=group)
        assert isinstance(backend, str) and isinstance(world_size, int) and isinstance(rank, int)
        assert isinstance(max_token_num, int) and isinstance(hidden_dim, int) and isinstance(dtype, torch.dtype)
        workspace = FakeWorkspace(self.workspace_backend, world_size, max_token_num, hidden_dim, dtype)
        self.workspaces.append((kwargs, workspace))
        return workspace

    def _allreduce_fusion(self, input, workspace, pattern, launch_with_pdl=False, trigger_completion_at_end=True,
                          output=None, residual_out=None, norm_out=None, quant_out=None, scale_out=None,
                          residual_in=None, rms_gamma=None, rms_eps=1e-6, scale_factor=None, layout_code=None,
                          use_oneshot=None, fp32_acc=False, moe_reduction_device_num_experts=None,
                          moe_reduction_scale_input=None, moe_reduction_active_experts_token_input=None,
                          moe_reduction_token_input=None, expanded_idx_to_permuted_idx=None, expert_scale_factor=None,
                          shared_expert_output=None, block_quant_group_size=None, weight_bias=0.0):
        call = {name: value for name, value in locals().items() if name != "self"}
        assert isinstance(input, torch.Tensor) and isinstance(workspace, FakeWorkspace) and not workspace.destroyed
        assert type(pattern) is int and type(launch_with_pdl) is bool and type(trigger_completion_at_end) is bool
        assert type(fp32_acc) is bool and (use_oneshot is None or type(use_oneshot) is bool)
        assert all(call[name] is None or isinstance(call[name], torch.Tensor) for name in TENSOR_ARGS)
        assert type(rms_eps) is float and type(weight_bias) is float
        assert scale_factor is None or isinstance(scale_factor, (torch.Tensor, float))
        assert layout_code is None or type(layout_code) is int
        self.fusion_calls.append(call)
        return quant_out if quant_out is not None else norm_out


@pytest.fixture
def comm(monkeypatch):
    """A FakeComm as ``flashinfer.comm`` (and a bare ``flashinfer`` package), on a 1-process gloo
    default group (the workspace asks for this rank); workspaces forgotten after."""
    fake = FakeComm()
    package = types.ModuleType("flashinfer")
    package.comm = fake
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", fake)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield fake
    fi.close_all()
    if started:
        dist.destroy_process_group()


@pytest.fixture
def no_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    monkeypatch.delitem(sys.modules, "flashinfer.comm", raising=False)


def _problem(tokens: int = 16, hidden: int = 4096, dtype: str = "bf16", world_size: int = 2,
             epilogue: Optional[Epilogue] = None) -> Problem:
    return Problem.all_reduce_rmsnorm(tokens, hidden, dtype, world_size, epilogue=epilogue)


def test_the_fake_has_the_real_signatures():
    fake = FakeComm()
    assert tuple(inspect.signature(fake.allreduce_fusion).parameters) == REAL_FUSION_PARAMS
    assert tuple(inspect.signature(fake.create_allreduce_fusion_workspace).parameters) == REAL_WORKSPACE_PARAMS


def test_registered_for_the_fused_op_only():
    assert "flashinfer_fused" in backend_names()
    from autosymm import spec

    assert [r.name for r in spec.ALL if BACKEND.serves(r)] == ["all_reduce_rmsnorm"] and not BACKEND.batch_invariant
    assert BACKEND.why_not(Problem.all_reduce(4096), SM90) == "does not serve all_reduce"


def test_without_flashinfer_it_says_so(no_flashinfer):
    assert BACKEND.why_not(_problem(), SM90).startswith("flashinfer not importable (ModuleNotFoundError")


def test_a_flashinfer_without_the_fused_api_is_refused(comm, monkeypatch):
    monkeypatch.delattr(comm, "create_allreduce_fusion_workspace")
    assert BACKEND.why_not(_problem(), SM90) == ("flashinfer.comm has no create_allreduce_fusion_workspace "
                                                 "(a FlashInfer without the fused all-reduce API)")


@pytest.mark.parametrize("caps, mode, reason", [
    (Capabilities(2), "eager", "not CUDA (no GPU compute capability on this group)"),
    (Capabilities(2, compute_capability=(8, 0)), "eager", "needs sm_90+, got sm_80"),
    (Capabilities(2, intra_node=False, compute_capability=(9, 0)), "eager", "group spans nodes"),
    (SM90, "graph", None),
    (Capabilities(2, compute_capability=(10, 0)), "eager", None),
])
def test_device_and_group_reasons(comm, caps, mode, reason):
    assert BACKEND.why_not(_problem(), caps, mode) == reason


@pytest.mark.parametrize("problem, reason", [
    (_problem(world_size=3), "world size 3 (FlashInfer's fused kernels serve (2, 4, 8, 16))"),
    (_problem(world_size=32), "world size 32 (FlashInfer's fused kernels serve (2, 4, 8, 16))"),
    (_problem(hidden=4100), "hidden 4100 is not a multiple of 8 elements (FlashInfer loads 16 bytes per access)"),
    (_problem(hidden=4098, dtype="fp32"), "hidden 4098 is not a multiple of 4 elements (FlashInfer loads 16 bytes per access)"),
    (_problem(hidden=4096, dtype="fp32", epilogue=Epilogue(quant="nvfp4")),
     "quant='nvfp4' with fp32 x (FlashInfer's FP4 patterns take fp16/bf16)"),
    (_problem(world_size=8, tokens=1), None),
    (_problem(world_size=16, dtype="fp16", epilogue=Epilogue(residual=False, gemma=True)), None),
])
def test_shape_reasons(comm, problem, reason):
    assert BACKEND.why_not(problem, Capabilities(problem.world_size, compute_capability=(9, 0))) == reason


def test_patterns_and_weight_bias_the_installed_flashinfer_lacks(comm, monkeypatch):
    monkeypatch.delattr(AllReduceFusionPattern, "kARResidualRMSNormDynamicFP8Quant")
    assert BACKEND.why_not(_problem(epilogue=Epilogue(quant="fp8_per_token")), SM90) == \
        "this FlashInfer has no AllReduceFusionPattern.kARResidualRMSNormDynamicFP8Quant (quant='fp8_per_token')"
    assert BACKEND.why_not(_problem(epilogue=Epilogue(quant="fp8")), SM90) is None

    def old_fusion(input, workspace, pattern, launch_with_pdl=False, residual_in=None, rms_gamma=None):
        raise AssertionError("not called")

    monkeypatch.setattr(comm, "allreduce_fusion", old_fusion)
    assert BACKEND.why_not(_problem(epilogue=Epilogue(gemma=True)), SM90) == \
        "gemma=True, but this FlashInfer's allreduce_fusion has no weight_bias"
    assert BACKEND.why_not(_problem(), SM90) is None


def test_no_strategy_fits(comm, monkeypatch):
    monkeypatch.setattr(fi, "MAX_COMM_SIZE", 1024)
    assert BACKEND.why_not(_problem(tokens=2), SM90) == \
        "2 tokens: two-shot needs more than 2 (the ranks) and one-shot's 32768 B Lamport buffer exceeds 1024 B"
    assert BACKEND.search_space(_problem(tokens=3)) == [FlashInferFusedConfig(False, True),
                                                          FlashInferFusedConfig(False, False)]


def test_config_space():
    assert BACKEND.search_space(_problem(tokens=16)) == [FlashInferFusedConfig(o, a) for o in (True, False)
                                                          for a in (True, False)]
    assert BACKEND.search_space(_problem(tokens=2)) == [FlashInferFusedConfig(True, True),
                                                         FlashInferFusedConfig(True, False)]  # two-shot: tokens > W
    # 8 x 65536 x 8192 x 2 B: over FlashInfer's one-shot Lamport cap, so only two-shot
    assert fi.strategies(_problem(tokens=65536, hidden=8192, world_size=8)) == (False,)
    assert BACKEND.search_space(_problem(dtype="fp32")) == [FlashInferFusedConfig(True, True),
                                                             FlashInferFusedConfig(False, True)]
    assert BACKEND.fallback_config(_problem()) is None
    for config in BACKEND.search_space(_problem()):
        assert config_from_json(config_to_json(config)) == config
    with pytest.raises(ValueError, match="use_oneshot=1 must be a bool"):
        FlashInferFusedConfig(use_oneshot=1, fp32_acc=True)


def _tensors(tokens: int = 16, hidden: int = 64, dtype=torch.bfloat16):
    return (torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype), torch.randn(hidden).to(dtype),
            torch.tensor(0.5, dtype=torch.float32))


COMMON = dict(launch_with_pdl=False, trigger_completion_at_end=True, output=None, moe_reduction_device_num_experts=None,
              moe_reduction_scale_input=None, moe_reduction_active_experts_token_input=None,
              moe_reduction_token_input=None, expanded_idx_to_permuted_idx=None, expert_scale_factor=None,
              shared_expert_output=None, block_quant_group_size=None)


@pytest.mark.parametrize("epilogue, pattern", [
    (Epilogue(), 1), (Epilogue(gemma=True), 1), (Epilogue(residual=False), 1), (Epilogue(residual=False, gemma=True), 1),
    (Epilogue(quant="fp8"), 2), (Epilogue(residual=False, quant="fp8"), 2), (Epilogue(quant="nvfp4"), 3),
    (Epilogue(residual=False, quant="nvfp4"), 3), (Epilogue(quant="fp8_per_token"), 10),
], ids=lambda e: getattr(e, "key", None) or str(e))
def test_a_launch_maps_onto_allreduce_fusion(comm, epilogue, pattern):
    problem = _problem(tokens=16, hidden=64, epilogue=epilogue)
    config = FlashInferFusedConfig(use_oneshot=False, fp32_acc=True)
    launcher = BACKEND.prepare(problem, config, RunContext())
    x, residual, weight, scale = _tensors()
    x_before, residual_before = x.clone(), residual.clone()
    scale = scale if epilogue.needs_scale else None
    result = launcher(x, residual if epilogue.residual else None, weight, 1e-5, scale=scale)
    (call,) = comm.fusion_calls
    (_, workspace), = comm.workspaces
    outputs = result if isinstance(result, tuple) else (result,)
    want = dict(COMMON, input=x, workspace=workspace, pattern=pattern, rms_gamma=weight, rms_eps=1e-5,
                scale_factor=scale, use_oneshot=False, fp32_acc=True,
                layout_code=QuantizationSFLayout.SWIZZLED_128x4 if epilogue.quant == "nvfp4" else None,
                weight_bias=1.0 if epilogue.gemma else 0.0)
    assert {k: v for k, v in call.items() if k in want} == want
    if epilogue.residual:  # added and written in place, as vLLM passes it
        assert call["residual_in"] is residual and call["residual_out"] is residual
    else:  # vLLM's no-residual form: a zero residual; the pre-norm sum into scratch, never into x
        assert torch.equal(call["residual_in"], torch.zeros_like(x)) and call["residual_out"] is not x
    if epilogue.quant is None:
        assert outputs == (call["norm_out"],) and call["quant_out"] is None and call["scale_out"] is None
    else:
        assert outputs[0] is call["quant_out"] and outputs[0].dtype == epilogue.out_dtype(x.dtype)
        assert tuple(outputs[0].shape) == epilogue.out_shape(16, 64)
        assert (call["norm_out"] is None) == (epilogue.quant == "fp8_per_token")
    if epilogue.has_scales:
        assert outputs[1] is call["scale_out"] and tuple(outputs[1].shape) == epilogue.scales_shape(16, 64)
    else:
        assert len(outputs) == 1
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # the fake computes nothing


def test_config_none_runs_vllms_settings(comm):
    launcher = BACKEND.prepare(_problem(hidden=64), None, RunContext())
    x, residual, weight, _ = _tensors()
    launcher(x, residual, weight)
    (call,) = comm.fusion_calls
    assert call["use_oneshot"] is None and call["fp32_acc"] is True and call["rms_eps"] == 1e-6


def test_workspace_is_collective_once_per_group_sized_up_and_freed(comm):
    from autosymm import api

    BACKEND.prepare(_problem(tokens=16, hidden=64), None, RunContext())
    BACKEND.prepare(_problem(tokens=100, hidden=64, epilogue=Epilogue(quant="fp8")), None, RunContext())
    (kwargs, first), = comm.workspaces
    assert kwargs == dict(backend="trtllm", world_size=2, rank=0, max_token_num=128, hidden_dim=64,
                          dtype=torch.bfloat16, group=None)
    BACKEND.prepare(_problem(tokens=300, hidden=64), None, RunContext())  # beyond 128 rows: a larger one
    assert first.destroyed and comm.workspaces[1][0]["max_token_num"] == 512
    BACKEND.prepare(_problem(tokens=16, hidden=64, dtype="fp32"), None, RunContext())  # fp32: its own
    assert len(comm.workspaces) == 3
    api.reset()
    assert all(workspace.destroyed for _, workspace in comm.workspaces)


def test_a_multicast_workspace_is_refused(comm):
    comm.workspace_backend = "mnnvl"
    with pytest.raises(BackendError, match="'trtllm' \\(multicast-free\\) workspace, got 'mnnvl'"):
        BACKEND.prepare(_problem(hidden=64), None, RunContext())
    assert comm.workspaces[0][1].destroyed and not fi._WORKSPACES


def test_no_workspace_is_created_inside_a_graph_capture(comm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(BackendError, match="inside a CUDA-graph capture; make the call once eagerly first"):
        BACKEND.prepare(_problem(hidden=64), None, RunContext())
    assert comm.workspaces == []


def test_prepare_without_flashinfer_raises(no_flashinfer):
    with pytest.raises(BackendError, match="flashinfer_fused: flashinfer not importable"):
        BACKEND.prepare(_problem(), None, RunContext())


def _row(**changes) -> Row:
    fields = dict(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=64,
                  shape="h8192", backend="flashinfer_fused", mode="graph", median_us=9.0, nccl_us=30.0,
                  config=FlashInferFusedConfig(use_oneshot=True, fp32_acc=True))
    fields.update(changes)
    return Row(**fields)


def test_a_row_of_it_passes_the_row_validator():
    row = checked_row(_row().to_dict())
    assert row.backend == "flashinfer_fused" and row.config_obj == FlashInferFusedConfig(True, True)
    with pytest.raises(ValueError, match="config type FlashInferFusedConfig does not belong to op 'all_reduce'"):
        checked_row(_row(op="all_reduce", shape="", bucket=4096).to_dict())
    with pytest.raises(ValueError, match="backend flashinfer_fused does not serve op 'all_reduce'"):
        checked_row(_row(op="all_reduce", shape="", bucket=4096, config=None).to_dict())


def _decide(caps: Capabilities):
    db = TuningDB(":memory:")
    db.record_many([_row()])
    return decide(Problem.all_reduce_rmsnorm(64, 8192, "bf16", 2), "graph", caps, [DBSource(db, "fi.sqlite")], HW)


def test_dispatch_serves_the_row_only_where_why_not_is_empty(comm):
    served = _decide(SM90)
    assert served.backend == "flashinfer_fused" and served.config == FlashInferFusedConfig(True, True)
    refused = _decide(Capabilities(2, compute_capability=(8, 0)))
    assert refused.backend == "nccl_fused" and any("sm_90" in text for text in refused.skipped)


def test_dispatch_without_flashinfer_falls_back(no_flashinfer):
    decision = _decide(SM90)
    assert decision.backend == "nccl_fused" and any("flashinfer not importable" in text for text in decision.skipped)


def test_the_tuner_times_it_beside_the_triton_and_nccl_candidates(comm):
    from autosymm.tuning.session import _load_backends
    from autosymm.tuning.sweep import candidates_for

    backends, _ = _load_backends(None)
    caps = Capabilities(2, all_reduce_bytes=1 << 24, compute_capability=(9, 0))
    problem = _problem(tokens=16, hidden=4096)
    candidates, why_not = candidates_for(problem, "graph", backends, caps)
    assert candidates["flashinfer_fused"] == BACKEND.search_space(problem)
    assert "nccl_fused" in candidates and any(name.startswith("triton_fused") for name in candidates)
    candidates, why_not = candidates_for(problem, "graph", backends, Capabilities(2, all_reduce_bytes=1 << 24))
    assert "flashinfer_fused" not in candidates and why_not["flashinfer_fused"].startswith("not CUDA")


def test_the_tuner_lists_why_without_flashinfer(no_flashinfer):
    from autosymm.tuning.session import _load_backends
    from autosymm.tuning.sweep import candidates_for

    backends, unavailable = _load_backends(None)
    assert "flashinfer_fused" in backends and "flashinfer_fused" not in unavailable
    _, why_not = candidates_for(_problem(), "eager", backends, SM90)
    assert why_not["flashinfer_fused"].startswith("flashinfer not importable")

"""autosymm's SGLang plugin against SGLang 0.5.23's own modules on 2 gloo ranks: SGLang's
``load_plugins()`` finds autosymm's entry point and applies its hooks; the patched
``dispatch_custom_allreduce`` builds SGLang's real ``CustomAllReduceV2`` with autosymm first in it,
so SGLang's own ``isinstance(ca_comm, CustomAllReduceV2)`` checks hold (called in SGLang's code:
the K3 all-reduce fusion probe, the fused MoE finalize registration, the Muse Spark GEMM +
all-gather gate); V2's own methods keep their signatures; autosymm serves where its decision is not
NCCL and V2 (or SGLang's next path) where it declines; ``close()`` stops both.

Stand-ins, where SGLang needs a GPU: the device query behind V2's tuned table (SGLang's own sm90
table for 132 SMs, an H200's, is used), V2's NVLink topology probe (``can_use_custom_all_reduce_v2``
answers True), its symmetric-memory workspace (``_init_workspace`` builds CPU tensors of the same
layout; ``obj`` is a marker), its cudaIPC manager, CUDA's stream-capture query (False) and its JIT kernel launch
(``custom_all_reduce_v2.custom_all_reduce`` records), and the CUDA check of
``dispatch_custom_allreduce`` (``_is_cuda``). The fused kernels' ``register_comm`` record what
SGLang hands them."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types

import pytest
import stubs
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo

stubs.require_real_sources()

CPU = torch.device("cpu")


@pytest.fixture
def installed_metadata(tmp_path):
    """A distribution's metadata declaring autosymm's ``sglang.srt.plugins`` entry point, as
    pyproject.toml does (the editable install on this machine is another checkout's)."""
    info = tmp_path / "meta" / "autosymm_under_test-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: autosymm-under-test\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nautosymm = autosymm.integrations.sglang_plugin:register\n")
    return info.parent


class _CpuIpcManager:
    """V2's cudaIPC handle manager (a tvm-ffi object over the CUDA runtime), standing in."""

    def __init__(self):
        self.destroyed = False

    def destroy(self):
        self.destroyed = True


def _cpu_workspace(self):
    """V2's ``_init_workspace`` on the CPU: the same push slots and counters, a marker for the
    communicator handle the kernels take, multicast on (what an NVSwitch node reports)."""
    self._push_counter = torch.zeros((self.config.num_push_blocks,), dtype=torch.uint32)
    self._push_workspaces = [torch.zeros(2 * self.world_size, self.max_push_size, dtype=torch.uint8)]
    self.has_multicast = True
    self.obj = ("communicator", self.rank)


def _v2_on_cpu(launches):
    """SGLang's V2 module with the GPU-only pieces above standing in; ``launches`` records kernel calls."""
    from sglang.srt.distributed.device_communicators import custom_all_reduce as ca
    from sglang.srt.distributed.device_communicators import custom_all_reduce_v2 as v2
    from sglang.srt.distributed.device_communicators.configs import custom_all_reduce_v2 as tuned

    ca._is_cuda = True
    torch.cuda.is_current_stream_capturing = lambda: False  # a CPU build of torch raises instead: no stream captures
    tuned._get_all_reduce_configs = lambda: tuned._sm90_configs(132)  # SGLang's own H200 table (sm90, 132 SMs)
    v2.can_use_custom_all_reduce_v2 = lambda group, device: True
    v2.CustomAllReduceV2._init_workspace = _cpu_workspace
    v2.IPCManager = _CpuIpcManager
    v2.custom_all_reduce = lambda obj, input, **kwargs: launches.append((obj, kwargs["algo"])) or input.neg()
    return ca, v2


def _load_plugins(metadata_dir):
    """SGLang's own load_plugins(), finding autosymm's entry point in ``metadata_dir``."""
    sys.path.insert(0, metadata_dir)
    importlib.invalidate_caches()
    from sglang.srt import plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    from autosymm.integrations import sglang_plugin

    plugins.load_plugins()
    hooks = {target: [(hook, source.plugin_name) for _, hook, source in HookRegistry._hooks[target]]
             for target in (sglang_plugin.CA_DISPATCH, sglang_plugin.FUSED)}
    assert hooks == {sglang_plugin.CA_DISPATCH: [(sglang_plugin.dispatch_custom_allreduce, "autosymm")],
                     sglang_plugin.FUSED: [(sglang_plugin.fused_allreduce_residual_rmsnorm, "autosymm")]}


def _build_slot(ca, v2, cpu_group):
    """What GroupCoordinator.__init__ does (srt/distributed/parallel_state.py:505-512)."""
    factory = ca.dispatch_custom_allreduce(group=cpu_group, device=CPU)
    assert isinstance(factory, __import__("functools").partial)  # the AROUND hook's factory
    slot = factory(group=cpu_group, device=CPU)
    assert isinstance(slot, v2.CustomAllReduceV2) and type(slot).__name__ == "AutosymmCustomAllReduceV2"
    assert not slot.disabled and slot.has_multicast and slot.world_size == 2
    return slot


def _v2_methods_unshadowed(v2, slot):
    cls, base = type(slot), v2.CustomAllReduceV2
    overridden = {"should_custom_ar", "custom_all_reduce", "capture", "close"}
    assert overridden | {"fused_allreduce_rmsnorm"} == {n for n in vars(cls) if not n.startswith("__")}
    for name in overridden:
        assert inspect.signature(getattr(cls, name)) == inspect.signature(getattr(base, name)), name
    assert slot.max_size == max(slot.max_pull_size, slot.max_push_size)  # V2's own, not autosymm's
    assert slot.autosymm.max_size is None


@contextlib.contextmanager
def _tp_group(slot, cpu_group, rank):
    """SGLang's parallel context with a TP group whose slot is ``slot`` (its own override API)."""
    from sglang.srt.runtime_context import get_parallel

    coordinator = types.SimpleNamespace(ca_comm=slot, cpu_group=cpu_group, world_size=2, rank_in_group=rank)
    with get_parallel().override(tp_size=2, tp_group=coordinator, attn_tp_group=coordinator, attn_tp_size=2,
                                 attn_tp_rank=rank):
        yield coordinator


def _isinstance_paths(slot, cpu_group, rank):
    """SGLang's own V2 gates, called with the plugin's slot: each takes V2's path."""
    from sglang.kernels.ops.communication import all_reduce_fusion, all_reduce_residual
    from sglang.kernels.ops.communication.muse_spark_all_gather import gemm_ag_supported
    from sglang.srt.layers.communication import k3_ar_fusion

    from autosymm.integrations.custom_all_reduce import AutosymmCustomAllReduce

    registered = []
    all_reduce_residual.register_comm = all_reduce_fusion.register_comm = registered.append
    x, weight = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert gemm_ag_supported(slot, x, weight)
    beside = AutosymmCustomAllReduce.beside(slot.autosymm, slot)  # a slot that is not a V2: the gate closes
    assert not gemm_ag_supported(beside, x, weight)
    with _tp_group(slot, cpu_group, rank):
        state = k3_ar_fusion._get_state.__wrapped__()  # SGLANG_K3_AR_FUSION=1 (the env)
        assert state is not None and state.comm is slot and state.world_size == 2
    assert registered == [slot.obj]


def _serving(slot, v2, launches, rank):
    from sglang.kernels.ops.communication.all_reduce import AllReduceAlgo
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    odd = torch.full((5,), float(rank + 1))  # 20 bytes: V2 declines (not a multiple of 16), autosymm's is NCCL
    assert not slot.should_custom_ar(odd)
    with adapter_decisions():
        assert slot.should_custom_ar(odd)
        assert torch.equal(slot.custom_all_reduce(odd), torch.full((5,), 3.0))  # autosymm's sum
        with slot.capture():
            assert slot.autosymm._mode() == "graph" and slot._graph_mode_allowed  # both captures entered
    assert slot._capture_started and not slot._graph_mode_allowed
    slot.override_algo = AllReduceAlgo.ONE_SHOT_PUSH  # V2 accepts what fits its workspace
    x = torch.ones(64)
    assert slot.should_custom_ar(x) and torch.equal(slot.custom_all_reduce(input=x), -x)  # V2's own launch
    assert launches == [(slot.obj, AllReduceAlgo.ONE_SHOT_PUSH)]
    # SGLang's ROCm reduce-scatter probe asks hasattr(ca_comm, "reduce_scatter") and then calls
    # reduce_scatter(input, output, registered=...): V2 has none, and autosymm adds none
    assert not GroupCoordinator._has_aiter_custom_reduce_scatter(types.SimpleNamespace(ca_comm=slot))


def _body(rank, world_size, metadata_dir):
    import torch.distributed as dist

    launches = []
    ca, v2 = _v2_on_cpu(launches)
    _load_plugins(metadata_dir)
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
    slot = _build_slot(ca, v2, cpu_group)
    _v2_methods_unshadowed(v2, slot)
    _isinstance_paths(slot, cpu_group, rank)
    _serving(slot, v2, launches, rank)
    ipc = slot._ipc_manager
    slot.close()
    assert slot.autosymm.stopped and ipc.destroyed and not hasattr(slot, "obj")  # autosymm's, then V2's close
    return True


def test_sglang_plugin_keeps_custom_all_reduce_v2(tmp_path, installed_metadata):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "SGLANG_PLUGINS": "autosymm",
                   "SGLANG_K3_AR_FUSION": "1"}}
    assert run_gloo(_body, 2, str(installed_metadata), env=env, deadline_s=240) == {0: True, 1: True}


def _declines(rank, world_size):
    """A V2 that SGLang finds unusable (disabled) or cannot build: autosymm's standalone slot, which
    SGLang's V2 gates skip exactly as they skip a disabled V2."""
    import torch.distributed as dist

    from autosymm.integrations import sglang_plugin
    from autosymm.integrations.custom_all_reduce import AutosymmCustomAllReduce

    _, v2 = _v2_on_cpu([])
    v2.can_use_custom_all_reduce_v2 = lambda group, device: False
    cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
    slot = sglang_plugin.build(v2.CustomAllReduceV2, cpu_group, CPU)
    assert isinstance(slot, AutosymmCustomAllReduce) and slot.fallback.disabled and not slot.disabled
    x = torch.full((64,), float(rank + 1))
    assert not slot.should_custom_ar(x) and slot.custom_all_reduce(x) is None  # gloo: SGLang's NCCL path
    with adapter_decisions():
        assert torch.equal(slot.custom_all_reduce(x), torch.full((64,), 3.0))
    alone = sglang_plugin.build(_Broken, cpu_group, CPU)
    assert isinstance(alone, AutosymmCustomAllReduce) and alone.fallback is None
    return True


class _Broken:
    def __init__(self, group, device):
        raise RuntimeError("no custom all-reduce library")


def test_sglang_plugin_declines_to_a_standalone_slot(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert run_gloo(_declines, 2, env=env, deadline_s=180) == {0: True, 1: True}


def test_every_v2_isinstance_check_is_gated_by_what_the_slot_keeps():
    """The 7 sites of issue #29 in SGLang's sources: each ``isinstance(..., CustomAllReduceV2)``
    is followed only by reads of V2's own state (``disabled``, ``max_size``, ``has_multicast``,
    ``obj``, ...), which the in-place slot leaves V2's."""
    import pathlib
    import re

    import sglang

    root = pathlib.Path(sglang.__file__).parent / "srt"
    sites = {"layers/dp_attention.py": 240, "layers/communication/k3_ar_fusion.py": 94,
             "layers/communication/k3_sp_collective.py": 69,
             "layers/quantization/mxfp4_flashinfer_trtllm_moe.py": 597, "layers/moe/qwen4_decode.py": 64,
             "models/beam.py": 1112, "models/muse_spark.py": 1133}
    autosymm_names = {"autosymm", "serves", "serves_fused", "serves_all_gather", "serves_reduce_scatter"}
    for path, line in sites.items():
        lines = (root / path).read_text().splitlines()
        assert "isinstance(" in lines[line - 1] and "CustomAllReduceV2)" in lines[line - 1], (path, line)
        window = "\n".join(lines[line - 1:line + 12])
        read = set(re.findall(r"\b(?:comm|tp_comm)\.(\w+)", window))
        assert read and not read & autosymm_names, (path, read)


def test_sglangs_deterministic_inference_is_its_own_path():
    """SGLang's deterministic inference on CUDA turns off what autosymm's hooks sit in: its
    FlashInfer all-reduce fusion backend (arg_groups/overrides.py:1062) and, at TP > 1, its custom
    all-reduce (arg_groups/attention_hook.py:683), so neither hook is reached and SGLang's own
    path serves; with the environment variable alone the slot reads only batch-invariant rows."""
    import types
    from pathlib import Path

    import sglang
    from sglang.srt.arg_groups import overrides

    from autosymm.integrations import sglang_plugin

    view = types.SimpleNamespace(enable_deterministic_inference=True, flashinfer_allreduce_fusion_backend="auto")
    assert overrides._deterministic_allreduce_fusion_disable(view) == {"flashinfer_allreduce_fusion_backend": None}
    # attention_hook imports torchvision (not here): its text, the CUDA branch at TP > 1
    source = (Path(sglang.__file__).parent / "srt" / "arg_groups" / "attention_hook.py").read_text()
    handler = source[source.index("def handle_deterministic_inference"):]
    assert "disable_custom_all_reduce=True" in handler and "_deterministic_allreduce_fusion_disable" in handler
    from sglang.srt.environ import envs

    with envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.override(True):
        assert sglang_plugin._deterministic() is True
    assert sglang_plugin._deterministic() is None

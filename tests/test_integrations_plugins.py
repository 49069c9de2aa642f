"""The vLLM and SGLang plugins: they import without either stack, their entry points (as
pyproject.toml declares them) load through importlib.metadata (and through vLLM's own loader
where vLLM imports), and on 2 gloo ranks the hooks they install put autosymm first and fall back
to the stack's own path where autosymm's decision is NCCL."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import tempfile
import traceback
import types
from pathlib import Path

import pytest
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_with_deadline

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {"vllm.platform_plugins": "autosymm.integrations.vllm_plugin:platform_plugin",
          "sglang.srt.plugins": "autosymm.integrations.sglang_plugin:register"}


def _declared() -> dict[str, dict[str, str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]


def test_pyproject_declares_both_entry_points():
    declared = _declared()
    for group, value in GROUPS.items():
        assert declared[group] == {"autosymm": value}
        module, attr = value.split(":")
        assert callable(getattr(importlib.import_module(module), attr))


def test_plugin_modules_import_without_the_stacks():
    from autosymm.integrations import sglang_plugin, vllm_plugin

    assert "vllm" not in sys.modules and "sglang" not in sys.modules
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        vllm_plugin.Nope  # noqa: B018
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ModuleNotFoundError, match="vllm"):
            vllm_plugin.platform_plugin()
    if importlib.util.find_spec("sglang") is None:
        with pytest.raises(ModuleNotFoundError, match="sglang"):
            sglang_plugin.register()


@pytest.fixture
def installed_metadata(tmp_path, monkeypatch):
    """This worktree's entry points as an installed distribution's metadata (the editable
    install on this machine is another checkout's)."""
    info = tmp_path / "autosymm_plugins_under_test-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: autosymm-plugins-under-test\nVersion: 0.0\n")
    lines = []
    for group, entries in _declared().items():
        lines += [f"[{group}]"] + [f"{name} = {value}" for name, value in entries.items()] + [""]
    (info / "entry_points.txt").write_text("\n".join(lines))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path


def test_entry_points_load_through_importlib_metadata(installed_metadata):
    from autosymm.integrations import sglang_plugin, vllm_plugin

    want = {"vllm.platform_plugins": vllm_plugin.platform_plugin, "sglang.srt.plugins": sglang_plugin.register}
    for group, function in want.items():
        ours = [ep for ep in importlib.metadata.entry_points(group=group)
                if ep.dist is not None and ep.dist.name == "autosymm-plugins-under-test"]
        assert [ep.name for ep in ours] == ["autosymm"]
        assert ours[0].load() is function


def test_vllms_own_loader_finds_the_platform_plugin(installed_metadata, monkeypatch):
    """With vLLM importable (its wheel; the CPU has no CUDA): vLLM's loader finds the plugin,
    which declines where vLLM's CUDA platform does not activate."""
    plugins = pytest.importorskip("vllm.plugins")
    from autosymm.integrations import vllm_plugin

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    found = plugins.load_plugins_by_group("vllm.platform_plugins")
    assert found["autosymm"] is vllm_plugin.platform_plugin
    assert found["autosymm"]() is None  # no CUDA here: vLLM's CUDA platform does not activate either


class _StackCA:
    """The stack's own custom all-reduce, standing in: serves numel 8, gathers by repeating."""

    fully_connected = True

    def __init__(self, group=None, device=None):
        self.group, self.device = group, device

    def should_custom_ar(self, x):
        return x.numel() == 8

    def custom_all_reduce(self, x):
        return torch.full_like(x, -1.0)

    def custom_all_gather(self, x):
        return x.repeat(2)


class _Broken:
    def __init__(self, group=None, device=None):
        raise RuntimeError("no custom all-reduce library")


def _target(rank, world_size, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      AUTOSYMM_DB=os.path.join(tempfile.mkdtemp(), "absent.sqlite"))
    import torch.distributed as dist

    import autosymm

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cpu_group = dist.new_group(list(range(world_size)), backend="gloo")
        queue.put((rank, {"vllm": _vllm(rank, world_size, cpu_group), "sglang": _sglang(rank, world_size, cpu_group)},
                   None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        autosymm.reset()
        dist.barrier()
        dist.destroy_process_group()


def _vllm(rank, world_size, cpu_group):
    import torch.distributed as dist

    from autosymm.integrations import vllm_plugin

    comm = types.SimpleNamespace(unique_name="tp:0", world_size=world_size, cpu_group=cpu_group,
                                 device=torch.device("cpu"), device_group=None, ca_comm=_StackCA())
    stack = comm.ca_comm
    adapter = vllm_plugin.attach(comm)  # the serving half; _StackCA has no `disabled`: a standalone slot over it
    assert comm.ca_comm.autosymm is adapter and comm.ca_comm.fallback is stack
    assert vllm_plugin.attach(types.SimpleNamespace(unique_name="dp:0", world_size=world_size)) is None
    x = torch.full((64,), float(rank + 1))
    chain = []
    out = vllm_plugin.serve_first(adapter, x, lambda t: chain.append(t) or t)
    assert out is x and chain == [x]  # gloo: autosymm's decision is the fallback, vLLM's chain runs
    with adapter_decisions():
        out = vllm_plugin.serve_first(adapter, x, lambda t: pytest.fail("vLLM's chain ran"))
    want = x.clone()
    dist.all_reduce(want)
    assert torch.equal(out, want)
    # the sharded slots: vLLM's own where autosymm's decision is NCCL (gloo), autosymm's at dim 0 where it serves
    rows = torch.arange(6.0).view(3, 2) + 10 * rank
    calls = []
    vllm_own = lambda t, dim: calls.append(dim) or t  # noqa: E731
    assert vllm_plugin.gather_first(adapter, rows, 0, vllm_own) is rows and calls == [0]
    gathered = torch.empty(world_size * 3, 2)
    dist.all_gather_into_tensor(gathered, rows)
    with adapter_decisions():
        assert torch.equal(vllm_plugin.gather_first(adapter, rows, 0, vllm_own), gathered)
        assert torch.equal(vllm_plugin.gather_first(adapter, rows[:, 0], -1, vllm_own), gathered[:, 0])  # 1-D
        shard = vllm_plugin.scatter_first(adapter, gathered, 0, vllm_own)
        assert vllm_plugin.gather_first(adapter, rows, 1, vllm_own) is rows  # another dim: vLLM's
        assert vllm_plugin.scatter_first(adapter, rows, 0, vllm_own) is rows  # 3 rows do not split in 2
        assert torch.equal(comm.ca_comm.custom_all_gather(rows), gathered)
    total = gathered.clone()
    dist.all_reduce(total)
    assert torch.equal(shard, total.view(world_size, 3, 2)[rank])
    assert calls == [0, 1, 0]
    assert torch.equal(comm.ca_comm.custom_all_gather(torch.ones(2)), torch.ones(4))  # NCCL decision: the stack's
    # --disable-custom-all-reduce (ca_comm None): autosymm stays out of the group
    assert vllm_plugin.attach(types.SimpleNamespace(unique_name="tp:0", world_size=world_size, cpu_group=cpu_group,
                                                    device=torch.device("cpu"), device_group=cpu_group,
                                                    ca_comm=None)) is None
    return True


def _install_fake_sglang(coordinator):
    """sglang.srt.layers.flashinfer_comm_fusion.resolve_fusion_group, as SGLang 0.5.23 defines it
    ((world_size, rank, coordinator)), for the fused hook to find the group's slot."""
    for name in ("sglang", "sglang.srt", "sglang.srt.layers"):
        sys.modules.setdefault(name, types.ModuleType(name))
    fusion = types.ModuleType("sglang.srt.layers.flashinfer_comm_fusion")
    fusion.resolve_fusion_group = lambda *, use_attn_tp_group: (2, 0, coordinator)
    sys.modules[fusion.__name__] = fusion


def _install_fake_sglang_envs():
    """sglang.srt.environ.envs with SGLANG_ENABLE_DETERMINISTIC_INFERENCE unset, what build() reads."""
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = types.SimpleNamespace(SGLANG_ENABLE_DETERMINISTIC_INFERENCE=types.SimpleNamespace(get=lambda: False))
    sys.modules[environ.__name__] = environ


def _sglang(rank, world_size, cpu_group):
    from autosymm.integrations import AutosymmCustomAllReduce, sglang_plugin

    _install_fake_sglang_envs()
    factory = sglang_plugin.dispatch_custom_allreduce(lambda group, device: _StackCA, group=cpu_group, device="cpu")
    adapter = factory(group=cpu_group, device="cpu")
    assert isinstance(adapter, AutosymmCustomAllReduce) and isinstance(adapter.fallback, _StackCA)
    assert adapter.fallback.group is cpu_group
    assert torch.equal(adapter.custom_all_reduce(torch.ones(8)), torch.full((8,), -1.0))
    assert sglang_plugin.build(_Broken, cpu_group, "cpu").fallback is None  # SGLang's failed: autosymm alone

    _install_fake_sglang(types.SimpleNamespace(ca_comm=adapter))
    gen = torch.Generator().manual_seed(5)
    xs, residual = torch.randn(world_size, 4, 32, generator=gen), torch.randn(4, 32, generator=gen)
    weight = torch.randn(32, generator=gen)
    flashinfer = []

    def original(*args, **kwargs):
        flashinfer.append(kwargs)
        return None, None

    hook = sglang_plugin.fused_allreduce_residual_rmsnorm
    assert hook(original, xs[rank].clone(), residual, weight, 1e-6, max_token_num=2048) == (None, None)
    assert flashinfer == [{"max_token_num": 2048}]  # gloo: FlashInfer's path is asked, unchanged
    with adapter_decisions():
        out, residual_out = hook(original, xs[rank].clone(), residual, weight, 1e-6, use_attn_tp_group=False)
    assert len(flashinfer) == 1
    torch.testing.assert_close(residual_out, residual + xs.sum(0))
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(residual + xs.sum(0), (32,), weight, 1e-6))
    return True


def test_plugin_hooks_on_two_gloo_ranks():
    reports = run_with_deadline(_target, 2, deadline_s=120)
    assert all(report == {"vllm": True, "sglang": True} for report in reports.values())


def test_sglang_register_names_its_hook_targets(monkeypatch):
    """register() hands SGLang's HookRegistry three AROUND hooks on SGLang 0.5.23's targets (a
    recording registry stands in for SGLang's, whose package needs its GPU dependencies)."""
    from autosymm.integrations import sglang_plugin

    registered = []
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    registry.HookType = types.SimpleNamespace(AROUND="around")
    registry.HookRegistry = types.SimpleNamespace(register=lambda *args: registered.append(args))
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    sglang_plugin.register()
    assert registered == [
        ("sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce",
         sglang_plugin.dispatch_custom_allreduce, "around"),
        ("sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm",
         sglang_plugin.fused_allreduce_residual_rmsnorm, "around"),
        ("sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs", sglang_plugin.tuned_warmup, "around")]

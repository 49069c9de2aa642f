"""Warm-up tuning inside vLLM 0.33.0's own pipeline (tests/stacks/test_vllm_compile.py's block "A",
vLLM's defaults, TP 2 on gloo ranks, the plugin resolved by vLLM's loader): the block's first run
inside the plugins' warm-up (``serving.stack_warmup``: ``AUTOSYMM_STACK_AUTOTUNE``'s budget, as vLLM's
worker runs its warm-up, autosymm.integrations.vllm_warmup.AutosymmWorker) tunes the keys the
block calls, each against vLLM's own path (the ``vllm`` backend: its all-reduce chain, its
FlashInfer fused call); a second start on the same user database tunes none and decides alike."""

from __future__ import annotations

from pathlib import Path

import pickle

import stubs
import torch
from _gloo import run_gloo

from autosymm.integrations import vllm_plugin
from autosymm.runtime import warmup

stubs.require_real_sources()

DEADLINE_S = 560


def _warm_start(rank, world_size, tmp: str) -> dict:
    """One start: the block compiled and run once inside the plugins' warm-up; what it tuned and
    how each prepared call of the adapter's group is decided."""
    from test_vllm_compile import BLOCKS, _classes, _config, _fake_node, _forward, _inductor_caches_on, \
        _parallel_state, _weights

    _inductor_caches_on()
    _, capability, quant_fp8 = BLOCKS["A"]
    _fake_node(capability)
    import torch._dynamo
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tp_group
    from vllm.utils.torch_utils import set_default_torch_dtype

    from autosymm.integrations.serving import stack_warmup
    from autosymm.runtime.group import state_of

    config = _config(Path(tmp) / "model-A", quant_fp8)
    _parallel_state(rank, world_size, config)
    adapter = get_tp_group().device_communicator.autosymm
    torch._dynamo.reset()
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        model = _classes()[0]["A"](vllm_config=config)
    _weights(model, rank)
    with stack_warmup() as tuner:
        _forward(model, config)
    _forward(model, config)  # served from what was tuned
    state = state_of(adapter.group)
    decisions = sorted((entry.decision.bucket, entry.decision.mode, str(entry.decision.formula), entry.decision.backend)
                       for entry in state.cache.values())
    return dict(tuned=[(r.problem.op, r.problem.bucket) for r in tuner.reports],
                notes=sorted(state.warmup.notes.values()), stack=state.caps.stack, decisions=decisions,
                stack_rows=sum(row.stack == "vllm" for source in state.sources for row in source.db.rows()))


def test_autosymms_worker_is_vllms_with_its_warm_up_inside_warm_up_tuning(monkeypatch):
    """The worker the platform names (tests/stacks/test_vllm_compile.py checks it does, where vLLM
    chose its own): vLLM's Worker, found and pickled by its name, whose compile_or_warm_up_model
    (vLLM's dummy runs at each compile and capture size, then its graph capture) runs vLLM's own
    with a warm-up tuner on, and none after."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_worker import Worker

    worker = resolve_obj_by_qualname(vllm_plugin.WORKER_QUALNAME)
    assert issubclass(worker, Worker) and pickle.loads(pickle.dumps(worker)) is worker
    seen = []
    monkeypatch.setattr(Worker, "compile_or_warm_up_model",
                        lambda self: seen.append(warmup.active_tuner() is not None) or 1.5)
    assert warmup.active_tuner() is None
    assert worker.compile_or_warm_up_model(object.__new__(worker)) == 1.5
    assert seen == [True] and warmup.active_tuner() is None


def test_vllms_warm_up_tunes_the_blocks_keys_once_against_vllms_own_path(tmp_path, capsys):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "user.sqlite"), "VLLM_DISABLE_PYNCCL": "1",
                   "VLLM_ALLREDUCE_USE_SYMM_MEM": "0", "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "AUTOSYMM_STACK_AUTOTUNE": "120"}}
    first = run_gloo(_warm_start, 2, str(tmp_path), env=env, deadline_s=DEADLINE_S)
    assert first[0]["tuned"] == first[1]["tuned"] and first[0]["decisions"] == first[1]["decisions"]
    tuned = first[0]["tuned"]
    assert first[0]["stack"] == "vllm" and len(tuned) >= 2, first[0]  # the fused calls' keys and the sums
    assert {op for op, _ in tuned} >= {"all_reduce_rmsnorm"}, tuned
    assert first[0]["stack_rows"] > 0  # every tuned row timed vLLM's own path beside NCCL (or says why not)
    again = run_gloo(_warm_start, 2, str(tmp_path), env=env, deadline_s=DEADLINE_S)
    with capsys.disabled():  # the counts, in the tier's output
        print(f"\nvLLM warm-up, block A at TP 2: first start tuned {len(tuned)} keys "
              f"({', '.join(f'{op} {bucket}' for op, bucket in tuned)}), second start {len(again[0]['tuned'])}")
    for rank in (0, 1):
        assert again[rank]["tuned"] == [], again[rank]["notes"]  # a restart reads the rows back
        assert again[rank]["decisions"] == first[rank]["decisions"]

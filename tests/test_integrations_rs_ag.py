"""The custom-all-reduce adapter's ``custom_all_gather`` / ``custom_reduce_scatter`` (vLLM 0.33's
``CudaCommunicator`` calls) on 2 gloo ranks: None where autosymm's decision is NCCL and nothing is
wrapped, the wrapped object's where one is, autosymm's result (equal to torch.distributed's)
where its decision is a tuned kernel, decisions cached per (op, dtype, bytes, mode)."""

from __future__ import annotations

import torch
from _adapter_decisions import adapter_decisions, tuned

from autosymm.spec import KEY_DTYPE, KEY_SHAPE
from _gloo import run_gloo


class _Stack:
    """A stack's own custom all-reduce object: answers the sharded calls with marker values."""

    def custom_all_gather(self, x):
        return torch.full((2 * x.shape[0], *x.shape[1:]), -1.0)

    def custom_reduce_scatter(self, x):
        return torch.full((x.shape[0] // 2, *x.shape[1:]), -2.0)

    def should_custom_all_gather(self, x):
        return True


def _adapter(rank, world_size):
    import torch.distributed as dist

    from autosymm.integrations import AutosymmCustomAllReduce

    alone = AutosymmCustomAllReduce(device="cpu")
    x = torch.arange(12.0).reshape(4, 3) + rank
    assert alone.custom_all_gather(x) is None and alone.custom_reduce_scatter(x) is None
    assert not alone.should_custom_all_gather(x) and not alone.should_custom_reduce_scatter(x)
    wrapped = AutosymmCustomAllReduce(device="cpu", fallback=_Stack())
    assert torch.equal(wrapped.custom_all_gather(x), torch.full((8, 3), -1.0))
    assert torch.equal(wrapped.custom_reduce_scatter(x), torch.full((2, 3), -2.0))
    assert wrapped.should_custom_all_gather(x) and not wrapped.should_custom_reduce_scatter(x)

    asked = []

    def fake_decide(op, key, mode):
        if (op, key[KEY_DTYPE], tuple(key[KEY_SHAPE]), mode) not in asked:
            asked.append((op, key[KEY_DTYPE], tuple(key[KEY_SHAPE]), mode))
        return tuned(f"triton_{op}_push", mode)

    with adapter_decisions(fake_decide):
        for _ in range(2):
            gathered, shard = wrapped.custom_all_gather(x), wrapped.custom_reduce_scatter(x)
        ints = wrapped.custom_all_gather(torch.arange(3, dtype=torch.int32) + rank)
        odd = wrapped.custom_reduce_scatter(torch.ones(3, 2))  # 3 rows do not split: the stack's
    want_gather, want_shard = torch.empty(8, 3), torch.empty(2, 3)
    dist.all_gather_into_tensor(want_gather, x)
    dist.reduce_scatter_tensor(want_shard, x)
    assert torch.equal(gathered, want_gather) and torch.equal(shard, want_shard)
    assert ints.tolist() == [0, 1, 2, 1, 2, 3] and torch.equal(odd, torch.full((1, 2), -2.0))
    assert asked == [("all_gather", torch.float32, (4, 3), "eager"), ("reduce_scatter", torch.float32, (4, 3), "eager"),
                     ("all_gather", torch.int32, (3,), "eager")]  # keyed as the doors key them
    return True


def test_custom_all_gather_and_reduce_scatter_on_two_gloo_ranks(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert all(run_gloo(_adapter, 2, env=env).values())

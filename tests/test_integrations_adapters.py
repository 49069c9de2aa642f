"""autosymm.integrations on 2 gloo ranks (one spawn for both adapters): the custom-all-reduce
adapter's gating, out-of-place sum and decision cache; the MoE manager's dispatch rows and its
combine against a reference computed with torch on the gathered data."""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
from _gloo import run_with_deadline

WORLD_SIZE = 2


def _target(rank, world_size, port, queue):
    # no user database: the decisions are the shipped DBs' (none for a CPU) and the fallbacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      AUTOSYMM_DB=os.path.join(tempfile.mkdtemp(), "absent.sqlite"))
    import torch.distributed as dist

    import autosymm

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        report = {"custom_all_reduce": _custom_all_reduce(rank, world_size), "moe": _moe(rank, world_size)}
        queue.put((rank, report, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        autosymm.reset()
        dist.barrier()
        dist.destroy_process_group()


def _custom_all_reduce(rank, world_size):
    import autosymm
    from autosymm.dispatch import Decision
    from autosymm.integrations import AutosymmCustomAllReduce
    from autosymm.integrations import custom_all_reduce as module

    car = AutosymmCustomAllReduce(device="cpu")
    x = torch.full((1000,), float(rank + 1), dtype=torch.bfloat16)
    before = x.clone()
    # gloo: autosymm's decision is the fallback (NCCL's stand-in), so the stack keeps its own path
    assert not car.should_custom_ar(x)
    assert car.custom_all_reduce(x) is None
    summed = car.all_reduce(x)
    assert summed is not x and torch.equal(x, before)
    assert torch.equal(summed, torch.full_like(x, sum(range(1, world_size + 1))))
    assert not car.should_custom_ar(torch.ones(8, dtype=torch.int32))  # no tuned kernel for int32
    assert not car.should_custom_ar(torch.ones(8, 8)[:, :4])  # not contiguous

    # A decision other than NCCL (as on a tuned GPU node) opens the gate; explain runs once per
    # (dtype, numel, mode) and capture() asks for the graph-mode rows.
    asked = []

    def fake_explain(t, *, group=None, mode=None):
        asked.append((t.dtype, t.numel(), mode))
        return Decision("triton_one_shot", None, "stub", mode=mode)

    real_explain, module.autosymm.explain = module.autosymm.explain, fake_explain
    try:
        car._use.clear()
        for _ in range(3):
            out = car.custom_all_reduce(x)
            assert out is not None and out is not x and torch.equal(out, summed) and torch.equal(x, before)
        with car.capture():
            assert car.should_custom_ar(x)
        assert asked == [(torch.bfloat16, 1000, "eager"), (torch.bfloat16, 1000, "graph")]
    finally:
        module.autosymm.explain = real_explain
    car.close()
    assert car.disabled and car.custom_all_reduce(x) is None
    return autosymm.stats()


def _moe_inputs(rank, world_size, n_tokens_local, d_model, n_experts, k):
    """Every rank's tokens, ids (some dropped) and weights from one seed, so each rank can build
    the reference from the gathered data."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(world_size, n_tokens_local, d_model, generator=gen)
    ids = torch.rand(world_size * n_tokens_local, n_experts, generator=gen).topk(k, dim=1).indices
    ids[torch.rand(ids.shape, generator=gen) < 0.15] = -1
    weights = torch.rand(world_size * n_tokens_local, k, generator=gen)
    return x, ids.view(world_size, n_tokens_local, k), weights.view(world_size, n_tokens_local, k)


def _moe(rank, world_size):
    from autosymm.integrations import AutosymmAll2AllManager

    n_tokens_local, d_model, n_experts, k = 6, 32, 5, 2
    manager = AutosymmAll2AllManager(n_experts)
    x, ids, weights = _moe_inputs(rank, world_size, n_tokens_local, d_model, n_experts, k)
    scale = torch.arange(1, n_experts + 1, dtype=torch.float32)  # expert e multiplies by e + 1

    out = manager.dispatch(x[rank], ids[rank], weights[rank])
    flat_ids = ids.reshape(-1, k)
    owned_ids = set(manager.local_experts)
    # Dispatched rows: this rank's experts' (token, expert) pairs in ascending expert id.
    rows = [(int(e), t) for t in range(flat_ids.shape[0]) for e in flat_ids[t] if int(e) in owned_ids]
    rows.sort(key=lambda row: row[0])
    mine = out.local_expert_ids >= 0
    assert int(mine.sum()) == len(rows) and int(out.tokens_per_expert.sum()) == len(rows)
    tokens = x.reshape(-1, d_model)
    assert torch.equal(out.hidden_states[mine], torch.stack([tokens[t] for _, t in rows]))
    local = {e: i for i, e in enumerate(manager.local_experts)}
    assert out.local_expert_ids[mine].tolist() == [local[e] for e, _ in rows]
    assert out.tokens_per_expert.tolist() == [sum(g == e for g, _ in rows) for e in manager.local_experts]

    # The experts: row * (global id + 1) on the rows this rank owns, garbage (NaN) elsewhere.
    expert_ids = torch.tensor(manager.local_experts)[out.local_expert_ids.clamp(min=0).long()]
    processed = torch.where(mine[:, None], out.hidden_states * scale[expert_ids][:, None], float("nan"))
    combined = manager.combine(processed, out.handle)
    valid = ids[rank] >= 0
    factor = torch.where(valid, weights[rank] * scale[ids[rank].clamp(min=0)], 0.0)
    want = (x[rank][:, None, :] * factor[..., None]).sum(1)
    assert combined.shape == (n_tokens_local, d_model)
    torch.testing.assert_close(combined, want, rtol=1e-6, atol=1e-6)

    # Round trip without weights, per pair: each valid pair gets its token back, dropped pairs zero.
    kept = out.hidden_states.clone()
    plain = manager.dispatch(x[rank], ids[rank])
    manager.dispatch(x[rank] * 2, ids[rank])  # the caller owns dispatch's rows: a later dispatch leaves them
    # bit patterns: rows no one wrote may hold NaN
    assert torch.equal(out.hidden_states.view(torch.int32), kept.view(torch.int32))
    assert torch.equal(plain.hidden_states[mine], kept[mine])
    pairs = manager.combine(plain.hidden_states, plain.handle, reduce=False)
    assert torch.equal(pairs, torch.where(valid[..., None], x[rank][:, None, :], 0.0))
    manager.destroy()
    return int(mine.sum())


def test_adapters_on_two_gloo_ranks():
    reports = run_with_deadline(_target, WORLD_SIZE, deadline_s=60)
    for rank in range(WORLD_SIZE):
        assert reports[rank]["custom_all_reduce"]["nccl"]["calls"] == 4  # 1 plain + 3 gated calls
    assert sum(reports[rank]["moe"] for rank in range(WORLD_SIZE)) > 0

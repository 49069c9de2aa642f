"""autosymm.integrations on 2 gloo ranks (one spawn for all adapters): the custom-all-reduce
adapter built with vLLM's and SGLang's constructor arguments and CPU group (serving group found
or created, sums equal to dist.all_reduce), its gating, decision cache, the wrapped stack object
and SGLang's fused convention; the MoE manager's dispatch rows and its combine against a
reference computed with torch on the gathered data, and its vLLM and torchtitan shapes."""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback

import torch
from _adapter_decisions import adapter_decisions, tuned

from autosymm.spec import KEY_DTYPE, KEY_EXTRA, KEY_SHAPE
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
        report = {"custom_all_reduce": _custom_all_reduce(rank, world_size), "moe": _moe(rank, world_size),
                  "stacks": _stack_construction(rank, world_size), "wrapped": _wrapped_stack_object(rank),
                  "fused": _fused_convention(rank, world_size), "moe_shapes": _moe_shapes(rank, world_size)}
        queue.put((rank, report, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        autosymm.reset()
        dist.barrier()
        dist.destroy_process_group()


def _custom_all_reduce(rank, world_size):
    import autosymm
    from autosymm.integrations import AutosymmCustomAllReduce

    car = AutosymmCustomAllReduce(device="cpu")
    x = torch.full((1000,), float(rank + 1), dtype=torch.bfloat16)
    before = x.clone()
    # gloo: autosymm's decision is the fallback (NCCL's stand-in), so the stack keeps its own path
    assert not car.should_custom_ar(x)
    assert car.custom_all_reduce(x) is None
    summed = car.autosymm.all_reduce(x)
    assert summed is not x and torch.equal(x, before)
    assert torch.equal(summed, torch.full_like(x, sum(range(1, world_size + 1))))
    assert not car.should_custom_ar(torch.ones(8, dtype=torch.int32))  # no tuned kernel for int32
    assert not car.should_custom_ar(torch.ones(8, 8)[:, :4])  # not contiguous

    # A decision other than NCCL (as on a tuned GPU node) opens the gate; the adapter asks under
    # the door's own call key (dtype, numel, the reduce op), and capture() for the graph-mode rows.
    asked = set()

    def fake_decide(op, key, mode):
        asked.add((op, key[KEY_DTYPE], key[KEY_SHAPE], key[KEY_EXTRA], mode))
        return tuned("triton_one_shot", mode)

    with adapter_decisions(fake_decide):
        for _ in range(3):
            out = car.custom_all_reduce(x)
            assert out is not None and out is not x and torch.equal(out, summed) and torch.equal(x, before)
        with car.capture():
            assert car.should_custom_ar(x)
        assert asked == {("all_reduce", torch.bfloat16, 1000, "sum", "eager"),
                         ("all_reduce", torch.bfloat16, 1000, "sum", "graph")}
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


def _stack_construction(rank, world_size):
    """vLLM's CustomAllreduce(group=cpu_group, device, symm_mem_enabled, *, register_graph_buffers)
    and SGLang's CAClass(group=cpu_group, device=device): the adapter serves on the group over the
    same ranks that runs the device's backend, and its sums are dist.all_reduce's."""
    import torch.distributed as dist

    import autosymm
    from autosymm import dist_compat
    from autosymm.integrations import AutosymmCustomAllReduce

    cpu_group = dist.new_group(list(range(world_size)), backend="gloo")  # as the stacks make theirs
    vllm_style = AutosymmCustomAllReduce(group=cpu_group, device=torch.device("cpu"), symm_mem_enabled=False,
                                         register_graph_buffers=True)
    sglang_style = AutosymmCustomAllReduce(group=cpu_group, device="cpu")
    x = torch.arange(4096, dtype=torch.float32) * (rank + 1)
    want = x.clone()
    dist.all_reduce(want)
    for car in (vllm_style, sglang_style):
        assert car.autosymm.group is cpu_group and car.autosymm.device == torch.device("cpu")  # gloo serves CPU tensors
        decision = autosymm.explain(x, group=car.autosymm.group)
        assert "group" not in decision.reason, decision.reason  # decided on the merits, not refused for the group
        assert torch.equal(car.autosymm.all_reduce(x), want)
    try:
        AutosymmCustomAllReduce(group=cpu_group, device="cpu", max_sizes=1)
    except TypeError as exc:
        assert "max_sizes" in str(exc)
    else:
        raise AssertionError("an unknown keyword must raise TypeError")
    # The device group over the ranks of a group that does not run the backend: found, else created
    # (collectively over those ranks), and found again by the next adapter.
    real_get_backend = dist_compat.dist.get_backend
    dist_compat.dist.get_backend = lambda g=None: "fake" if g is cpu_group else real_get_backend(g)
    try:
        made = dist_compat.group_over(cpu_group, "gloo")
        assert made is not cpu_group and dist.get_process_group_ranks(made) == list(range(world_size))
        if world_size == dist.get_world_size():
            assert made is dist.group.WORLD  # the world group runs gloo over the same ranks: found
        sub = dist.new_group([0], backend="gloo") if world_size > 1 else None  # every rank creates it
        if rank == 0:
            assert dist_compat.find_group([0], "gloo") is sub
        assert dist_compat.find_group([0], "nccl") is None
    finally:
        dist_compat.dist.get_backend = real_get_backend
    if world_size > 1:
        single = dist.new_group([1], backend="gloo")  # every rank takes part; only rank 1 is in it
        dist_compat.dist.get_backend = lambda g=None: "fake" if g is single else real_get_backend(g)
        try:
            if rank == 1:
                created = dist_compat.group_over(single, "gloo")  # no other group over [1]: created alone
                assert created is not single and dist.get_process_group_ranks(created) == [1]
                assert dist_compat.find_group([1], "gloo") in (single, created)
        finally:
            dist_compat.dist.get_backend = real_get_backend
    return decision.describe()


class _StackCA:
    """A stand-in for the stack's own custom all-reduce: serves numel 8 only, records calls."""

    def __init__(self):
        self.calls, self.fully_connected, self.closed = [], True, False
        self.mnnvl_lamport_ag_multicast_ptr = 1234

    def should_custom_ar(self, x):
        return x.numel() == 8

    def custom_all_reduce(self, x):
        self.calls.append("custom_all_reduce")
        return torch.full_like(x, -1.0)

    def custom_all_gather(self, x):
        self.calls.append("custom_all_gather")
        return x.repeat(2)

    @contextlib.contextmanager
    def capture(self):
        self.calls.append("capture")
        yield

    def close(self):
        self.closed = True


def _wrapped_stack_object(rank):
    """Where autosymm runs NCCL the wrapped stack object answers; every other attribute is its."""
    from autosymm.integrations import AutosymmCustomAllReduce

    alone = AutosymmCustomAllReduce(device="cpu")
    assert not alone.fully_connected and alone.mnnvl_lamport_ag_multicast_ptr == 0
    assert alone.custom_all_gather(torch.ones(2)) is None  # autosymm's decision is NCCL: the caller's path
    stack = _StackCA()
    car = AutosymmCustomAllReduce(device="cpu", fallback=stack)
    eight, other = torch.ones(8), torch.ones(16)
    assert car.should_custom_ar(eight) and not car.should_custom_ar(other)
    assert torch.equal(car.custom_all_reduce(eight), torch.full((8,), -1.0))
    assert car.custom_all_reduce(other) is None
    assert car.fully_connected and car.mnnvl_lamport_ag_multicast_ptr == 1234
    assert torch.equal(car.custom_all_gather(torch.ones(2)), torch.ones(4))
    with car.capture():
        assert car.autosymm._mode() == "graph"
    assert car.autosymm._mode() == "eager"
    car.close()
    assert car.disabled and stack.closed and car.custom_all_reduce(eight) is None
    return stack.calls


def _fused_convention(rank, world_size):
    """SGLang's fused call: (norm_out, residual + sum) as new tensors, residual unchanged; None
    where autosymm's decision is its NCCL fallback (gloo) and nothing wrapped serves."""
    from autosymm.integrations import AutosymmCustomAllReduce

    car = AutosymmCustomAllReduce(device="cpu")
    gen = torch.Generator().manual_seed(3)
    xs = torch.randn(world_size, 5, 64, generator=gen)
    residual, weight = torch.randn(5, 64, generator=gen), torch.randn(64, generator=gen)
    kept = residual.clone()
    assert car.fused_allreduce_rmsnorm(xs[rank].clone(), residual, weight, 1e-6) is None
    with adapter_decisions(backend="triton_fused"):
        out, residual_out = car.fused_allreduce_rmsnorm(xs[rank].clone(), residual, weight, 1e-6)
    want_residual = residual + xs.sum(0)
    torch.testing.assert_close(residual_out, want_residual)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(want_residual, (64,), weight, 1e-6))
    assert torch.equal(residual, kept)
    return True


def _moe_shapes(rank, world_size):
    """vLLM's gathered-rows layout (GatheredRows: dispatch gathers uneven token counts, combine sums
    each rank's partials) and torchtitan's dispatcher (compact expert-major rows, score-weighted
    combine into the padded buffer) against torch on gathered data."""
    import torch.distributed as dist

    from autosymm.integrations import GatheredRows, TitanTokenDispatcher

    n_local, d_model, n_experts, k = 6, 32, 5, 2
    x, ids, weights = _moe_inputs(rank, world_size, n_local, d_model, n_experts, k)
    sizes = [n_local - 2 * r for r in range(world_size)]  # uneven, as vLLM's DP chunk sizes
    layout = GatheredRows(n_experts, dist.new_group(list(range(world_size)), backend="gloo"))
    hs, got_ids, call = layout.dispatch(x[rank, :sizes[rank]], ids[rank, :sizes[rank]], sizes)
    flat_ids = torch.cat([ids[r, :size] for r, size in enumerate(sizes)])
    tokens = torch.cat([x[r, :size] for r, size in enumerate(sizes)])
    assert torch.equal(got_ids, flat_ids) and got_ids.dtype == ids.dtype
    owned = set(layout.manager.local_experts)
    local = torch.tensor([[int(e) in owned for e in row] for row in flat_ids])
    assert torch.equal(hs[local.any(1)], tokens[local.any(1)]) and not hs[~local.any(1)].any()
    # each rank's partial: its experts' outputs summed per token (expert e scales by e + 1)
    scale = torch.arange(1, n_experts + 1, dtype=torch.float32)
    flat_weights = torch.cat([weights[r, :size] for r, size in enumerate(sizes)])
    factor = torch.where(flat_ids >= 0, flat_weights * scale[flat_ids.clamp(min=0)], 0.0)
    combined = layout.combine(hs * torch.where(local, factor, 0.0).sum(1, keepdim=True), call)
    everyone = factor.sum(1, keepdim=True) * tokens
    start = sum(sizes[:rank])
    torch.testing.assert_close(combined, everyone[start:start + sizes[rank]], rtol=1e-5, atol=1e-5)

    titan = TitanTokenDispatcher(n_experts)
    counts_in = torch.bincount(ids[rank][ids[rank] >= 0].flatten(), minlength=n_experts)
    routed, counts, metadata = titan.dispatch(x[rank], weights[rank], ids[rank], counts_in)
    flat_ids, tokens = ids.reshape(-1, k), x.reshape(-1, d_model)
    pairs = sorted(((int(e), t) for t in range(flat_ids.shape[0]) for e in flat_ids[t] if int(e) in owned))
    assert torch.equal(routed, torch.stack([tokens[t] for _, t in pairs]))
    assert counts.tolist() == [sum(e == g for e, _ in pairs) for g in titan.manager.local_experts]
    expert_of = torch.tensor([e for e, _ in pairs])
    out = titan.combine(routed * scale[expert_of][:, None], metadata, x[rank], num_local_tokens_after_padding=8,
                        local_seq_len_after_padding=8)
    everyone = torch.where(flat_ids >= 0, weights.reshape(-1, k) * scale[flat_ids.clamp(min=0)], 0.0).sum(
        1, keepdim=True) * tokens
    mine = slice(rank * n_local, (rank + 1) * n_local)
    torch.testing.assert_close(out[:n_local], everyone[mine], rtol=1e-5, atol=1e-5)
    assert out.shape == (8, d_model) and not out[n_local:].any()  # the padding rows
    return len(pairs)


def test_adapters_on_two_gloo_ranks():
    reports = run_with_deadline(_target, WORLD_SIZE, deadline_s=120)
    for rank in range(WORLD_SIZE):
        assert reports[rank]["custom_all_reduce"]["nccl"]["calls"] == 4  # 1 plain + 3 gated calls
        assert reports[rank]["wrapped"] == ["custom_all_reduce", "custom_all_gather", "capture"]
        assert reports[rank]["fused"]
        assert reports[rank]["stacks"].startswith("nccl")  # gloo: the fallback, NCCL's stand-in
    assert sum(reports[rank]["moe"] for rank in range(WORLD_SIZE)) > 0
    assert sum(reports[rank]["moe_shapes"] for rank in range(WORLD_SIZE)) > 0


def test_only_a_tuned_row_other_than_nccls_pre_empts_the_stack():
    """The gate of every ``serves*``: a database row decided (``Decision.tuned``), for a backend
    that is not NCCL's fallback or its batch-invariant fallback. An untuned default (the Triton
    MoE conversion's 'untuned default config', a fallback_order's first backend) leaves the call
    to the stack's own path."""
    from autosymm.runtime.dispatch import Decision
    from autosymm.integrations.serving import serves
    from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, DP_TO_EP

    assert serves(tuned("triton_one_shot"), ALL_REDUCE)
    assert not serves(tuned("nccl"), ALL_REDUCE)  # NCCL's row won: the stack's own path, not autosymm's NCCL
    assert not serves(tuned("nccl_ordered"), ALL_REDUCE)  # autosymm's deterministic NCCL fallback
    assert not serves(tuned("nccl_ordered_fused"), ALL_REDUCE_RMSNORM)
    untuned = Decision("triton_moe", None, "no tuned row for this hardware/world size/shape; untuned default config")
    assert not untuned.tuned and not serves(untuned, DP_TO_EP)
    assert serves(tuned("triton_moe"), DP_TO_EP) and not serves(tuned("nccl_all_to_all"), DP_TO_EP)

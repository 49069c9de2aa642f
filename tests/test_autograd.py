"""Gradients of autosymm's ops on 2 gloo ranks against torch.distributed.nn.functional (the
all-reduce and the composition all-reduce + add + rms_norm) and against the routing itself (the
MoE conversions), eager and under torch.compile(fullgraph=True); the in-place all-reduce of a
tensor that requires grad; non-contiguous inputs."""

import warnings

import pytest
import torch
import torch.distributed as dist

from _gloo import run_gloo

EPS = 1e-6


def _values(rank, shape, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def _all_reduce_grads(rank, world_size):
    import torch.distributed.nn.functional as dnn

    import autosymm
    from autosymm.dist_compat import group_name

    x0, coeff = _values(rank, (6, 5), 1), _values(rank, (6, 5), 2)

    def ours(x):
        return (torch.ops.autosymm.all_reduce(x * 2, "sum", group_name()) * coeff).sum()

    def theirs(x):
        return (dnn.all_reduce(x * 2) * coeff).sum()

    def in_place(x):
        y = x * 2
        autosymm.all_reduce(y)  # the drop-in, in place: traced as the functional op and a copy
        return (y * coeff).sum()

    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    compiled_in_place = torch.compile(in_place, backend="aot_eager", fullgraph=True)
    grads = {}
    paths = (("ours", ours), ("theirs", theirs), ("compiled", compiled), ("compiled_in_place", compiled_in_place))
    for name, fn in paths:
        x = x0.clone().requires_grad_()
        loss = fn(x)
        loss.backward()
        grads[name] = (loss.detach(), x.grad)
    for name in ("ours", "compiled", "compiled_in_place"):
        torch.testing.assert_close(grads[name], grads["theirs"])
    # the in-place drop-in on a tensor that requires grad: as the functional all-reduce
    x = x0.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "may lead to silently incorrect behavior" warning
        y = x * 2
        assert autosymm.all_reduce(y) is y
        (y * coeff).sum().backward()
    torch.testing.assert_close(x.grad, grads["theirs"][1])
    leaf = x0.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="leaf"):
        autosymm.all_reduce(leaf)
    with torch.no_grad():  # no graph to record: reduced in place as ever
        plain = x0.clone().requires_grad_()
        autosymm.all_reduce(plain)
    torch.testing.assert_close(plain.detach(), dnn.all_reduce(x0 * 1))
    maxed = torch.ops.autosymm.all_reduce(x0.clone().requires_grad_(), "max", group_name())
    with pytest.raises(RuntimeError, match="no gradient for op='max'"):
        maxed.sum().backward()
    return True


def _fused_grads(rank, world_size):
    import torch.distributed.nn.functional as dnn

    import autosymm
    from autosymm.dist_compat import group_name

    n_tokens, hidden = 5, 16
    x0, a, b = (_values(rank, (n_tokens, hidden), s) for s in (1, 2, 3))
    residual0, weight0 = _values(0, (n_tokens, hidden), 4), 1 + 0.5 * _values(0, (hidden,), 5)  # replicated

    def ours(x, residual, weight):
        out, new = torch.ops.autosymm.all_reduce_rmsnorm_functional(x * 1.5, residual * 1.0, weight, EPS, group_name())
        return (out * a).sum() + (new * b).sum()

    def drop_in(x, residual, weight):
        res = residual * 1.0
        out = autosymm.all_reduce_rmsnorm(x * 1.5, res, weight, EPS)  # residual updated in place
        return (out * a).sum() + (res * b).sum()

    def theirs(x, residual, weight):
        new = residual * 1.0 + dnn.all_reduce(x * 1.5)
        return (torch.nn.functional.rms_norm(new, (hidden,), weight, EPS) * a).sum() + (new * b).sum()

    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    grads = {}
    for name, fn in (("ours", ours), ("drop_in", drop_in), ("theirs", theirs), ("compiled", compiled)):
        leaves = [t.clone().requires_grad_() for t in (x0, residual0, weight0)]
        loss = fn(*leaves)
        loss.backward()
        grads[name] = (loss.detach(), *(t.grad for t in leaves))
    for name in ("ours", "drop_in", "compiled"):
        torch.testing.assert_close(grads[name], grads["theirs"], rtol=1e-4, atol=1e-5)
    return True


def _moe_case(rank, world_size):
    from autosymm.routing import make_expt_assignment, route

    n_local, k, n_expts, d_model = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(7)  # the same routing on every rank
    expt_indx = torch.stack([torch.randperm(n_expts, generator=gen)[:k] for _ in range(world_size * n_local)])
    expt_indx[3, 1] = -1  # a dropped pair
    owned = {r: list(range(r * 2, r * 2 + 2)) for r in range(world_size)}  # 2 experts a rank
    assignment = make_expt_assignment(world_size, n_expts, owned)
    gate, topk = route(expt_indx)
    return n_local, k, d_model, expt_indx.to(torch.int32), assignment, gate, topk


def _moe_grads(rank, world_size):
    import autosymm

    n_local, k, d_model, expt_indx, assignment, gate, topk = _moe_case(rank, world_size)
    owner, pairs = assignment.expt_owner.long(), expt_indx.reshape(-1).long()
    valid = pairs >= 0
    coeffs = [_values(r, (world_size * n_local * k, d_model), 8) for r in range(world_size)]  # every rank's
    # dp -> ep: loss = sum over this rank's filled rows of rows * coeff
    filled = torch.zeros(world_size * n_local * k, dtype=torch.bool)
    filled[gate.reshape(-1).long()[valid & (owner[pairs.clamp(0)] == rank)]] = True

    def dp_to_ep_loss(src):
        rows = autosymm.convert_dp_to_ep(src * 1.0, assignment, expt_indx, gate)
        return (rows * coeffs[rank] * filled[:, None]).sum()

    def ep_to_dp_loss(src):
        return (autosymm.convert_ep_to_dp(src * 1.0, assignment, expt_indx, topk) * coeffs[rank][:n_local * k]).sum()

    src = _values(rank, (n_local, d_model), 9).requires_grad_()
    dp_to_ep_loss(src).backward()
    want = torch.zeros(n_local, d_model)  # token t's rows go to their experts' ranks, rows gate[p]
    for t in range(n_local):
        for j in range(k):
            p = (rank * n_local + t) * k + j
            if valid[p]:
                want[t] += coeffs[int(owner[pairs[p]])][int(gate.reshape(-1)[p])]
    torch.testing.assert_close(src.grad, want)

    rows = _values(rank, (world_size * n_local * k, d_model), 10).requires_grad_()
    ep_to_dp_loss(rows).backward()
    want = torch.zeros_like(rows)  # expert-ordered row s goes to pair p = topk[s] of rank p // (n_local k)
    for s, p in enumerate(topk.long().tolist()):
        if valid[p] and owner[pairs[p]] == rank:
            want[s] = coeffs[p // (n_local * k)][p % (n_local * k)]
    torch.testing.assert_close(rows.grad, want)
    return True


def _non_contiguous(rank, world_size):
    import autosymm

    base = _values(rank, (6, 8), 11)
    x = base.clone().t()  # strides (1, 8)
    assert not x.is_contiguous()
    want = base.clone().t()
    dist.all_reduce(want)
    assert autosymm.all_reduce(x) is x and torch.equal(x, want)
    storage = base.clone()
    column = storage[:, 3]  # a strided view: the rest of its storage is left alone
    assert torch.equal(autosymm.all_reduce(column), want.t()[:, 3])
    others = [c for c in range(8) if c != 3]
    return torch.equal(storage[:, others], base[:, others]) and torch.equal(storage[:, 3], want.t()[:, 3])


@pytest.mark.parametrize("body", [_all_reduce_grads, _fused_grads, _moe_grads, _non_contiguous],
                         ids=["all_reduce", "all_reduce_rmsnorm", "moe", "non_contiguous"])
def test_on_two_gloo_ranks(body):
    assert run_gloo(body, 2, deadline_s=240) == {0: True, 1: True}

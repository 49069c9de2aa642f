"""autosymm.all_reduce_rmsnorm and its custom op on 2 gloo ranks (the NCCL-fallback path, gloo
standing in): results against the reference, ranks identical, a tuned row honoured, bad input."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch

from _gloo import run_with_deadline

from autosymm.db.store import Row, TuningDB

HIDDEN, EPS = 72, 1e-5


def _inputs(rank, n_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(n_tokens, HIDDEN, generator=gen).bfloat16()
    weight = torch.randn(HIDDEN, generator=gen).bfloat16()
    xs = [torch.randn(n_tokens, HIDDEN, generator=gen).bfloat16() for _ in range(2)]
    return xs, residual, weight


def _calls(rank):
    """Direct calls (a repeat hits the cache), the custom op, and the checks of bad input."""
    import torch.distributed as dist

    import autosymm
    from _fused_ref import reference

    results = []
    for call in range(3):
        xs, residual_in, weight = _inputs(rank, 3, seed=call)
        residual = residual_in.clone()
        if call < 2:
            out = autosymm.all_reduce_rmsnorm(xs[rank].clone(), residual, weight, EPS)
        else:
            out = torch.ops.autosymm.all_reduce_rmsnorm(xs[rank].clone(), residual, weight, EPS,
                                                        dist.group.WORLD.group_name)
        exact_res, exact_out = reference(xs, residual_in, weight, EPS)
        # NCCL's path rounds the sum, then the add: bf16-level tolerance, not one ulp
        torch.testing.assert_close(residual.double(), exact_res, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.double(), exact_out, rtol=3e-2, atol=3e-2)
        results.append((residual.view(torch.int16).tolist(), out.view(torch.int16).tolist()))  # bits, not tensors
    # torch.compile(fullgraph=True) traces the call as torch.ops.autosymm.all_reduce_rmsnorm: same bits
    compiled = torch.compile(lambda x, r, w: autosymm.all_reduce_rmsnorm(x, r, w, EPS), fullgraph=True,
                             backend="aot_eager")
    xs, residual_in, weight = _inputs(rank, 3, seed=0)
    residual = residual_in.clone()
    out = compiled(xs[rank].clone(), residual, weight)
    assert (residual.view(torch.int16).tolist(), out.view(torch.int16).tolist()) == results[0]
    empty = autosymm.all_reduce_rmsnorm(torch.empty(0, HIDDEN).bfloat16(), torch.empty(0, HIDDEN).bfloat16(),
                                        torch.ones(HIDDEN).bfloat16())
    assert empty.shape == (0, HIDDEN)
    x = torch.ones(4, HIDDEN).bfloat16()
    for bad, match in [((x, torch.ones(4, HIDDEN + 8).bfloat16(), torch.ones(HIDDEN).bfloat16()), "residual"),
                       ((x, x.clone(), torch.ones(HIDDEN + 1).bfloat16()), "weight"),
                       ((x, x.clone(), torch.ones(HIDDEN)), "one dtype"),
                       ((x, torch.ones(HIDDEN, 4).bfloat16().t(), torch.ones(HIDDEN).bfloat16()), "not contiguous"),
                       ((torch.ones(4, HIDDEN, dtype=torch.int32),) * 2 + (torch.ones(HIDDEN, dtype=torch.int32),),
                        "not supported")]:
        with pytest.raises(ValueError, match=match):
            autosymm.all_reduce_rmsnorm(*bad)
    decision = autosymm.explain(problem=autosymm.Problem.all_reduce_rmsnorm(3, HIDDEN, "bf16", 2))
    stats = autosymm.stats()
    return results, (decision.backend, decision.source, decision.reason), stats


def _worker(rank, world_size, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOSYMM_DB=os.environ["FUSED_TEST_DB"])
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        out.put((rank, _calls(rank), None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))
    finally:
        import autosymm

        autosymm.reset()
        dist.barrier()
        dist.destroy_process_group()


def test_all_reduce_rmsnorm_on_gloo_ranks(tmp_path, monkeypatch):
    path = tmp_path / "user.sqlite"
    TuningDB(path).record_many([Row(hardware="cpu", world_size=2, op="all_reduce_rmsnorm", dtype="bf16", bucket=4,
                               shape=f"h{HIDDEN}", backend="nccl_fused", median_us=20.0, config=None, nccl_us=20.0)])
    monkeypatch.setenv("FUSED_TEST_DB", str(path))
    reports = run_with_deadline(_worker, 2, deadline_s=120.0)
    (res0, decision0, stats0), (res1, decision1, _) = reports[0], reports[1]
    for (r0, o0), (r1, o1) in zip(res0, res1):
        assert r0 == r1 and o0 == o1, "ranks must end bit-identical"
    assert decision0 == decision1
    assert decision0[:2] == ("nccl_fused", str(path)) and "tuned eager row at 4 tokens/rank" in decision0[2]
    assert stats0["nccl_fused"]["calls"] == 4 and stats0["noop"]["calls"] == 1


def _refused_after_warm_up(rank, world_size):
    """After a first good call, every bad argument raises before anything runs: x and residual
    keep their bits (no sum, no add), and the ranks stay in step."""
    import autosymm

    x, residual = torch.ones(4, HIDDEN).bfloat16(), torch.zeros(4, HIDDEN).bfloat16()
    weight = torch.ones(HIDDEN).bfloat16()
    autosymm.all_reduce_rmsnorm(x.clone(), residual, weight, EPS)  # warm-up: the key is cached
    assert torch.equal(residual, torch.full_like(residual, 2.0))
    buffer = torch.zeros(8, HIDDEN).bfloat16()
    cases = [  # (x, residual, weight), what the error names
        (lambda x, r: (x, x, weight), "must not overlap in memory"),  # residual aliasing x: 2 * sum before
        (lambda x, r: (x, r, x[0]), "must not overlap in memory"),  # weight a row of x (the NCCL path writes x)
        (lambda x, r: (buffer[:4], buffer[2:6], weight), "must not overlap in memory"),  # partly shared rows
        (lambda x, r: (x, r.float(), weight), "must share one dtype"),  # a residual of another dtype
        (lambda x, r: (x, r, torch.ones(HIDDEN + 8).bfloat16()), r"weight \(80,\) must be \[hidden\] = \[72\]"),
        (lambda x, r: (x, torch.zeros(4, HIDDEN + 8).bfloat16(), weight), r"residual \(4, 80\) must both be"),
        (lambda x, r: (x, torch.zeros(HIDDEN, 4).bfloat16().t(), weight), "residual of shape .* is not contiguous"),
        (lambda x, r: (x, r, torch.ones(HIDDEN, device="meta").bfloat16()), "weight is on meta"),
    ]
    for make, match in cases:
        x, residual = torch.full((4, HIDDEN), 3.0).bfloat16(), torch.full((4, HIDDEN), 5.0).bfloat16()
        args = make(x, residual)
        before = [t.clone() for t in args[:2]] if isinstance(args[0], torch.Tensor) else []
        with pytest.raises(ValueError, match=match):
            autosymm.all_reduce_rmsnorm(*args, EPS)
        assert all(torch.equal(a, b) for a, b in zip(args[:2], before)), match  # untouched
    x, residual = torch.ones(4, HIDDEN).bfloat16(), torch.zeros(4, HIDDEN).bfloat16()
    autosymm.all_reduce_rmsnorm(x, residual, weight, EPS)  # still in step
    assert torch.equal(residual, torch.full_like(residual, 2.0))
    with pytest.raises(ValueError, match="is a fake tensor outside tracing"):
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            fake = torch.ones(4, HIDDEN).bfloat16()
        autosymm.all_reduce_rmsnorm(fake, fake, weight, EPS)
    fp8 = torch.ones(4, HIDDEN).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype torch.float8_e4m3fn is not supported: .* torch.bfloat16"):
        autosymm.all_reduce_rmsnorm(fp8, fp8.clone(), torch.ones(HIDDEN).to(torch.float8_e4m3fn), EPS)
    return True


def test_bad_arguments_after_warm_up_raise_before_anything_changes(tmp_path):
    from _gloo import run_gloo

    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_refused_after_warm_up, 2, env=env, deadline_s=120) == {0: True, 1: True}

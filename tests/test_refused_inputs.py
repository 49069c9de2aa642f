"""Inputs refused before anything runs, with an error naming the argument, on every rank (gloo
processes): lists and sparse tensors where a tensor goes, fp8 reduce-scatters, per-rank sizes
that are not ints, a non-bool ``init(deterministic=)``; fp8 all-gathers served as bytes. A bad
input on one rank at a new call raises there, and its peers name it, within seconds."""

from __future__ import annotations

import time

import pytest
import torch
from _gloo import run_gloo

DEADLINE_S = 120.0
FP8 = torch.float8_e4m3fn


def _env(tmp_path, timeout_s="30"):
    return {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": timeout_s}}


def _raises(error_type, match, fn):
    with pytest.raises(error_type, match=match) as info:
        fn()
    return str(info.value)


def _every_rank_refuses(rank, world_size):
    import numpy as np

    import autosymm

    x = torch.ones(8)
    autosymm.all_reduce(x)  # warm-up: the float32 x 8 sum is prepared
    calls = autosymm.stats()["nccl"]["calls"]
    _raises(TypeError, r"autosymm.all_reduce: tensor must be a torch.Tensor, got list",
            lambda: autosymm.all_reduce([1.0, 2.0]))
    _raises(TypeError, r"tensor must be a torch.Tensor, got list", lambda: autosymm.all_reduce([1.0], op="max"))
    sparse = torch.eye(8).to_sparse()  # as many elements as x
    _raises(ValueError, r"autosymm.all_reduce: tensor is a sparse_coo tensor \(8, 8\): only dense tensors",
            lambda: autosymm.all_reduce(sparse))
    _raises(ValueError, "tensor is a sparse_coo tensor", lambda: autosymm.all_reduce(sparse, op="max"))
    _raises(ValueError, "tensor is a sparse_csr tensor", lambda: autosymm.all_reduce(torch.eye(8).to_sparse_csr()))
    assert autosymm.stats()["nccl"]["calls"] == calls  # nothing ran

    out = torch.empty(4)
    _raises(TypeError, r"autosymm.reduce_scatter: input must be a torch.Tensor, got list",
            lambda: autosymm.reduce_scatter_tensor(out, [1.0] * 8))
    _raises(TypeError, r"autosymm.reduce_scatter: output must be a torch.Tensor, got list",
            lambda: autosymm.reduce_scatter_tensor([0.0] * 4, torch.ones(8)))
    _raises(ValueError, r"autosymm.reduce_scatter: input is a sparse_coo tensor",
            lambda: autosymm.reduce_scatter_tensor(out, torch.ones(8).to_sparse()))
    autosymm.reduce_scatter_tensor(out, torch.ones(8))  # prepared for dense tensors: a sparse one is still named
    _raises(ValueError, r"autosymm.reduce_scatter: input is a sparse_coo tensor",
            lambda: autosymm.reduce_scatter_tensor(out, torch.ones(8).to_sparse()))
    autosymm.all_gather_into_tensor(torch.empty(8), torch.ones(4))
    _raises(ValueError, r"autosymm.all_gather: output is a sparse_coo tensor",
            lambda: autosymm.all_gather_into_tensor(torch.ones(8).to_sparse(), torch.ones(4)))
    _raises(TypeError, r"autosymm.all_gather: input must be a torch.Tensor, got tuple",
            lambda: autosymm.all_gather_into_tensor(torch.empty(8), (1.0,) * 4))
    _raises(ValueError, r"autosymm.reduce_scatter: dtype torch.float8_e4m3fn cannot be reduced",
            lambda: autosymm.reduce_scatter_tensor(torch.empty(4, dtype=FP8), torch.ones(8).to(FP8)))

    cols = torch.ones(2 + rank, 2)
    for sizes, kind in (([1.9, 2.9], "float"), (["2", "3"], "str"), ([True, True], "bool")):
        said = _raises(TypeError, r"autosymm.reduce_scatter: sizes=.* must be ints, one per rank",
                       lambda: autosymm.reduce_scatterv(torch.empty(2 + rank, 2), torch.ones(5, 2), sizes))
        assert kind in said
        _raises(TypeError, r"autosymm.all_gather: sizes=.* must be ints", lambda: autosymm.all_gatherv(
            torch.empty(5, 2), cols, sizes))
    _raises(TypeError, r"sizes must be a list of ints, one per rank, not a tensor",
            lambda: autosymm.all_gatherv(torch.empty(5, 2), cols, torch.tensor([2, 3])))
    gathered = torch.empty(5, 2)
    autosymm.all_gatherv(gathered, torch.full((2 + rank, 2), float(rank)), [np.int64(2), np.int64(3)])
    assert gathered[:, 0].tolist() == [0, 0, 1, 1, 1]  # numpy ints are ints

    said = _raises(ValueError, r"deterministic='yes' \(str\) must be True, False or None",
                   lambda: autosymm.init(deterministic="yes"))
    assert "rank 0: TypeError" in said and "rank 1: TypeError" in said  # every rank heard every rank
    autosymm.all_reduce(x)  # still in step
    return float(x[0])


def test_every_listed_input_is_refused_on_every_rank_naming_the_argument(tmp_path):
    assert run_gloo(_every_rank_refuses, 2, env=_env(tmp_path), deadline_s=DEADLINE_S) == {0: 4.0, 1: 4.0}


def _fp8_all_gather(rank, world_size):
    import autosymm

    shard = (torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * rank).to(FP8)
    full = torch.empty(3 * world_size, 2, dtype=FP8)
    autosymm.all_gather_into_tensor(full, shard)
    want = torch.cat([(torch.arange(6, dtype=torch.float32).reshape(3, 2) + 10 * r).to(FP8) for r in range(world_size)])
    assert torch.equal(full.view(torch.uint8), want.view(torch.uint8))  # bit for bit
    uneven = torch.full((rank + 1,), float(rank + 1)).to(FP8)
    gathered = torch.empty(sum(range(1, world_size + 1)), dtype=FP8)
    autosymm.all_gatherv(gathered, uneven, list(range(1, world_size + 1)))
    assert gathered.float().tolist() == [float(r + 1) for r in range(world_size) for _ in range(r + 1)]
    import torch.distributed as dist

    functional = torch.ops.autosymm.all_gather_into_tensor(shard, world_size, dist.group.WORLD.group_name)
    assert torch.equal(functional.view(torch.uint8), want.view(torch.uint8))
    return autosymm.explain(problem=autosymm.Problem("all_gather", "bf16", world_size, nbytes=full.numel()),
                            op="all_gather").backend


def test_an_fp8_all_gather_is_a_byte_copy_on_the_nccl_path(tmp_path):
    assert run_gloo(_fp8_all_gather, 2, env=_env(tmp_path), deadline_s=DEADLINE_S) == {0: "nccl_all_gather",
                                                                                          1: "nccl_all_gather"}


def _one_rank_refuses(rank, world_size):
    """A bad input on rank 1 only, at a call new to both: rank 1 raises its error, rank 0 an
    AgreementError naming it, at once (the agreement timeout is 30 s)."""
    from autosymm.runtime.agreement import AgreementError

    import autosymm

    said, took = [], []
    cases = (
        (lambda: autosymm.all_reduce([1.0] * 5), lambda: autosymm.all_reduce(torch.ones(5)),
         TypeError, "tensor must be a torch.Tensor, got list"),
        (lambda: autosymm.all_reduce(torch.eye(3).to_sparse()), lambda: autosymm.all_reduce(torch.ones(3, 3)),
         ValueError, "tensor is a sparse_coo tensor"),
        (lambda: autosymm.reduce_scatter_tensor(torch.empty(2), [1.0] * 4),
         lambda: autosymm.reduce_scatter_tensor(torch.empty(2), torch.ones(4)), TypeError, "input must be a torch"),
        (lambda: autosymm.reduce_scatterv(torch.empty(2), torch.ones(3), [1.0, 2.0]),
         lambda: autosymm.reduce_scatterv(torch.empty(1 + rank), torch.ones(3), [1, 2]), TypeError, "sizes="),
    )
    for bad, good, error_type, match in cases:
        start = time.monotonic()
        if rank == 1:
            _raises(error_type, match, bad)
        else:
            said.append(_raises(AgreementError, f"rank 1: {error_type.__name__}: .*{match}", good))
        took.append(time.monotonic() - start)
    x = torch.ones(7)
    autosymm.all_reduce(x)  # still in step
    return float(x[0]), max(took)


def test_a_bad_input_on_one_rank_raises_on_both_within_seconds(tmp_path):
    reports = run_gloo(_one_rank_refuses, 2, env=_env(tmp_path), deadline_s=DEADLINE_S)
    assert [value for value, _ in reports.values()] == [2.0, 2.0]
    assert all(took < 10.0 for _, took in reports.values()), reports  # not the 30 s agreement timeout

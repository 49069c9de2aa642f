"""Every argument of every public collective, bad on one rank only (the last) at a call new to
every rank: each rank raises within about a second (the agreement deadline is 10 s), the bad
rank its own error naming the argument, the others an AgreementError naming the bad rank and its
error (autosymm.runtime.entry: the door's checks run, in the one order of every door, inside the
step that shares a failure). Then the checked mode (AUTOSYMM_CHECK_CALLS): at a warm key, a
scale missing or of another value on one rank raises on every rank before any kernel runs."""

from __future__ import annotations

import time

import pytest
import torch
from _gloo import run_gloo

DEADLINE_S = 240.0
WITHIN_S = 2.0
FP8 = torch.float8_e4m3fn


def _fused(i, **kw):
    import autosymm

    hidden = 32 + 16 * i
    x, residual = torch.ones(2, hidden), torch.ones(2, hidden)
    args = dict(x=x, residual=residual, weight=torch.ones(hidden), eps=1e-6)
    args.update(kw)
    return lambda: autosymm.all_reduce_rmsnorm(args.pop("x"), args.pop("residual"), args.pop("weight"),
                                               args.pop("eps"), **args)


def _grad_x(i):
    x = torch.ones(2, 32 + 16 * i, requires_grad=True)
    return _fused(i, x=x, quant="fp8", scale=torch.ones(()))


def _cases(world_size):
    """(name, bad call, good call, error type, what the bad rank's message says), each at a size
    no earlier case used (a new key on every rank)."""
    import autosymm

    ws = world_size
    group_object = object()
    return [
        ("all_reduce tensor", lambda i: lambda: autosymm.all_reduce([1.0] * (10 + i)),
         lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i)), TypeError, "tensor must be a torch.Tensor"),
        ("all_reduce op", lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i), op="median"),
         lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i)), ValueError, "op='median' is not"),
        ("all_reduce op type", lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i), group_object),
         lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i)), TypeError, "is not a reduce op"),
        ("all_reduce dtype", lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i).to(FP8)),
         lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i)), ValueError, "cannot be reduced"),
        ("all_reduce device", lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i, device="meta")),
         lambda i: lambda: autosymm.all_reduce(torch.ones(10 + i)), ValueError, "is on meta"),
        ("reduce_scatter op", lambda i: lambda: autosymm.reduce_scatter_tensor(torch.empty(i + 1), torch.ones(
            ws * (i + 1)), op="median"),
         lambda i: lambda: autosymm.reduce_scatter_tensor(torch.empty(i + 1), torch.ones(ws * (i + 1))),
         ValueError, "op='median'"),
        ("reduce_scatter shape", lambda i: lambda: autosymm.reduce_scatter_tensor(torch.empty(i + 1), torch.ones(
            ws * (i + 1) + 1)),
         lambda i: lambda: autosymm.reduce_scatter_tensor(torch.empty(i + 1), torch.ones(ws * (i + 1))),
         ValueError, f"must hold world_size={ws} times"),
        ("reduce_scatter dtypes", lambda i: lambda: autosymm.reduce_scatter_tensor(
            torch.empty(i + 1, dtype=torch.float64), torch.ones(ws * (i + 1))),
         lambda i: lambda: autosymm.reduce_scatter_tensor(torch.empty(i + 1), torch.ones(ws * (i + 1))),
         ValueError, "must share one dtype"),
        ("reduce_scatterv sizes", lambda i: lambda: autosymm.reduce_scatterv(
            torch.empty(1), torch.ones(ws), [1.0] * ws),
         lambda i: lambda: autosymm.reduce_scatterv(torch.empty(1), torch.ones(ws), [1] * ws), TypeError, "sizes="),
        ("all_gather output", lambda i: lambda: autosymm.all_gather_into_tensor(torch.empty(ws * (i + 1) + 1),
                                                                                 torch.ones(i + 1)),
         lambda i: lambda: autosymm.all_gather_into_tensor(torch.empty(ws * (i + 1)), torch.ones(i + 1)),
         ValueError, f"must hold world_size={ws} times"),
        ("all_gather input", lambda i: lambda: autosymm.all_gather_into_tensor(torch.empty(ws * (i + 1)),
                                                                                (1.0,) * (i + 1)),
         lambda i: lambda: autosymm.all_gather_into_tensor(torch.empty(ws * (i + 1)), torch.ones(i + 1)),
         TypeError, "input must be a torch.Tensor"),
        ("fused quant without scale", lambda i: _fused(i, quant="fp8"),
         lambda i: _fused(i, quant="fp8", scale=torch.ones(())), ValueError, "quant='fp8' needs scale"),
        ("fused unknown quant", lambda i: _fused(i, quant="fp9", scale=torch.ones(())),
         lambda i: _fused(i, quant="fp8", scale=torch.ones(())), ValueError, "quant='fp9' is not one of"),
        ("fused scale without quant", lambda i: _fused(i, scale=torch.ones(())), lambda i: _fused(i),
         ValueError, "scale is given"),
        ("fused scale dtype", lambda i: _fused(i, quant="fp8", scale=torch.ones((), dtype=torch.float64)),
         lambda i: _fused(i, quant="fp8", scale=torch.ones(())), ValueError, "scale has dtype torch.float64"),
        ("fused gemma", lambda i: _fused(i, gemma="yes"), lambda i: _fused(i, gemma=True), ValueError,
         "gemma must be True or False"),
        ("fused weight", lambda i: _fused(i, weight=torch.ones(3)), lambda i: _fused(i), ValueError, "weight"),
        ("fused eps", lambda i: _fused(i, eps=-1.0), lambda i: _fused(i), ValueError, "eps=-1.0"),
        ("fused nvfp4 hidden", lambda i: _fused(i, x=torch.ones(2, 40), residual=torch.ones(2, 40),
                                                weight=torch.ones(40), quant="nvfp4", scale=torch.ones(())),
         lambda i: _fused(i, quant="nvfp4", scale=torch.ones(())), ValueError, "not a multiple of 16"),
        ("fused grad with quant", _grad_x, lambda i: _fused(i, quant="fp8", scale=torch.ones(())), RuntimeError,
         "no gradient"),
    ]


def _walk(rank, world_size):
    """Every case once: (name, error type name, message, seconds) on this rank."""
    import autosymm

    bad = rank == world_size - 1
    out = []
    for i, (name, bad_call, good_call, _, _) in enumerate(_cases(world_size)):
        call = (bad_call if bad else good_call)(i)
        start = time.monotonic()
        try:
            call()
            out.append((name, "", "no error", time.monotonic() - start))
        except Exception as exc:  # what each rank raised
            out.append((name, type(exc).__name__, str(exc), time.monotonic() - start))
    x = torch.ones(5)
    autosymm.all_reduce(x)  # every rank still in step
    out.append(("after", "", str(float(x[0])), 0.0))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bad_argument_on_one_rank_raises_on_every_rank_at_once(tmp_path, world_size):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    results = run_gloo(_walk, world_size, env=env, deadline_s=DEADLINE_S)
    cases = {case[0]: case for case in _cases(world_size)}
    bad = world_size - 1
    for rank, rows in results.items():
        assert rows[-1] == ("after", "", f"{float(world_size)}", 0.0)
        for name, kind, message, seconds in rows[:-1]:
            _, _, _, error_type, said = cases[name]
            assert seconds < WITHIN_S, (rank, name, seconds, message)
            if rank == bad:
                assert kind == error_type.__name__ and said in message, (rank, name, kind, message)
            else:
                assert kind == "AgreementError" and f"rank {bad}: {error_type.__name__}" in message \
                    and said in message, (rank, name, kind, message)


def _checked(rank, world_size, case):
    """A warm fused key in checked mode, then one rank's call differs by ``case``."""
    import autosymm

    hidden = 64
    scale = torch.ones(())
    x, residual, weight = torch.ones(2, hidden), torch.zeros(2, hidden), torch.ones(hidden)
    autosymm.all_reduce_rmsnorm(x.clone(), residual.clone(), weight, quant="fp8", scale=scale)  # warm
    odd = rank == world_size - 1
    if case == "missing scale":
        kwargs = dict(quant="fp8") if odd else dict(quant="fp8", scale=scale)
    else:  # another value of the scale
        kwargs = dict(quant="fp8", scale=torch.full((), 2.0) if odd else scale)
    start = time.monotonic()
    try:
        autosymm.all_reduce_rmsnorm(x.clone(), residual.clone(), weight, **kwargs)
        said = "no error"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    return said, time.monotonic() - start


@pytest.mark.parametrize("case", ["missing scale", "scale value"])
def test_checked_mode_compares_the_scale_at_a_warm_key(tmp_path, case):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10",
                   "AUTOSYMM_CHECK_CALLS": "1"}}
    results = run_gloo(_checked, 2, case, env=env, deadline_s=DEADLINE_S)
    for rank, (said, seconds) in results.items():
        assert seconds < WITHIN_S, (rank, said, seconds)
        if case == "missing scale":
            assert "quant='fp8' needs scale" in said, (rank, said)
        else:
            assert said.startswith("CallMismatchError") and "scale value" in said, (rank, said)

"""Fault injection on real gloo groups: a bad setting, input or call on one rank ends with an
error or the same safe fallback on every rank, within a deadline, never a hang."""

from datetime import timedelta

import pytest
import torch
from _gloo import run_gloo

DEADLINE_S = 120.0


def _with_autosymm(rank, world_size, body):
    import autosymm

    return body(rank, world_size, autosymm)


def _settings_differ(rank, world_size, autosymm):
    import warnings

    x = torch.full((1000,), float(rank + 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autosymm.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, sum(range(1, world_size + 1))))
    said = [str(w.message) for w in caught if "every rank uses NCCL" in str(w.message)]
    assert len(said) == (1 if rank == 0 else 0)  # rank 0 warns, once
    return autosymm.explain(x).reason


def test_differing_or_bad_settings_put_every_rank_on_nccl(tmp_path):
    env = {0: {}, 1: {"AUTOSYMM_DISABLE": "1"}, 2: {"AUTOSYMM_BARRIER_MAX_POLLS": "abc"},
           3: {"AUTOSYMM_WORKSPACE_BYTES": "1GiB"}}
    for rank in env:
        env[rank]["AUTOSYMM_DB"] = str(tmp_path / "none.sqlite")
    reasons = run_gloo(_with_autosymm, 4, _settings_differ, env=env, deadline_s=DEADLINE_S)
    assert len(set(reasons.values())) == 1  # every rank says the same
    reason = reasons[0]
    assert "rank 2: ValueError: AUTOSYMM_BARRIER_MAX_POLLS='abc'" in reason
    assert "disabled: rank 0 False, rank 1 True" in reason
    assert "region_bytes" in reason and "rank 3 [536870912, 536870912]" in reason


def _expect(error_type, match, fn):
    with pytest.raises(error_type, match=match):
        fn()


def _bad_calls(rank, world_size, autosymm):
    from autosymm.runtime.agreement import AgreementError
    from autosymm.backends import BackendError

    autosymm.init()
    # dtype differs across ranks: every rank raises, naming both calls
    mixed = torch.ones(256, dtype=torch.bfloat16 if rank == 0 else torch.float32)
    _expect(AgreementError, "bfloat16 x 256.*rank 1 .*float32 x 256", lambda: autosymm.all_reduce(mixed))
    # the op differs
    _expect(AgreementError, "op=max", lambda: autosymm.all_reduce(torch.ones(64), op="max" if rank else "sum"))
    # the failing rank raises its own error, the other an AgreementError naming it
    x = torch.ones(64, 64)
    bad = torch.empty(64, 64, device="meta") if rank == 1 else x  # (a strided tensor is copied through now)
    _expect(ValueError if rank == 1 else AgreementError, "is on meta", lambda: autosymm.all_reduce(bad))
    # after all that, matching calls still work
    y = torch.full((300,), float(rank + 1))
    autosymm.all_reduce(y)
    assert torch.equal(y, torch.full_like(y, 3.0))
    _moe_faults(rank, world_size, autosymm, AgreementError, BackendError)
    _explain_errors(autosymm)
    # a peer that never makes the call: the waiting rank gives up within the agreement deadline
    state = autosymm.api.STATES[None]
    state.channel.timeout = timedelta(seconds=2)
    if rank == 0:
        _expect(AgreementError, r"rank\(s\) \[1\] .* did not reach", lambda: autosymm.all_reduce(torch.ones(77)))
    return True


def _moe_faults(rank, world_size, autosymm, AgreementError, BackendError):
    n_tokens, d_model, n_expts, k = 4, 32, 8, 2
    assignment = autosymm.make_expt_assignment(world_size, n_expts, autosymm.make_expt_dict_uniform(world_size, n_expts),
                                               "cpu")
    expt_indx = torch.tensor([[e % n_expts, (e + 3) % n_expts] for e in range(n_tokens * world_size)], dtype=torch.int32)
    gate_indx, _ = autosymm.route(expt_indx)
    src = torch.randn(n_tokens, d_model)
    # a wrong shape on one rank only
    short = src[:3].contiguous() if rank == 1 else src
    _expect(BackendError if rank == 1 else AgreementError, "src has shape",
            lambda: autosymm.convert_dp_to_ep(short, assignment, expt_indx, gate_indx))
    # index values out of range (on every rank): a clear error, whatever backend would run
    broken = gate_indx.clone()
    broken[0, 0] = n_tokens * world_size * k + 5
    _expect(BackendError, r"gate_indx holds values in \[\d+, 21\]",
            lambda: autosymm.convert_dp_to_ep(src, assignment, expt_indx, broken))


def _explain_errors(autosymm):
    x = torch.ones(16)
    _expect(ValueError, "mode='bogus'", lambda: autosymm.explain(x, mode="bogus"))
    _expect(ValueError, "a tensor describes an all-reduce", lambda: autosymm.explain(x, op="dp_to_ep"))
    _expect(ValueError, "op='gather'", lambda: autosymm.explain(x, op="gather"))


def test_bad_calls_raise_on_every_rank_and_nothing_hangs(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "30"}}
    assert run_gloo(_with_autosymm, 2, _bad_calls, env=env, deadline_s=DEADLINE_S) == {0: True, 1: True}


def _big_group(rank, world_size, autosymm):
    x = torch.full((4097,), float(rank))
    autosymm.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, float(sum(range(world_size)))))
    return autosymm.explain(x).backend


def test_three_ranks_sum(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert set(run_gloo(_with_autosymm, 3, _big_group, env=env, deadline_s=DEADLINE_S).values()) == {"nccl"}


def _refused_inputs(rank, world_size, autosymm):
    """Inputs that used to be accepted (or raised an unclear error) get a clear one on every rank,
    before any collective: meta and fake tensors (a meta tensor after warm-up used to hit the
    prepared call and be "counted"), fp8, a group or op that is not one, init settings."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.ones(8)
    autosymm.all_reduce(x)  # warm-up: the float32 x 8 sum is prepared
    calls = autosymm.stats()["nccl"]["calls"]
    _expect(ValueError, r"tensor \(8,\) torch.float32 is on meta outside tracing: it holds no data",
            lambda: autosymm.all_reduce(torch.ones(8, device="meta")))
    with FakeTensorMode():
        fake = torch.ones(8)
    _expect(ValueError, "is a fake tensor outside tracing", lambda: autosymm.all_reduce(fake))
    _expect(ValueError, "is a fake tensor", lambda: autosymm.all_reduce(fake, op="max"))
    assert autosymm.stats()["nccl"]["calls"] == calls  # nothing counted
    fp8 = torch.ones(8).to(torch.float8_e4m3fn)
    _expect(ValueError, r"dtype torch.float8_e4m3fn cannot be reduced: tuned kernels serve torch.bfloat16, "
                        r"torch.float16, torch.float32 sums", lambda: autosymm.all_reduce(fp8))
    _expect(TypeError, r"group='bogus' \(str\) is not a torch.distributed ProcessGroup",
            lambda: autosymm.all_reduce(x, group="bogus"))
    _expect(TypeError, r"op=\['sum'\] \(list\) is not a reduce op: pass a dist.ReduceOp of SUM",
            lambda: autosymm.all_reduce(x, op=["sum"]))
    for bad, match in ((-1, "moe_max_bytes=-1 must be in 0.."), (1.5, r"moe_max_bytes=1.5 \(float\) must be a whole"),
                       (True, r"moe_max_bytes=True \(bool\)"), (1 << 40, "must be in 0..68719476736")):
        _expect(ValueError, match, lambda: autosymm.init(moe_max_bytes=bad))
    autosymm.init(moe_max_bytes=0)
    autosymm.all_reduce(x)  # the ranks are still in step
    return float(x[0])


def test_refused_inputs_raise_clearly_on_every_rank(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_with_autosymm, 2, _refused_inputs, env=env, deadline_s=DEADLINE_S) == {0: 4.0, 1: 4.0}


def _late_rank(rank, world_size, autosymm):
    """Rank 0 arrives 6 s late at a new call, past the 3 s agreement deadline: both ranks raise,
    rank 1 naming rank 0's lateness, rank 0 naming rank 1's giving up; then both go on in step."""
    import time

    from autosymm.runtime.agreement import AgreementError

    x = torch.ones(8)
    autosymm.all_reduce(x)  # the group is set up
    if rank == 0:
        time.sleep(6.0)
    start = time.monotonic()
    with pytest.raises(AgreementError) as info:
        autosymm.all_reduce(torch.ones(16))  # a new call: agreed first
    took = time.monotonic() - start
    y = torch.full((32,), float(rank + 1))
    autosymm.all_reduce(y)
    assert torch.equal(y, torch.full_like(y, 3.0))
    return str(info.value), took


def test_a_rank_late_past_the_deadline_ends_on_both_ranks(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "3"}}
    reports = run_gloo(_with_autosymm, 2, _late_rank, env=env, deadline_s=60)
    (said_0, took_0), (said_1, took_1) = reports[0], reports[1]
    assert "rank(s) [0] of the group did not reach 'call" in said_1 and "within 3 s" in said_1
    assert "this rank (rank 0) reached 'call" in said_0 and "rank 1 gave up waiting for it after 3 s" in said_0
    assert 2.5 < took_1 < 20 and took_0 < 5  # rank 0 learns it at once, not in a collective nobody joins


def _tiny_timeout(rank, world_size, autosymm):
    import warnings

    x = torch.full((8,), float(rank + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autosymm.all_reduce(x)
    assert torch.equal(x, torch.full_like(x, 3.0))
    return autosymm.explain(x).reason, autosymm.api.STATES[None].channel.timeout.total_seconds()


def test_a_tiny_agreement_timeout_on_one_rank_is_refused_on_every_rank(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}, 1: {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"),
                                                                       "AUTOSYMM_AGREE_TIMEOUT_S": "1e-9"}}
    reports = run_gloo(_with_autosymm, 2, _tiny_timeout, env=env, deadline_s=DEADLINE_S)
    assert reports[0][0] == reports[1][0] and "rank 1: ValueError: AUTOSYMM_AGREE_TIMEOUT_S='1e-9'" in reports[0][0]
    assert reports[1][1] == 300.0  # the refused value waits the default


def _fused_bad_weight(rank, world_size, autosymm):
    """A weight of the wrong size on rank 1 at a call new to both: rank 1 raises its ValueError,
    rank 0 an AgreementError naming it, both at once (the agreement timeout is 60 s)."""
    import time

    from autosymm.runtime.agreement import AgreementError

    hidden = 64
    x, residual = torch.ones(4, hidden), torch.zeros(4, hidden)
    weight = torch.ones(hidden + 8 if rank == 1 else hidden)
    start = time.monotonic()
    if rank == 1:
        _expect(ValueError, r"weight \(72,\) must be \[hidden\] = \[64\]",
                lambda: autosymm.all_reduce_rmsnorm(x, residual, weight))
    else:
        _expect(AgreementError, r"rank 1: ValueError: .*weight \(72,\) must be \[hidden\]",
                lambda: autosymm.all_reduce_rmsnorm(x, residual, weight))
    took = time.monotonic() - start
    assert torch.equal(residual, torch.zeros_like(residual))  # nothing ran
    out = autosymm.all_reduce_rmsnorm(x, residual, torch.ones(hidden))  # still in step
    assert torch.equal(residual, torch.full_like(residual, 2.0))
    return took, float(out[0, 0])


def test_a_bad_fused_weight_on_one_rank_fails_both_at_once(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "60"}}
    reports = run_gloo(_with_autosymm, 2, _fused_bad_weight, env=env, deadline_s=DEADLINE_S)
    assert all(took < 10 and abs(out - 1.0) < 1e-6 for took, out in reports.values()), reports  # rmsnorm of 2s

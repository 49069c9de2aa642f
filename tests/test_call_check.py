"""autosymm.runtime.call_check, the checked mode (AUTOSYMM_CHECK_CALLS): ranks as threads over one
in-memory c10d store here; the public calls in checked mode over gloo processes below."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from autosymm.runtime import agreement
from autosymm.runtime.agreement import AgreementError, Exchange
from autosymm.runtime.call_check import CallMismatchError, check_call, fingerprint
from autosymm.routing import make_expt_assignment, make_expt_dict_uniform


class Group:
    group_name = "test-call-check"


def _channels(world_size: int, store=None, wait_s: float = 10.0) -> list[Exchange]:
    store, channels = store if store is not None else dist.HashStore(), []
    for rank in range(world_size):
        agreement._GENERATIONS.pop(Group.group_name, None)  # each simulated rank counts as its own process
        channels.append(Exchange(Group(), rank, world_size, store=store, wait_s=wait_s))
    return channels


def _on_every_rank(channels, call):
    """``call(channel)`` on every rank at once; each rank's result or the exception it raised."""
    def run(channel):
        try:
            return call(channel)
        except Exception as exc:  # noqa: BLE001 - the test compares them
            return exc

    with ThreadPoolExecutor(len(channels)) as pool:
        return list(pool.map(run, channels))


def _check(channel, op, args, error=None, names=("x", "reduce_op"), **params):
    check_call(channel, fingerprint(op, args, names, **params), error)


def test_the_fingerprint_names_every_argument():
    x, w = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8)
    assert fingerprint("all_reduce_rmsnorm", [x, None, w, 1e-6], ("x", "residual", "weight"), mode="eager") == {
        "op": "all_reduce_rmsnorm", "x": "bfloat16[4, 8]", "residual": None, "weight": "float32[8]", "arg3": 1e-6,
        "mode": "eager"}
    assignment = make_expt_assignment(2, 5, make_expt_dict_uniform(2, 5))
    assert fingerprint("dp_to_ep", [assignment, object()]) == {
        "op": "dp_to_ep", "arg0": "5 experts on 2 shards, [3, 2] each", "arg1": "object"}


def test_matching_calls_pass_and_a_difference_raises_on_every_rank_naming_it():
    channels = _channels(2)
    same = _on_every_rank(channels, lambda ch: _check(ch, "all_reduce", [torch.ones(256), "sum"]))
    assert same == [None, None]
    sizes = _on_every_rank(channels, lambda ch: _check(ch, "all_reduce", [torch.ones(256 * (ch.rank + 1)), "sum"]))
    for error in sizes:
        assert isinstance(error, CallMismatchError) and isinstance(error, AgreementError)
        assert ("call 2 on this group differs across ranks or failed: x: rank 0 'float32[256]', rank 1 "
                "'float32[512]'") in str(error)
    ops = _on_every_rank(channels, lambda ch: _check(ch, "all_reduce", [torch.ones(8), "max" if ch.rank else "sum"]))
    assert all("reduce_op: rank 0 'sum', rank 1 'max'" in str(error) for error in ops)
    dtypes = _on_every_rank(channels, lambda ch: _check(ch, "all_reduce", [torch.ones(8, dtype=torch.float16
                                                                                    if ch.rank else torch.float32)]))
    assert all("x: rank 0 'float32[8]', rank 1 'float16[8]'" in str(error) for error in dtypes)
    after = _on_every_rank(channels, lambda ch: _check(ch, "dp_to_ep", [torch.ones(2, 4)], mode="eager"))
    assert after == [None, None]  # a mismatch leaves the channel in step


def test_a_local_failure_raises_there_and_is_named_on_every_other_rank():
    channels = _channels(3)
    bad = ValueError("residual of shape [3, 8] must be [4, 8]")
    said = _on_every_rank(channels, lambda ch: _check(ch, "all_reduce_rmsnorm", [torch.ones(4, 8)],
                                                      error=bad if ch.rank == 1 else None))
    assert said[1] is bad
    for rank in (0, 2):
        assert isinstance(said[rank], CallMismatchError)
        assert "rank 1: ValueError: residual of shape [3, 8] must be [4, 8]" in str(said[rank])


def test_another_op_on_one_rank_is_named():
    channels = _channels(3)
    said = _on_every_rank(channels, lambda ch: _check(ch, "ep_to_dp" if ch.rank == 2 else "dp_to_ep",
                                                      [torch.ones(2, 4)]))
    assert all("op: rank 0 'dp_to_ep', rank 1 'dp_to_ep', rank 2 'ep_to_dp'" in str(error) for error in said)


def test_a_rank_that_makes_no_call_is_an_agreement_error_within_the_deadline():
    channels = _channels(2, wait_s=0.3)
    with pytest.raises(AgreementError, match=r"rank\(s\) \[1\] of the group did not reach 'check.1' within 0.3 s"):
        _check(channels[0], "all_reduce", [torch.ones(4)])


def test_the_store_keeps_only_the_last_round_of_each_rank():
    store = dist.HashStore()
    channels = _channels(2, store=store)
    for _ in range(5):
        _on_every_rank(channels, lambda ch: _check(ch, "all_reduce", [torch.ones(4)]))
    prefix = channels[0].prefix
    kept = [(n, r) for n in range(1, 6) for r in range(2) if store.check([f"{prefix}check.{n}/{r}"])]
    assert kept == [(5, 0), (5, 1)]


def test_one_rank_checks_nothing_but_raises_its_own_error():
    (channel,) = _channels(1)
    _check(channel, "all_reduce", [torch.ones(4)])
    assert channel.rounds == {}
    with pytest.raises(ValueError, match="alone"):
        _check(channel, "all_reduce", [torch.ones(4)], error=ValueError("alone"))


# -- the public calls in checked mode, 2 gloo processes -----------------------------------------

def _raises_everywhere(call, *matches):
    with pytest.raises(CallMismatchError) as info:
        call()
    for match in matches:
        assert match in str(info.value), str(info.value)


def _all_reduces(autosymm, rank):
    x = torch.ones(256)
    autosymm.all_reduce(x)  # warm-up: prepared and cached on both ranks
    assert torch.equal(x, torch.full_like(x, 2.0))
    other = torch.ones(512 if rank else 256)
    _raises_everywhere(lambda: autosymm.all_reduce(other), "tensor: rank 0 'float32[256]', rank 1 'float32[512]'")
    _raises_everywhere(lambda: autosymm.all_reduce(torch.ones(256), op="max" if rank else "sum"),
                       "reduce_op: rank 0 'sum', rank 1 'max'")
    same_bytes = torch.ones(512, dtype=torch.bfloat16) if rank else torch.ones(256)
    _raises_everywhere(lambda: autosymm.all_reduce(same_bytes), "rank 0 'float32[256]', rank 1 'bfloat16[512]'")
    ints = torch.ones(256, dtype=torch.int32 if rank else torch.float32)
    _raises_everywhere(lambda: autosymm.all_reduce(ints), "rank 1 'int32[256]'")
    y = torch.full((256,), float(rank + 1))
    autosymm.all_reduce(y)  # still in step, and the cached call serves it
    assert torch.equal(y, torch.full_like(y, 3.0))


def _fused_calls(autosymm, rank):
    x, residual, weight = torch.ones(4, 64), torch.zeros(4, 64), torch.ones(64)
    autosymm.all_reduce_rmsnorm(x, residual, weight)  # warm-up
    assert torch.equal(residual, torch.full_like(residual, 2.0))
    wider = (torch.ones(4, 128), torch.zeros(4, 128), torch.ones(128)) if rank else (x, residual, weight)
    _raises_everywhere(lambda: autosymm.all_reduce_rmsnorm(*wider), "x: rank 0 'float32[4, 64]', rank 1 "
                       "'float32[4, 128]'", "weight: rank 0 'float32[64]', rank 1 'float32[128]'")
    more = (torch.ones(8, 64), torch.zeros(8, 64), weight) if rank == 0 else (x, residual, weight)
    _raises_everywhere(lambda: autosymm.all_reduce_rmsnorm(*more), "x: rank 0 'float32[8, 64]'")
    # a bad residual on one rank after warm-up: its own error there, named on the other; nothing changed
    x, residual = torch.ones(4, 64), torch.zeros(4, 64)
    bad = torch.zeros(64, 4).t() if rank == 1 else residual
    if rank == 1:
        with pytest.raises(ValueError, match="residual of shape .* is not contiguous"):
            autosymm.all_reduce_rmsnorm(x, bad, weight)
    else:
        _raises_everywhere(lambda: autosymm.all_reduce_rmsnorm(x, bad, weight), "rank 1: ValueError: autosymm."
                           "all_reduce_rmsnorm: residual of shape (4, 64)")
    assert torch.equal(x, torch.ones(4, 64)) and not bad.any()


def _moe_calls(autosymm, rank, world_size):
    assignment = autosymm.make_expt_assignment(world_size, 4, autosymm.make_expt_dict_uniform(world_size, 4))
    expt_indx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]], dtype=torch.int32)
    gate, _ = autosymm.route(expt_indx, 4)
    src = torch.randn(2, 8)
    autosymm.convert_dp_to_ep(src, assignment, expt_indx, gate)  # warm-up
    other = expt_indx.flip(0) if rank else expt_indx
    _raises_everywhere(lambda: autosymm.convert_dp_to_ep(src, assignment, other, autosymm.route(other, 4)[0]),
                       "expt_indx digest: rank 0 '")


def _sharded_calls(autosymm, rank):
    out, inp = torch.empty(4), torch.ones(8)
    autosymm.reduce_scatter_tensor(out, inp)  # warm-up
    bigger = (torch.empty(8), torch.ones(16)) if rank else (out, inp)
    _raises_everywhere(lambda: autosymm.reduce_scatter_tensor(*bigger), "input: rank 0 'float32[8]', rank 1 "
                       "'float32[16]'")
    gathered = torch.empty(16 if rank else 8)
    autosymm.all_gather_into_tensor(torch.empty(8), out)  # warm-up
    _raises_everywhere(lambda: autosymm.all_gather_into_tensor(gathered, torch.ones(8 if rank else 4)),
                       "output: rank 0 'float32[8]', rank 1 'float32[16]'")


def _checked(rank, world_size):
    from datetime import timedelta

    import autosymm
    from autosymm.runtime.agreement import AgreementError
    from autosymm.runtime.call_check import CheckedCache

    _all_reduces(autosymm, rank)
    state = autosymm.api.STATES[None]
    assert type(state.cache) is CheckedCache and state.check_calls
    _fused_calls(autosymm, rank)
    _moe_calls(autosymm, rank, world_size)
    _sharded_calls(autosymm, rank)
    calls = autosymm.stats()["nccl"]["calls"]
    state.channel.timeout = timedelta(seconds=2)
    if rank == 0:  # a peer that makes no call: an AgreementError within the deadline, not a hang
        with pytest.raises(AgreementError, match=r"rank\(s\) \[1\] of the group did not reach 'check\."):
            autosymm.all_reduce(torch.ones(256))
    return calls


def test_calls_that_differ_after_warm_up_raise_on_every_rank_in_checked_mode(tmp_path):
    from _gloo import run_gloo

    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"},
           0: {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10",
               "AUTOSYMM_CHECK_CALLS": "1"}}  # on one rank: every rank checks (and rank 0 warns of the difference)
    calls = run_gloo(_checked, 2, env=env, deadline_s=150)
    assert calls[0] == calls[1] == 2  # the two all-reduces that ran; no refused call is counted


def _unchecked(rank, world_size):
    import autosymm

    autosymm.all_reduce(torch.ones(8))
    state = autosymm.api.STATES[None]
    return type(state.cache) is dict and not state.check_calls and state.channel.rounds == {}


def test_off_nothing_is_checked_and_the_cache_is_a_plain_dict(tmp_path):
    from _gloo import run_gloo

    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert run_gloo(_unchecked, 2, env=env, deadline_s=120) == {0: True, 1: True}

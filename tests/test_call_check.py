"""autosymm.call_check, the checked mode (AUTOSYMM_CHECK_CALLS): ranks as threads over one
in-memory c10d store here; the public calls in checked mode over gloo processes below."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from autosymm import agreement
from autosymm.agreement import AgreementError, Exchange
from autosymm.call_check import CallMismatchError, check_call, fingerprint
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

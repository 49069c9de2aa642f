"""autosymm.call_check, the checked mode (AUTOSYMM_CHECK_CALLS): ranks as threads over one
in-memory c10d store here; the public calls in checked mode over gloo processes below."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from autosymm import agreement
from autosymm.agreement import AgreementError, Exchange
from autosymm.call_check import CallMismatchError, check_call, fingerprint


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


def test_the_fingerprint_names_op_dtypes_shapes_and_params():
    x, w = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8)
    assert fingerprint("all_reduce_rmsnorm", [x, None, w], mode="eager") == {
        "op": "all_reduce_rmsnorm", "dtypes": ["bfloat16", None, "float32"], "shapes": [[4, 8], None, [8]],
        "mode": "eager"}


def test_matching_calls_pass_and_a_difference_raises_on_every_rank_naming_it():
    channels = _channels(2)
    same = _on_every_rank(channels, lambda ch: check_call(ch, "all_reduce", [torch.ones(256)], reduce_op="sum"))
    assert same == [None, None]
    sizes = _on_every_rank(channels, lambda ch: check_call(ch, "all_reduce", [torch.ones(256 * (ch.rank + 1))],
                                                           reduce_op="sum"))
    for error in sizes:
        assert isinstance(error, CallMismatchError) and isinstance(error, AgreementError)
        assert "call 2 on this group differs across ranks: shapes: rank 0 [[256]], rank 1 [[512]]" in str(error)
    ops = _on_every_rank(channels, lambda ch: check_call(ch, "all_reduce", [torch.ones(8)],
                                                         reduce_op="max" if ch.rank else "sum"))
    assert all("reduce_op: rank 0 'sum', rank 1 'max'" in str(error) for error in ops)
    dtypes = _on_every_rank(channels, lambda ch: check_call(ch, "all_reduce", [torch.ones(8, dtype=torch.float16
                                                                                          if ch.rank else torch.float32)]))
    assert all("dtypes: rank 0 ['float32'], rank 1 ['float16']" in str(error) for error in dtypes)
    after = _on_every_rank(channels, lambda ch: check_call(ch, "dp_to_ep", [torch.ones(2, 4)]))
    assert after == [None, None]  # a mismatch leaves the channel in step


def test_another_op_on_one_rank_is_named():
    channels = _channels(3)
    said = _on_every_rank(channels, lambda ch: check_call(ch, "ep_to_dp" if ch.rank == 2 else "dp_to_ep",
                                                          [torch.ones(2, 4)]))
    assert all("op: rank 0 'dp_to_ep', rank 1 'dp_to_ep', rank 2 'ep_to_dp'" in str(error) for error in said)


def test_a_rank_that_makes_no_call_is_an_agreement_error_within_the_deadline():
    channels = _channels(2, wait_s=0.3)
    with pytest.raises(AgreementError, match=r"rank\(s\) \[1\] of the group did not reach 'check.1' within 0.3 s"):
        check_call(channels[0], "all_reduce", [torch.ones(4)])


def test_the_store_keeps_only_the_last_round_of_each_rank():
    store = dist.HashStore()
    channels = _channels(2, store=store)
    for _ in range(5):
        _on_every_rank(channels, lambda ch: check_call(ch, "all_reduce", [torch.ones(4)]))
    prefix = channels[0].prefix
    kept = [(n, r) for n in range(1, 6) for r in range(2) if store.check([f"{prefix}check.{n}/{r}"])]
    assert kept == [(5, 0), (5, 1)]


def test_one_rank_checks_nothing():
    (channel,) = _channels(1)
    check_call(channel, "all_reduce", [torch.ones(4)])
    assert channel.rounds == {}

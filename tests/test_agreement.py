"""autosymm.agreement: the one rank-consensus channel (two ranks as threads over one in-memory
c10d store; the multi-process cases run in tests/test_faults.py and tests/tuning/test_rank_comm.py)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from autosymm import agreement
from autosymm.agreement import AgreementError, Exchange


class Group:
    group_name = "test-agreement"


def _channels(world_size: int, wait_s: float = 10.0) -> list[Exchange]:
    store, channels = dist.HashStore(), []
    for rank in range(world_size):
        agreement._GENERATIONS.pop(Group.group_name, None)  # each simulated rank counts as its own process
        channels.append(Exchange(Group(), rank, world_size, store=store, wait_s=wait_s))
    return channels


def _on_every_rank(channels, call):
    with ThreadPoolExecutor(len(channels)) as pool:
        return list(pool.map(call, channels))


def test_all_ok_names_the_ranks_that_failed_the_same_on_every_rank():
    channels = _channels(3)
    assert _on_every_rank(channels, lambda ch: ch.all_ok("step", True)) == [[], [], []]
    said = _on_every_rank(channels, lambda ch: ch.all_ok("step", ch.rank != 1, "" if ch.rank != 1 else "no room"))
    assert said == [["rank 1: no room"]] * 3
    assert [ch.rounds for ch in channels] == [{"step": 2}] * 3  # numbered rounds: keys never reused


def test_round_tags_count_per_tag():
    (channel,) = _channels(1)
    assert [channel.round_tag("a"), channel.round_tag("b"), channel.round_tag("a")] == ["a.1", "b.1", "a.2"]
    assert channel.all_ok("a", False, "alone") == ["rank 0: alone"]  # one rank: no store traffic


def test_a_peer_that_never_reports_is_an_error_naming_it_within_the_deadline():
    channel = _channels(2, wait_s=0.2)[0]
    with pytest.raises(AgreementError, match=r"rank\(s\) \[1\] of the group did not reach 'step.1' within 0.2 s"):
        channel.all_ok("step", True)

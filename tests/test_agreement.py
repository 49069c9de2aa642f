"""autosymm.runtime.agreement: the one rank-consensus channel (two ranks as threads over one in-memory
c10d store; the multi-process cases run in tests/test_faults.py and tests/tuning/test_rank_comm.py)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from autosymm.runtime import agreement
from autosymm.runtime.agreement import AgreementError, Exchange


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


def _store_host_dies(rank, world_size, port, queue):
    """Rank 0 (the c10d store host) exits after a first exchange; rank 1's next one must say so."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTOSYMM_AGREE_TIMEOUT_S="5")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    channel = Exchange(None, rank, world_size)
    channel.exchange("first", {"rank": rank})
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.set("first read", "1")  # rank 1 has read every 'first' report: the store may go
    if rank == 0:
        store.wait(["first read"])
        queue.put((rank, "exiting", None))
        queue.close()
        queue.join_thread()
        os._exit(0)  # the store's server goes with this process
    import time

    time.sleep(1.0)
    try:
        channel.exchange("second", {"rank": rank})
        queue.put((rank, "no error", None))
    except AgreementError as exc:
        queue.put((rank, str(exc), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put((rank, "", f"{type(exc).__name__}: {exc}"))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no process-group teardown: its peer is gone


def test_the_store_host_dying_is_an_agreement_error_naming_rank_0():
    from _gloo import run_with_deadline

    reports = run_with_deadline(_store_host_dies, 2, deadline_s=60)
    assert reports[0] == "exiting"
    assert "global rank 0 (the store host)" in reports[1] and "lost the c10d store (127.0.0.1:" in reports[1]
    assert "'second'" in reports[1] and "DistNetworkError" in reports[1]


def _late_and_waiting(channels, late_rank: int, late_by_s: float):
    """Every rank exchanges 'step'; ``late_rank`` starts ``late_by_s`` seconds after the others.
    Each rank's result: its reports, or the AgreementError it raised."""
    import time

    def run(channel):
        if channel.rank == late_rank:
            time.sleep(late_by_s)
        try:
            return channel.exchange("step", {"rank": channel.rank})
        except AgreementError as exc:
            return exc

    return _on_every_rank(channels, run)


def test_a_rank_later_than_the_deadline_raises_too_instead_of_going_on_alone():
    said = _late_and_waiting(_channels(3, wait_s=0.3), late_rank=0, late_by_s=0.8)
    assert all(isinstance(error, AgreementError) for error in said), said
    for rank in (1, 2):
        assert "rank(s) [0] of the group did not reach 'step'" in str(said[rank])
    assert "this rank (rank 0) reached 'step' after rank 1 gave up waiting for it after 0.3 s" in str(said[0]) or \
        "this rank (rank 0) reached 'step' after rank 2 gave up waiting for it after 0.3 s" in str(said[0])


def test_a_rank_in_time_goes_on_with_every_report():
    said = _late_and_waiting(_channels(2, wait_s=5.0), late_rank=1, late_by_s=0.2)
    assert said == [[{"rank": 0}, {"rank": 1}]] * 2


class _DeadlineAlwaysPasses:
    """A store whose ``wait`` always times out, as if a peer's report landed just after the deadline."""

    def __init__(self, store):
        self.store = store

    def wait(self, keys, timeout):
        raise dist.DistStoreError("wait timeout")

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_report_landing_between_the_deadline_and_the_verdict_counts():
    on_time, _ = _channels(2)
    on_time.store.set(f"{on_time.prefix}step/1", '{"rank": 1}')  # rank 1 reported just after the deadline
    on_time.store = _DeadlineAlwaysPasses(on_time.store)
    assert on_time.exchange("step", {"rank": 0}) == [{"rank": 0}, {"rank": 1}]  # not "rank(s) []"


def test_a_verdict_is_a_failure_for_every_rank_that_reads_it():
    channels = _channels(3, wait_s=0.3)
    channels[1].store = _DeadlineAlwaysPasses(channels[1].store)
    # rank 1 gives up on rank 2, which never comes; rank 0 comes later and reads rank 1's verdict
    with pytest.raises(AgreementError, match=r"rank\(s\) \[0, 2\] of the group did not reach 'step' within 0.3 s"):
        channels[1].exchange("step", {"rank": 1})
    with pytest.raises(AgreementError, match=r"this rank \(rank 0\) reached 'step' after rank 1 gave up"):
        channels[0].exchange("step", {"rank": 0})

"""Timing statistics with a fake clock, and MAX over ranks with gloo."""

from __future__ import annotations

import math

import pytest
from _gloo import run_gloo

from autosymm.tuning.timing import HostClock, Timing, comm_device, max_over_ranks, percentile, time_eager, time_graph


class FakeClock:
    """Time (us) advances only when the fake op says so."""

    def __init__(self):
        self.now = 0.0
        self.synced = 0

    def mark(self):
        return self.now

    def synchronize(self):
        self.synced += 1

    def elapsed_us(self, start, end):
        return end - start


class FakeOp:
    """Each call advances the clock by the next duration (cycling) and records its argument."""

    def __init__(self, clock, durations):
        self.clock, self.durations, self.seen = clock, list(durations), []

    def __call__(self, x):
        self.clock.now += self.durations[len(self.seen) % len(self.durations)]
        self.seen.append(x)


def test_percentiles_match_linear_interpolation():
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == 5.5 and percentile(values, 10) == pytest.approx(1.9)
    assert percentile(values, 90) == pytest.approx(9.1) and percentile([3.0], 90) == 3.0
    t = Timing.from_samples([5, 1, 4, 2, 3])
    assert (t.median_us, t.p10_us, t.p90_us, t.samples) == (3.0, pytest.approx(1.4), pytest.approx(4.6), 5)
    assert Timing.from_samples([1.0, math.nan]) == Timing.failed() and not Timing.failed().ok
    with pytest.raises(ValueError):
        Timing.from_samples([])


def test_time_eager_rotates_inputs_and_counts_calls():
    clock = FakeClock()
    op = FakeOp(clock, [10.0])
    warmup_durations = 3
    op.durations = [999.0] * warmup_durations + [float(d) for d in range(1, 21)]  # warm-up is not timed
    timing = time_eager(op, [("a",), ("b",), ("c",)], warmup=warmup_durations, repeats=20, clock=clock)
    assert op.seen == ["a", "b", "c"] * 7 + ["a", "b"]  # 3 warm-up + 20 timed calls, rotating
    assert timing.samples == 20 and timing.median_us == 10.5
    assert timing.p10_us == pytest.approx(2.9) and timing.p90_us == pytest.approx(18.1)
    assert clock.synced == 1  # one synchronisation, after the last event


def test_time_eager_batches_tiny_calls():
    clock = FakeClock()
    op = FakeOp(clock, [2.0, 4.0])
    timing = time_eager(op, ["x", "y"], warmup=0, repeats=5, calls_per_sample=4, clock=clock)
    assert len(op.seen) == 20 and timing.median_us == 3.0 and timing.samples == 5
    with pytest.raises(ValueError):
        time_eager(op, ["x"], repeats=0, clock=clock)
    with pytest.raises(ValueError):
        time_eager(op, [], clock=clock)


def test_time_graph_divides_replays_by_calls():
    clock = FakeClock()
    op = FakeOp(clock, [5.0, 7.0, 9.0])
    captured = {}

    def fake_capture(fn, args, calls, warmup):
        captured.update(calls=calls, warmup=warmup, args=list(args))

        def replay():
            for i in range(calls):
                fn(*args[i % len(args)])

        return replay

    timing = time_graph(op, [1, 2, 3], warmup=2, repeats=4, clock=clock, capture=fake_capture)
    assert captured == {"calls": 3, "warmup": 2, "args": [(1,), (2,), (3,)]}
    assert timing.median_us == 7.0 and timing.samples == 4
    assert len(op.seen) == 3 * (2 + 4)  # two warm-up replays, four timed ones


def test_host_clock_and_no_group():
    timing = time_eager(lambda: None, [()], warmup=1, repeats=5, clock=HostClock())
    assert timing.ok and timing.samples == 5
    assert max_over_ranks(timing) is timing  # no process group: unchanged


def _max_over_ranks_body(rank, world_size):
    import torch
    import torch.distributed as dist

    assert comm_device(None) == torch.device("cpu")
    mine = Timing(10.0 + rank, 20.0 - rank, 30.0 + 2 * rank, 5 + rank)
    combined = max_over_ranks(mine)
    assert combined == Timing(10.0 + world_size - 1, 20.0, 30.0 + 2 * (world_size - 1), 5 + world_size - 1)
    failed = max_over_ranks(Timing(math.nan, 1.0, 1.0, 3) if rank == 1 else mine)
    assert math.isinf(failed.median_us) and not failed.ok
    clock = FakeClock()
    op = FakeOp(clock, [1.0 + rank])
    timing = max_over_ranks(time_eager(op, [("x",)], warmup=1, repeats=3, group=dist.group.WORLD, clock=clock))
    assert timing.median_us == float(world_size)


def test_max_over_ranks_with_gloo():
    run_gloo(_max_over_ranks_body, 2)

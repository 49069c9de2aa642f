"""autosymm.tuning.rank_comm: what the ranks agree on comes back as named fields (one process,
then two gloo ranks); calls under a timeout."""

from __future__ import annotations

import math
import time

from _gloo import run_gloo

from autosymm.tuning.rank_comm import Agreement, RankComm, call_with_timeout
from autosymm.tuning.timing import Timing


def test_agreement_names_the_ranks():
    agreement = Agreement(failed_ranks=(0, 2, 3), timed_out_ranks=(2,))
    assert agreement.failed and agreement.timed_out and agreement.raised_ranks == (0, 3)
    assert not Agreement().failed and not Agreement().timed_out and Agreement().raised_ranks == ()


def test_without_a_process_group_this_rank_is_rank_0():
    comm = RankComm(None)
    assert not comm.active and comm.world_size == 1 and comm.rank == 0
    assert comm.agree(failed=True, timed_out=True) == Agreement((0,), (0,))
    assert comm.agree(failed=False) == Agreement((), ())
    timing = Timing(2.0, 1.0, 3.0, 5)
    assert comm.combine_measurement(timing, "ok") == (timing, Agreement())
    assert comm.combine_measurement(timing, "error") == (Timing.failed(), Agreement((0,), ()))


def _two_ranks(rank, world_size):
    comm = RankComm(None)
    mine = Timing(10.0 * (rank + 1), 5.0, 20.0 - rank, 10 + rank)
    return {
        "agree": comm.agree(failed=rank == 1, timed_out=rank == 1),
        "nobody": comm.agree(failed=False),
        "ok": comm.combine_measurement(mine, "ok"),
        "nan": comm.combine_measurement(Timing(math.nan, 1.0, 1.0, 1) if rank else mine, "ok"),
        "mixed": comm.combine_measurement(mine, {0: "error", 1: "timeout"}[rank]),
        "one": comm.combine_measurement(mine, "ok" if rank else "error"),
    }


def test_two_gloo_ranks_agree_on_named_fields():
    reports = run_gloo(_two_ranks, 2)
    assert reports[0] == reports[1], "every rank holds the same agreement"
    r = reports[0]
    assert r["agree"] == Agreement(failed_ranks=(1,), timed_out_ranks=(1,))
    assert r["nobody"] == Agreement()
    assert r["ok"] == (Timing(20.0, 5.0, 20.0, 11), Agreement())  # element-wise MAX: the slowest rank
    assert r["nan"][0] == Timing(math.inf, 5.0, 20.0, 10) and not r["nan"][1].failed  # NaN counts as +inf
    timing, agreement = r["mixed"]
    assert timing == Timing.failed() and agreement.failed_ranks == (0, 1) and agreement.timed_out_ranks == (1,)
    assert agreement.raised_ranks == (0,)
    assert r["one"] == (Timing.failed(), Agreement(failed_ranks=(0,)))


def test_call_with_timeout_reports_instead_of_raising():
    assert call_with_timeout(lambda x: x + 1, 1, None)[:3] == ("ok", 2, None)
    status, value, detail, _ = call_with_timeout(lambda x: 1 / x, 0, 5.0)
    assert (status, value) == ("error", None) and detail.startswith("ZeroDivisionError")
    status, _, detail, thread = call_with_timeout(time.sleep, 0.5, 0.05)
    assert status == "timeout" and detail == "no result after 0.05 s" and thread.is_alive()
    thread.join()

"""autosymm.tuning.outcome: the rows a tune writes are stored under the key the dispatcher reads a
call by (one key, Key.for_problem), so a tuned problem is served by its own row."""

from autosymm.backends import Capabilities
from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db.store import Key, Row, TuningDB
from autosymm.db.read import DBSource
from autosymm.runtime.dispatch import decide
from autosymm.problem import MoEShape, Problem
from autosymm.tuning.outcome import Candidate, TrialResult, TuneOutcome
from autosymm.tuning.timing import Timing

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=2, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, intra_node=True,
                    compute_capability=(9, 0))


def _outcome(problem: Problem, tuned: Candidate, baseline: Candidate) -> TuneOutcome:
    fast = TrialResult(tuned, Timing(4.0, 3.5, 4.5, 10))
    slow = TrialResult(baseline, Timing(20.0, 19.0, 21.0, 10))
    return TuneOutcome(problem, fast, [fast, slow], slow)


def test_a_tuned_problem_is_read_back_at_its_own_key():
    all_reduce = Problem.all_reduce(3 * 1024 * 1024 // 2, world_size=2)  # 1.5 MiB: not a power of two
    moe = Problem.moe("dp_to_ep", MoEShape(7168, 256, 8), 96, world_size=2)
    cases = [(all_reduce, Candidate("triton_one_shot", AllReduceConfig("one_shot", 2048, 4, 8)), Candidate("nccl")),
             (moe, Candidate("triton_moe", MoEConfig(1024, 4)), Candidate("nccl_all_to_all"))]
    for problem, tuned, baseline in cases:
        for mode in ("eager", "graph"):
            rows = [Row(**row) for row in _outcome(problem, tuned, baseline).rows(mode=mode, hardware=HW)]
            assert {row.key for row in rows} == {Key.for_problem(HW, problem, mode)}
            with TuningDB() as db:
                db.record_many(rows)
                decision = decide(problem, mode, CAPS, [DBSource(db, "tuned.sqlite")], HW)
            assert (decision.backend, decision.config, decision.expected_us) == (tuned.backend, tuned.config, 4.0)
            assert decision.bucket == problem.bucket and decision.nccl_us == 20.0 and decision.mode == mode

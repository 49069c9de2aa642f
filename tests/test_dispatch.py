"""Decision tables of autosymm.runtime.dispatch over temporary databases."""

import pytest

from autosymm.backends import Capabilities
from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db.store import Row, TuningDB
from autosymm.backends.triton_moe import DEFAULT_MOE_CONFIG
from autosymm.runtime.dispatch import DBSource, decide
from autosymm.problem import MODEL_SHAPES, MoEShape, Problem

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=2, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, has_multicast=False,
                    intra_node=True, torch_symm_ops=True, compute_capability=(9, 0))
ONE_SHOT = AllReduceConfig("one_shot", 2048, 4, 8)
TWO_SHOT = AllReduceConfig("two_shot", 4096, 32, 16)
MULTIMEM = AllReduceConfig("multimem", 4096, 32, 16)


def _row(backend, bucket, us, config=None, mode="eager", dtype="bf16", op="all_reduce", shape="", nccl_us=None):
    return Row(hardware=HW, world_size=2, op=op, dtype=dtype, bucket=bucket, backend=backend, median_us=us,
               shape=shape, mode=mode, config=config, nccl_us=nccl_us, gpu="NVIDIA H200")


@pytest.fixture
def shipped():
    db = TuningDB(":memory:")
    for bucket in (4096, 65536, 1 << 20):
        db.record_many([
            _row("nccl", bucket, 20.0, nccl_us=20.0),
            _row("triton_one_shot", bucket, 5.0 if bucket < (1 << 20) else 12.0, ONE_SHOT, nccl_us=20.0),
            _row("triton_two_shot", bucket, 9.0, TWO_SHOT, nccl_us=20.0),
            _row("triton_multimem", bucket, 3.0, MULTIMEM, nccl_us=20.0),  # fastest, but needs multicast
        ])
    db.record_many([_row("nccl", 1 << 28, 900.0, nccl_us=900.0)])
    db.record_many([_row("triton_two_shot", 1 << 28, 1000.0, TWO_SHOT, nccl_us=900.0)])  # NCCL faster here
    db.record_many([_row("triton_two_shot", 65536, 4.0, TWO_SHOT, mode="graph", nccl_us=15.0)])
    return DBSource(db, "shipped.sqlite")


def _ar(nbytes, dtype="bf16", world_size=2):
    return Problem.all_reduce(nbytes, dtype, world_size)


def test_fastest_servable_row_wins_and_unservable_is_skipped(shipped):
    decision = decide(_ar(4096), "eager", CAPS, [shipped], HW)
    assert decision.backend == "triton_one_shot" and decision.config == ONE_SHOT
    assert decision.expected_us == 5.0 and decision.nccl_us == 20.0
    assert decision.source == "shipped.sqlite"
    assert any(s.startswith("triton_multimem") for s in decision.skipped)


def test_multimem_used_only_with_multicast(shipped):
    caps = Capabilities(**{**CAPS.__dict__, "has_multicast": True})
    assert decide(_ar(4096), "eager", caps, [shipped], HW).backend == "triton_multimem"


def test_nccl_wins_where_it_measured_faster(shipped):
    decision = decide(_ar(1 << 28), "eager", CAPS, [shipped], HW)
    assert decision.backend == "nccl" and decision.expected_us == 900.0


@pytest.mark.parametrize("nbytes, bucket", [(1, 4096), (4097, 4096), (65536, 65536), (70000, 65536),
                                            (3 << 20, 1 << 20), (1 << 30, 1 << 28)])
def test_calls_between_tuned_sizes_use_a_neighbour(shipped, nbytes, bucket):
    # the one-shot config (2048 x 4 programs) covers 16 KiB in one round: from 4 KiB up to it,
    # and beyond (1 MiB's 12 us grows with the bytes), it stays the fastest modelled row
    assert decide(_ar(nbytes), "eager", CAPS, [shipped], HW).bucket == bucket


def test_user_db_comes_before_shipped(shipped):
    user = TuningDB(":memory:")
    user.record_many([_row("triton_two_shot", 4096, 7.0, TWO_SHOT)])
    decision = decide(_ar(4096), "eager", CAPS, [DBSource(user, "user.sqlite"), shipped], HW)
    assert decision.backend == "triton_two_shot" and decision.source == "user.sqlite"


def test_graph_mode_rows_and_mode_fallback(shipped):
    graph = decide(_ar(65536), "graph", CAPS, [shipped], HW)
    assert graph.backend == "triton_two_shot" and graph.expected_us == 4.0 and graph.mode == "graph"
    # graph rows exist only at 64 KiB: a 4 KiB call is modelled from them
    below = decide(_ar(4096), "graph", CAPS, [shipped], HW)
    assert below.bucket == 65536 and "below the smallest tuned size" in below.reason
    eager_only = TuningDB(":memory:")
    eager_only.record_many([_row("triton_one_shot", 4096, 5.0, ONE_SHOT)])
    other = decide(_ar(4096), "graph", CAPS, [DBSource(eager_only, "e.sqlite")], HW)
    assert other.backend == "triton_one_shot" and "eager-mode row" in other.reason


def test_other_dtype_uses_bf16_row_of_same_bytes(shipped):
    decision = decide(_ar(4096, dtype="fp32"), "eager", CAPS, [shipped], HW)
    assert decision.backend == "triton_one_shot" and "bf16" in decision.reason


def test_no_rows_falls_back_to_nccl():
    empty = DBSource(TuningDB(":memory:"), "empty.sqlite")
    decision = decide(_ar(4096), "eager", CAPS, [empty], HW)
    assert decision.backend == "nccl" and "no tuned row" in decision.reason
    assert decide(_ar(4096), "eager", CAPS, [], "other-hardware").backend == "nccl"


def test_rows_of_other_hardware_or_world_size_are_not_used(shipped):
    assert decide(_ar(4096), "eager", CAPS, [shipped], "nvidia-h100-nvlink").backend == "nccl"
    caps4 = Capabilities(**{**CAPS.__dict__, "world_size": 4})
    assert decide(_ar(4096, world_size=4), "eager", caps4, [shipped], HW).backend == "nccl"


def test_size_over_workspace_skips_symmetric_backends(shipped):
    small = Capabilities(**{**CAPS.__dict__, "all_reduce_bytes": 1024})
    decision = decide(_ar(4096), "eager", small, [shipped], HW)
    assert decision.backend == "nccl"
    assert any("triton_one_shot" in s for s in decision.skipped)


def test_world_size_one_is_noop_and_multinode_is_nccl(shipped, monkeypatch):
    caps1 = Capabilities(**{**CAPS.__dict__, "world_size": 1})
    assert decide(_ar(4096, world_size=1), "eager", caps1, [shipped], HW).backend == "noop"
    multi = Capabilities(**{**CAPS.__dict__, "intra_node": False})
    assert decide(_ar(4096), "eager", multi, [shipped], HW).reason.startswith("group spans nodes")


def test_disable_env_forces_nccl(shipped, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DISABLE", "1")
    decision = decide(_ar(4096), "eager", CAPS, [shipped], HW)
    assert decision.backend == "nccl" and "AUTOSYMM_DISABLE" in decision.reason


def test_moe_rows_and_untuned_default():
    shape = MODEL_SHAPES["deepseek-v3"]
    db = TuningDB(":memory:")
    tuned = MoEConfig(2048, 8, 2, 132)
    db.record_many([_row("triton_moe", 128, 30.0, tuned, op="dp_to_ep", shape=shape.key, nccl_us=400.0)])
    db.record_many([_row("nccl_all_to_all", 128, 400.0, None, op="dp_to_ep", shape=shape.key, nccl_us=400.0)])
    source = DBSource(db, "moe.sqlite")
    problem = Problem.moe("dp_to_ep", shape, 100, "bf16", 2)
    decision = decide(problem, "eager", CAPS, [source], HW)
    assert decision.backend == "triton_moe" and decision.config == tuned and decision.bucket == 128
    no_rows = DBSource(TuningDB(":memory:"), "empty.sqlite")
    fallback = decide(problem, "graph", CAPS, [no_rows], HW)
    assert fallback.backend == "triton_moe" and fallback.config == DEFAULT_MOE_CONFIG
    assert "untuned default" in fallback.reason
    no_workspace = Capabilities(world_size=2)
    assert decide(problem, "eager", no_workspace, [no_rows], HW).backend == "nccl_all_to_all"


def test_graph_mode_skips_backends_that_cannot_be_captured():
    shape = MODEL_SHAPES["mixtral-8x7b"]
    db = TuningDB(":memory:")
    db.record_many([_row("nccl_all_to_all", 1, 20.0, None, op="ep_to_dp", shape=shape.key)])  # pretend it won eagerly
    db.record_many([_row("triton_moe", 1, 25.0, MoEConfig(512, 4), op="ep_to_dp", shape=shape.key)])
    source = DBSource(db, "moe.sqlite")
    problem = Problem.moe("ep_to_dp", shape, 1, "bf16", 2)
    assert decide(problem, "eager", CAPS, [source], HW).backend == "nccl_all_to_all"
    graph = decide(problem, "graph", CAPS, [source], HW)
    assert graph.backend == "triton_moe" and "nccl_all_to_all: not CUDA-graph capturable" in graph.skipped


def test_rows_of_other_torch_or_triton_versions_serve_and_say_so():
    import torch

    from autosymm.hardware import running_versions

    db = TuningDB(":memory:")
    old = Row(hardware=HW, world_size=2, op="all_reduce", dtype="bf16", bucket=4096, backend="triton_one_shot",
              median_us=5.0, config=ONE_SHOT, torch_version="0.0.1", triton_version=running_versions()[1])
    db.record_many([old])
    decision = decide(Problem.all_reduce(4096), "eager", CAPS, [DBSource(db, "x")], HW)
    assert decision.backend == "triton_one_shot"
    assert "measured with torch 0.0.1" in decision.reason and f"running torch {torch.__version__}" in decision.reason
    db.record_many([Row(**{**old.to_dict(), "torch_version": torch.__version__})])
    assert "measured with" not in decide(Problem.all_reduce(4096), "eager", CAPS, [DBSource(db, "x")], HW).reason


# ------------------------------------------------------------------ calls between tuned sizes

PUSH_2M = AllReduceConfig("one_shot_push", 16384, 64, 32)  # 2 MiB in one round: 64 chunks, 64 programs
PULL_2M = AllReduceConfig("one_shot", 8192, 96, 32)
PULL_3M = AllReduceConfig("one_shot", 8192, 132, 32)
PUSH_4M = AllReduceConfig("one_shot_push", 16384, 132, 32)
MiB = 1 << 20


def _ladder(path, with_3mib=True):
    """Graph rows at 4 KiB, 2, (3,) 4 MiB shaped like the 2x H200 ones; a file, like a user DB."""
    db = TuningDB(path)
    rows = [_row("triton_one_shot_push", 4096, 4.6, AllReduceConfig("one_shot_push", 2048, 1, 16), "graph"),
            _row("triton_one_shot", 4096, 5.2, AllReduceConfig("one_shot", 2048, 1, 8), "graph"),
            _row("nccl", 4096, 11.0, mode="graph"),
            _row("triton_one_shot_push", 2 * MiB, 12.18, PUSH_2M, "graph", nccl_us=28.66),
            _row("triton_one_shot", 2 * MiB, 13.57, PULL_2M, "graph", nccl_us=28.66),
            _row("nccl", 2 * MiB, 28.66, mode="graph", nccl_us=28.66),
            _row("triton_one_shot_push", 4 * MiB, 18.87, PUSH_4M, "graph", nccl_us=35.65),
            _row("nccl", 4 * MiB, 35.65, mode="graph", nccl_us=35.65)]
    if with_3mib:
        rows += [_row("triton_one_shot", 3 * MiB, 16.9, PULL_3M, "graph", nccl_us=32.0),
                 _row("triton_multimem", 3 * MiB, 10.0, MULTIMEM, "graph", nccl_us=32.0),  # no multicast here
                 _row("nccl", 3 * MiB, 32.0, mode="graph", nccl_us=32.0)]
    db.record_many(rows)
    return DBSource(TuningDB(path, readonly=True), str(path))


def test_a_tuned_size_uses_its_own_rows(tmp_path):
    decision = decide(_ar(3 * MiB), "graph", CAPS, [_ladder(tmp_path / "l.sqlite")], HW)
    assert decision.config == PULL_3M and decision.expected_us == 16.9 and decision.nccl_us == 32.0
    assert decision.reason.startswith("tuned graph row at 3MiB") and "between" not in decision.reason
    assert decision.skipped == ("triton_multimem: no multicast",)


def test_between_two_tuned_sizes_the_modelled_fastest_neighbour_wins(tmp_path):
    decision = decide(_ar(3_000_000), "graph", CAPS, [_ladder(tmp_path / "l.sqlite")], HW)
    # 2 MiB's push config needs a second round at 3 MB (92 chunks on 64 programs); 3 MiB's pull
    # config makes two rounds at both sizes and keeps its time
    assert decision.config == PULL_3M and decision.bucket == 3 * MiB and decision.expected_us == pytest.approx(16.9)
    assert "call of 3000000 B between tuned 2MiB and 3MiB; modelled 16.90 us" in decision.reason
    share = (3_000_000 - 2 * MiB) / MiB
    assert decision.nccl_us == pytest.approx(28.66 + (32.0 - 28.66) * share)  # NCCL: interpolated
    assert decision.skipped == ("triton_multimem: no multicast",)


def test_a_power_of_two_database_still_serves_between_its_buckets(tmp_path):
    """The issue's case: 3 MB on the 4 MiB bucket's push config took the 4 MiB time (19.5 us against
    16.9 tuned at 3 MB); the 2 MiB pull config serves 3 MB in the rounds it makes at 2 MiB."""
    decision = decide(_ar(3_000_000), "graph", CAPS, [_ladder(tmp_path / "p.sqlite", with_3mib=False)], HW)
    assert decision.config == PULL_2M and decision.expected_us < 18.87
    assert "between tuned 2MiB and 4MiB" in decision.reason


def test_a_config_that_covers_its_size_exactly_is_not_stretched_over_a_larger_call(tmp_path):
    decision = decide(_ar(2 * MiB + 2), "graph", CAPS, [_ladder(tmp_path / "l.sqlite")], HW)  # odd element count
    assert decision.config != PUSH_2M and decision.bucket in (2 * MiB, 3 * MiB)


def test_decisions_are_pure_and_independent_of_row_order(tmp_path):
    source = _ladder(tmp_path / "l.sqlite")
    reverse = TuningDB(tmp_path / "r.sqlite")
    reverse.record_many(list(reversed(source.db.rows())))
    for nbytes in (100, 6146, 100_000, 3_000_000, 2 * MiB + 2, 5 * MiB, 300 * MiB):
        first = decide(_ar(nbytes), "graph", CAPS, [source], HW)
        assert first == decide(_ar(nbytes), "graph", CAPS, [source], HW)
        again = decide(_ar(nbytes), "graph", CAPS, [DBSource(reverse, str(tmp_path / "l.sqlite"))], HW)
        assert (again.backend, again.config, again.expected_us, again.reason) == (
            first.backend, first.config, first.expected_us, first.reason)


def test_outside_the_tuned_range_the_nearest_size_is_scaled(tmp_path):
    source = _ladder(tmp_path / "l.sqlite")
    tiny = decide(_ar(100), "graph", CAPS, [source], HW)
    assert tiny.bucket == 4096 and tiny.expected_us == 4.6 and "below the smallest tuned size" in tiny.reason
    huge = decide(_ar(64 * MiB), "graph", CAPS, [source], HW)
    assert huge.bucket == 4 * MiB and "above the largest tuned size" in huge.reason
    assert huge.expected_us > 16 * 18.87 * 0.7  # grows with the bytes: never the 4 MiB time


def test_points_come_from_every_database_the_user_db_first(tmp_path):
    shipped = _ladder(tmp_path / "shipped.sqlite", with_3mib=False)
    user = TuningDB(tmp_path / "user.sqlite")
    user.record_many([_row("triton_one_shot", 3 * MiB, 16.9, PULL_3M, "graph"),
                      _row("nccl", 4 * MiB, 30.0, mode="graph")])  # shadows the shipped 4 MiB rows
    sources = [DBSource(user, "user.sqlite"), shipped]
    between = decide(_ar(3_000_000), "graph", CAPS, sources, HW)
    assert between.config == PULL_3M and between.source == "user.sqlite"
    four = decide(_ar(4 * MiB), "graph", CAPS, sources, HW)
    assert four.backend == "nccl" and four.source == "user.sqlite"
    small = decide(_ar(4096), "graph", CAPS, sources, HW)
    assert small.backend == "triton_one_shot_push" and small.source == shipped.label


def test_the_shipped_database_serves_3mb_without_the_4mib_push_config():
    from autosymm.db.store import shipped_db_for

    path = shipped_db_for("nvidia-h200-nvlink-x2")
    source = DBSource(TuningDB(path, readonly=True), str(path))
    decision = decide(_ar(3_000_000), "graph", CAPS, [source], HW)
    assert decision.bucket < 4 * MiB and decision.expected_us < 18.87


# ------------------------------------------------------------------ MoE: tokens and shapes

DEEPSEEK, MIXTRAL = MODEL_SHAPES["deepseek-v3"], MODEL_SHAPES["mixtral-8x7b"]
MOE_A, MOE_B, MOE_C = MoEConfig(2048, 8, 2, 132), MoEConfig(1024, 4, 1, 0), MoEConfig(4096, 16, 4, 264)


def _moe_source():
    db = TuningDB(":memory:")
    db.record_many([_row("triton_moe", 256, 40.0, MOE_A, "graph", op="dp_to_ep", shape=DEEPSEEK.key),
                    _row("triton_moe", 1024, 150.0, MOE_B, "graph", op="dp_to_ep", shape=DEEPSEEK.key),
                    _row("triton_moe", 1024, 30.0, MOE_C, "graph", op="dp_to_ep", shape=MIXTRAL.key)])
    return DBSource(db, "moe.sqlite")


def test_moe_tokens_between_tuned_counts_use_a_neighbour():
    decision = decide(Problem.moe("dp_to_ep", DEEPSEEK, 300), "graph", CAPS, [_moe_source()], HW)
    assert decision.config in (MOE_A, MOE_B) and decision.bucket in (256, 1024)
    assert "between tuned 256 tokens/rank and 1024 tokens/rank" in decision.reason


def test_an_unseen_moe_shape_gets_the_nearest_tuned_problem():
    # d_model 5120, top-6, 300 tokens: 10 KiB rows, 1800 per rank. Mixtral (8 KiB rows, 2048 per
    # rank at 1024 tokens) is nearer than DeepSeek-V3 (14 KiB rows, 2048 per rank at 256 tokens).
    shape = MoEShape(5120, 160, 6)
    decision = decide(Problem.moe("dp_to_ep", shape, 300), "graph", CAPS, [_moe_source()], HW)
    assert decision.backend == "triton_moe" and decision.config == MOE_C and decision.bucket == 1024
    assert ("no row for shape d5120_e160_k6: nearest tuned problem d4096_e8_k2 at 1024 tokens/rank "
            "(bytes per row x1.25, rows per rank x0.88)") in decision.reason
    assert "untuned default" not in decision.reason
    near_deepseek = decide(Problem.moe("dp_to_ep", MoEShape(7000, 64, 8), 250), "graph", CAPS, [_moe_source()], HW)
    assert near_deepseek.config == MOE_A and "nearest tuned problem d7168_e256_k8 at 256" in near_deepseek.reason


def test_an_unseen_moe_shape_prefers_its_mode_then_the_other():
    eager = decide(Problem.moe("dp_to_ep", MoEShape(5120, 160, 6), 300), "eager", CAPS, [_moe_source()], HW)
    assert eager.config == MOE_C and "no eager-mode row, using the graph-mode row" in eager.reason

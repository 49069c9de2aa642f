"""The op registry (autosymm.spec, autosymm.collectives): one spec and one door per op, in a fixed
order, declaring its problem, key, fallbacks, lookups, growth model, tuning points and custom ops."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from autosymm import spec
from autosymm.collectives import doors
from autosymm.spec import ALL_REDUCE, ALL_REDUCE_RMSNORM, DP_TO_EP, EP_TO_DP, PointRequest
from autosymm.spec.all_reduce_rmsnorm import HiddenShape
from autosymm.problem import MODEL_SHAPES, MoEShape, Problem


def test_the_registry_holds_every_op_once_in_a_fixed_order():
    assert spec.names() == ("all_reduce", "dp_to_ep", "ep_to_dp", "all_reduce_rmsnorm", "reduce_scatter",
                                   "all_gather")
    assert tuple(r.name for r in spec.ALL) == spec.names()
    assert all(spec.get(r.name) is r for r in spec.ALL)
    assert spec.default_tuned() == ("all_reduce", "dp_to_ep", "ep_to_dp")
    with pytest.raises(ValueError, match=r"op='all_to_all' is not one of \('all_reduce'"):
        spec.get("all_to_all")


def test_a_record_checks_its_own_declarations():
    with pytest.raises(ValueError, match="must end with the fallback 'nccl'"):
        replace(ALL_REDUCE, name="x", fallback_order=("nccl", "torch_one_shot"))
    with pytest.raises(ValueError, match=r"fallback backend\(s\) \['nccl_all_to_all'\] are not among its backends"):
        replace(ALL_REDUCE, name="x", fallback="nccl_all_to_all", fallback_order=("nccl_all_to_all",))


def test_records_key_problems_by_their_bucket_unit_and_shape():
    shape = MODEL_SHAPES["deepseek-v3"]
    ar, moe = Problem.all_reduce(0, "fp16", 4), Problem.moe("ep_to_dp", shape, 64, "bf16", 8)
    fused = Problem.all_reduce_rmsnorm(16, 8192, "fp32", 2)
    assert (ar.bucket, ar.shape_key, ar.record) == (1, "", ALL_REDUCE)  # bytes, at least 1
    assert (moe.bucket, moe.shape_key, moe.record) == (64, shape.key, EP_TO_DP)
    assert (fused.bucket, fused.shape_key, fused.record) == (16, "h8192", ALL_REDUCE_RMSNORM)
    assert ALL_REDUCE.size_text(3 << 20) == "3MiB" and ALL_REDUCE.size_text(1000) == "1000 B"
    assert DP_TO_EP.size_text(8) == "8 tokens/rank"
    assert (ALL_REDUCE.point_label(Problem.all_reduce(1536 << 10)), DP_TO_EP.point_label(moe)) == \
        ("1.5MiB", f"{shape.key} t=64")


def test_lookups_fallbacks_and_custom_ops_are_declared_per_op():
    assert ALL_REDUCE.lookups.bf16_same_bytes and not ALL_REDUCE.lookups.nearest_shape
    assert DP_TO_EP.lookups.nearest_shape and not DP_TO_EP.lookups.bf16_same_bytes
    assert [r.fallback for r in spec.ALL] == ["nccl", "nccl_all_to_all", "nccl_all_to_all", "nccl_fused",
                                                     "nccl_reduce_scatter", "nccl_all_gather"]
    assert DP_TO_EP.fallback_order == ("triton_moe", "nccl_all_to_all")  # no NCCL path is graph-capturable
    assert [r.one_rank_reason(False) != "" for r in spec.ALL] == [True, False, False, True, True, True]
    assert [r.one_rank_reason(True) != "" for r in spec.ALL] == [True, False, False, False, True, True]
    DOORS = doors()
    assert [door.spec for door in DOORS] == list(spec.ALL)  # one door per spec, in registry order
    assert not DOORS[1].prepare_in_check and DOORS[0].prepare_in_check  # growing the MoE region is collective
    assert [r.config_type.__name__ for r in spec.ALL] == ["AllReduceConfig", "MoEConfig", "MoEConfig",
                                                                  "FusedConfig", "ReduceScatterConfig",
                                                                  "AllGatherConfig"]  # what a DB row of the op holds
    ops = [op.name for door in DOORS for op in door.custom_ops()]
    assert ops == ["all_reduce_", "all_reduce", "dp_to_ep", "ep_to_dp", "all_reduce_rmsnorm",
                   "all_reduce_rmsnorm_quant", "all_reduce_rmsnorm_functional", "reduce_scatter_tensor",
                   "all_gather_into_tensor"]
    assert all(hasattr(torch.ops.autosymm, name) for name in ops)
    # the functional ops are differentiable (autosymm.collectives.autograd), the mutating ones cannot be
    differentiable = [op.name for door in DOORS for op in door.custom_ops() if op.backward is not None]
    assert differentiable == ["all_reduce", "dp_to_ep", "ep_to_dp", "all_reduce_rmsnorm_functional",
                              "reduce_scatter_tensor", "all_gather_into_tensor"]
    # the deterministic setting's last resorts (the MoE and all-gather fallbacks are batch-invariant
    # themselves: rows are copied)
    assert [r.invariant_fallback for r in spec.ALL] == ["nccl_ordered", "", "", "nccl_ordered_fused",
                                                               "nccl_ordered_reduce_scatter", ""]


def test_the_moe_growth_model_is_bytes_moved_and_the_others_scale_their_bucket():
    shape = MoEShape(4096, 8, 2)
    row = _row(shape_key=MoEShape(2048, 8, 4).key, bucket=16, dtype="bf16")
    call = Problem.moe("dp_to_ep", shape, 64, "fp32", 2)
    # 64 tokens x 2 x 4096 x 4 bytes over 16 tokens x 4 x 2048 x 2 bytes
    assert DP_TO_EP.moved_ratio(call, row) == pytest.approx((64 * 2 * 4096 * 4) / (16 * 4 * 2048 * 2))
    assert ALL_REDUCE.moved_ratio(Problem.all_reduce(6144), _row(bucket=4096)) == 1.5


def _row(shape_key: str = "", bucket: int = 1, dtype: str = "bf16"):
    """The fields of a db_schema.Row the growth model reads."""
    return SimpleNamespace(shape=shape_key, bucket=bucket, dtype=dtype)


def test_tuning_points_are_data_beside_the_mapping_from_a_request():
    request = PointRequest(("bf16", "fp16"), 2)
    ar = ALL_REDUCE.problems(request)
    assert [p.nbytes for p in ar[:3]] == [4096, 6144, 8192] and len(ar) == 2 * 33 and ar[-1].dtype == "fp16"
    moe = DP_TO_EP.problems(PointRequest(("bf16",), 2, sizes=(1, 4)))
    assert [(p.shape, p.n_tokens_local) for p in moe] == [(s, t) for s in MODEL_SHAPES.values() for t in (1, 4)]
    h8192 = (HiddenShape(8192),)
    fused = ALL_REDUCE_RMSNORM.problems(PointRequest(("bf16",), 2, sizes=(64, 4096), shapes=h8192))
    assert [p.n_tokens_local for p in fused] == [64, 128, 2048, 4096]  # its extra token counts inside the range
    plain = ALL_REDUCE_RMSNORM.problems(PointRequest(("bf16",), 2, sizes=(64, 4096), shapes=h8192, extra_sizes=False))
    assert [p.n_tokens_local for p in plain] == [64, 4096]
    assert [(p.hidden, p.n_tokens_local) for p in ALL_REDUCE_RMSNORM.problems(PointRequest(("bf16",), 2))][:2] == \
        [(4096, 1), (4096, 4)]  # its default shapes: the hidden sizes, default epilogue


def test_every_registry_is_read_off_the_op_records():
    """An op's spec names its door, backends, config types, tuning module and bench; the doors, the
    backends' registry, the tuning modules, the benches (with their baselines) and the config
    types follow from the registered specs, in registry order."""
    from autosymm.backends import backend_names, get_backend
    from autosymm.bench.report import benches, others_of
    from autosymm.configs import AnyConfig, config_types
    from autosymm.tuning import ops as tuning_ops

    assert [door.spec for door in doors()] == [tuning.record for tuning in tuning_ops.registered()] == list(spec.ALL)
    listed = {name: entry for record in spec.ALL for name, entry in record.backends.items()}
    assert backend_names() == [*listed, "noop"]  # noop serves every op's calls with nothing to exchange
    assert all(get_backend(name).name == name for name in backend_names())
    assert list(config_types().values()) == list(dict.fromkeys(c for record in spec.ALL for c in record.config_types))
    assert all(issubclass(cls, AnyConfig) for cls in config_types().values())
    assert list(benches()) == list(spec.ALL) and benches()[DP_TO_EP] is benches()[EP_TO_DP]
    assert others_of("all_reduce")[0][0] == "nccl" and others_of("dp_to_ep") == (("nccl", "plain_all_to_all"),) * 2

"""The one decider (autosymm.runtime.dispatch) for calls outside the tuned domain: other
reductions and dtypes, empty calls and one-rank groups are decided there, from a Problem, like any
call (no front door decides); the deterministic setting asks each backend whether it is
batch-invariant for the call."""

import ast
from pathlib import Path

import pytest
import torch

from autosymm.backends import Capabilities, get_backend
from autosymm.configs import AllGatherConfig, AllReduceConfig
from autosymm.db.store import Row, TuningDB
from autosymm.problem import Problem, any_dtype_name, torch_dtype
from autosymm.runtime.dispatch import DBSource, decide
from autosymm.spec import ALL, ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

HW = "nvidia-h200-nvlink"
CAPS = Capabilities(world_size=2, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, intra_node=True,
                    torch_symm_ops=True, compute_capability=(9, 0))
ONE_SHOT = AllReduceConfig("one_shot", 2048, 4, 8)
PACKAGE = Path(__file__).resolve().parent.parent / "autosymm"


def _row(op, backend, bucket, us, config=None, dtype="bf16"):
    return Row(hardware=HW, world_size=2, op=op, dtype=dtype, bucket=bucket, backend=backend, median_us=us,
               mode="eager", config=config, nccl_us=20.0, gpu="NVIDIA H200")


@pytest.fixture
def rows():
    db = TuningDB(":memory:")
    db.record_many([_row("all_reduce", "nccl", 4096, 20.0), _row("all_reduce", "triton_one_shot", 4096, 5.0, ONE_SHOT),
                    _row("all_gather", "nccl_all_gather", 8192, 20.0),
                    _row("all_gather", "triton_all_gather_push", 8192, 4.0, AllGatherConfig("push", 1024, 2, 4))])
    return [DBSource(db, "rows.sqlite")]


@pytest.mark.parametrize("reduce_op", ["max", "min", "avg", "product", "band"])
def test_a_reduction_no_kernel_computes_is_nccls_without_reading_the_sum_rows(rows, reduce_op):
    problem = Problem("all_reduce", "bf16", 2, nbytes=4096, reduce_op=reduce_op)
    decision = decide(problem, "eager", CAPS, rows, HW)
    assert (decision.backend, decision.tuned) == ("nccl", False)
    assert decision.reason == f"op {reduce_op} has no tuned kernel" and decision.hardware == HW
    assert decide(Problem("all_reduce", "bf16", 2, nbytes=4096), "eager", CAPS, rows, HW).backend == "triton_one_shot"


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bool, torch.complex64])
def test_a_dtype_no_kernel_computes_is_nccls(rows, dtype):
    problem = Problem("all_reduce", any_dtype_name(dtype), 2, nbytes=4096)
    decision = decide(problem, "eager", CAPS, rows, HW)
    assert decision.backend == "nccl" and decision.reason == f"dtype {any_dtype_name(dtype)} has no tuned kernel"


@pytest.mark.parametrize("dtype, reduce_op, backend", [
    ("float64", "sum", "nccl_ordered"), ("bf16", "avg", "nccl_ordered"), ("float64", "product", "nccl_ordered"),
    ("int32", "sum", "nccl"), ("bf16", "max", "nccl"), ("float32", "min", "nccl"), ("int64", "bxor", "nccl")])
def test_deterministic_asks_whether_the_backend_is_invariant_for_the_call(rows, dtype, reduce_op, backend):
    """Floating-point sums, means and products take the ordered fallback; exact reductions stay
    on NCCL (any order gives the same bits)."""
    problem = Problem("all_reduce", dtype, 2, nbytes=4096, reduce_op=reduce_op)
    assert decide(problem, "eager", CAPS, rows, HW, deterministic=True).backend == backend
    rs = Problem("reduce_scatter", dtype, 2, nbytes=4096, reduce_op=reduce_op)
    assert decide(rs, "eager", CAPS, rows, HW, deterministic=True).backend == backend.replace(
        "nccl_ordered", "nccl_ordered_reduce_scatter").replace("nccl", "nccl_reduce_scatter", backend == "nccl")


def test_an_all_gather_of_any_dtype_takes_the_bf16_rows_of_its_bytes(rows):
    for dtype in ("int32", "float8_e4m3fn", "uint8", "bf16"):
        decision = decide(Problem("all_gather", dtype, 2, nbytes=8192), "eager", CAPS, rows, HW)
        assert decision.backend == "triton_all_gather_push" and decision.tuned, (dtype, decision)


@pytest.mark.parametrize("problem", [
    Problem("all_reduce", "bf16", 2, nbytes=0), Problem("reduce_scatter", "int32", 4, nbytes=0, reduce_op="max"),
    Problem("all_gather", "fp16", 2, nbytes=0), Problem.all_reduce_rmsnorm(0, 4096, "bf16", 2),
    Problem("all_reduce", "float64", 1, nbytes=64, reduce_op="avg"), Problem("all_gather", "int8", 1, nbytes=64),
    Problem.all_reduce_rmsnorm(3, 64, "fp16", 1)], ids=lambda p: p.describe())
def test_nothing_to_exchange_is_noop_decided_by_the_dispatcher(rows, problem, monkeypatch):
    monkeypatch.setenv("AUTOSYMM_DISABLE", "1")  # nothing to exchange comes first: a fact, not a choice
    decision = decide(problem, "graph", CAPS, rows, HW)
    assert decision.backend == "noop" and ("nothing to exchange" in decision.reason
                                           or "the shard is the whole tensor" in decision.reason)
    assert get_backend("noop").why_not(problem, CAPS, "graph") is None


def test_the_noop_backend_serves_only_calls_with_nothing_to_exchange():
    assert get_backend("noop").why_not(Problem.all_reduce(4096, "bf16", 2), CAPS) is not None
    moe = ALL[1]
    assert not moe.local  # the MoE conversions always exchange (rows of other ranks)


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32", "int32", "float64", "float8_e4m3fn", "bool"])
def test_dtype_names_round_trip(name):
    assert any_dtype_name(torch_dtype(name)) == name


def test_an_unknown_dtype_or_reduction_is_named():
    with pytest.raises(ValueError, match="dtype='float99'"):
        Problem("all_reduce", "float99", 2, nbytes=8)
    with pytest.raises(ValueError, match="reduce_op='median'"):
        Problem("all_reduce", "bf16", 2, nbytes=8, reduce_op="median")


def test_every_op_declares_its_domain_and_the_specs_key_rows_by_it():
    assert ALL_REDUCE.domain.reduce_ops == REDUCE_SCATTER.domain.reduce_ops == ("sum",)
    assert ALL_GATHER.domain.keyed_as == "bf16" and not ALL_GATHER.domain.reduce_ops
    for record in ALL:
        assert record.fallback in [name for name in record.fallback_order]


def _constructions(name: str) -> list[str]:
    """Where the package constructs ``name`` (a call of the bare or dotted name)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if callee == name:
                    found.append(f"{path.relative_to(PACKAGE)}")
    return sorted(set(found))


def test_no_decision_is_built_outside_the_dispatcher():
    """Every Decision comes from autosymm.runtime.dispatch; every prepared Entry from the group
    state that asks it (the doors check and launch)."""
    assert _constructions("Decision") == ["runtime/dispatch.py"]
    assert _constructions("Entry") == ["runtime/group.py"]


def test_the_one_rank_rule_lives_in_the_dispatcher_only():
    users = [p for p in _constructions("one_rank_reason")]
    assert set(users) <= {"runtime/dispatch.py", "backends/local.py"}, users

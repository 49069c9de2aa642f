"""What dist.all_reduce accepts, mapped onto autosymm (the multi-rank cases, DTensor included,
run in tests/test_ops.py's gloo spawn)."""

import pytest
import torch
import torch.distributed as dist

from autosymm.dist_compat import Work, reduce_op_name


def test_reduce_ops_as_dist_takes_them():
    assert reduce_op_name(dist.ReduceOp.SUM) == reduce_op_name("sum") == "sum"
    assert reduce_op_name(dist.ReduceOp(dist.ReduceOp.MAX)) == "max"
    assert [reduce_op_name(getattr(dist.ReduceOp, n)) for n in ("AVG", "MIN", "PRODUCT")] == ["avg", "min", "product"]
    with pytest.raises(ValueError, match="op='xor'"):
        reduce_op_name("xor")
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        reduce_op_name(dist.ReduceOp.PREMUL_SUM)


def test_work_of_a_cpu_call_is_complete():
    x = torch.ones(3)
    work = Work(x)
    assert work.is_completed() and work.wait() and work.result()[0] is x

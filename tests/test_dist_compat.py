"""What dist.all_reduce accepts, mapped onto autosymm (the multi-rank cases, DTensor included,
run in tests/test_ops.py's gloo spawn)."""

import pytest
import torch
import torch.distributed as dist

from autosymm import dist_compat
from autosymm.dist_compat import Work, group_device, group_name, reduce_op_name


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


@pytest.mark.parametrize("backend, device_type", [
    ("nccl", "cuda"), ("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cuda"), ("cuda:nccl,cpu:gloo", "cuda"),
    ("cpu:gloo", "cpu"), ("cpu:gloo,cuda:gloo", "cpu"), ("mpi", "cpu"), ("NCCL", "cuda"),
])
def test_group_device_serves_cuda_wherever_nccl_takes_cuda_tensors(monkeypatch, backend, device_type):
    monkeypatch.setattr(dist_compat.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist_compat.torch.cuda, "current_device", lambda: 3)
    device = group_device(object())
    assert device.type == device_type and (device_type == "cpu" or device.index == 3)


def test_group_name_of_a_group_and_of_the_default_one():
    class Named:
        group_name = 17

    assert group_name(Named()) == "17"
    assert not dist.is_initialized()  # this process: the gloo tests spawn their own
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        group_name()

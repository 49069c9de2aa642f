"""What dist.all_reduce accepts, mapped onto autosymm (the multi-rank cases, DTensor included,
run in tests/test_ops.py's gloo spawn)."""

import re

import pytest
import torch
import torch.distributed as dist

from autosymm import dist_compat
from autosymm.dist_compat import Work, check_group, group_device, group_name, reduce_op_name


def test_reduce_ops_as_dist_takes_them():
    assert reduce_op_name(dist.ReduceOp.SUM) == reduce_op_name("sum") == "sum"
    assert reduce_op_name(dist.ReduceOp(dist.ReduceOp.MAX)) == "max"
    assert [reduce_op_name(getattr(dist.ReduceOp, n)) for n in ("AVG", "MIN", "PRODUCT")] == ["avg", "min", "product"]
    with pytest.raises(ValueError, match="op='xor'"):
        reduce_op_name("xor")
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        reduce_op_name(dist.ReduceOp.PREMUL_SUM)


@pytest.mark.parametrize("op", [["sum"], {"op": "sum"}, 0, None, 1.5])
def test_what_is_not_a_reduce_op_is_a_type_error_naming_what_is(op):
    with pytest.raises(TypeError, match=r"op=.* is not a reduce op: pass a dist.ReduceOp of SUM, AVG, MAX.*"
                                        r"one of the names \['sum', 'avg'"):
        reduce_op_name(op)


@pytest.mark.parametrize("group", ["bogus", 3, object(), ["world"]])
def test_what_is_not_a_process_group_is_a_type_error_naming_it(group):
    for check in (check_group, group_name):
        with pytest.raises(TypeError, match=rf"group={re.escape(repr(group))} \({type(group).__name__}\) is not a "
                                            r"torch.distributed ProcessGroup"):
            check(group)


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


def _partial_dtensor_is_left_untouched(rank, world_size):
    import autosymm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (world_size,))
    local = torch.full((2,), float(rank + 1))
    partial = DTensor.from_local(local, mesh, [Partial()])
    out = autosymm.all_reduce(partial)
    want = partial.redistribute(mesh, [Replicate()])  # torch's semantics, the reference
    assert out.placements == want.placements == (Replicate(),)
    assert torch.equal(out.to_local(), want.to_local()) and torch.equal(out.to_local(), torch.full((2,), 3.0))
    assert partial.placements == (Partial(),), "the input keeps its placements"
    assert torch.equal(partial.to_local(), torch.full((2,), float(rank + 1))), "the input's local data is untouched"
    assert torch.equal(local, torch.full((2,), float(rank + 1)))
    assert torch.equal(partial.full_tensor(), torch.full((2,), 3.0)), "full_tensor() of the input still reads the sum"
    assert torch.equal(out.full_tensor(), torch.full((2,), 3.0))
    assert out.to_local().data_ptr() != local.data_ptr()
    return True


def test_a_partial_dtensor_never_holds_summed_data():
    from _gloo import run_gloo

    assert run_gloo(_partial_dtensor_is_left_untouched, 2, deadline_s=120) == {0: True, 1: True}

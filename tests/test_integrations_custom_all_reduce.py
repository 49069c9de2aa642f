"""The custom-all-reduce slot on 2 gloo ranks: a wrong ``out`` on one rank after warm-up still
joins the sum (in a scratch tensor) and then raises there, so its peer gets its sum and nothing
hangs; what is not a tensor is a TypeError naming it; ``max_size`` is a positive int or None;
the in-place slot keeps the stack object's class in its MRO and its own methods unshadowed."""

from __future__ import annotations

import contextlib
import inspect
import pickle

import pytest
import torch
from _adapter_decisions import adapter_decisions
from _gloo import run_gloo


def _body(rank, world_size):
    from autosymm.integrations import AutosymmCustomAllReduce

    car = AutosymmCustomAllReduce(device="cpu")
    x = torch.full((64,), float(rank + 1))
    want = torch.full_like(x, 3.0)
    assert torch.equal(car.autosymm.all_reduce(x), want)  # warm-up
    for bad in (torch.empty(32), torch.empty(64, dtype=torch.float16), torch.empty(128)[::2], "out"):
        out = bad if rank == 1 else torch.empty(64)
        if rank == 1:
            with pytest.raises(ValueError, match=r"out .* must be a contiguous \(64,\) torch.float32 tensor on cpu"):
                car.autosymm.all_reduce(x, out=out)
        else:
            assert car.autosymm.all_reduce(x, out=out) is out and torch.equal(out, want)
    assert torch.equal(car.autosymm.all_reduce(x), want)  # still in step
    for call in (car.should_custom_ar, car.custom_all_reduce, car.autosymm.serves):
        with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
            call([1.0, 2.0])
    return True


def test_a_wrong_out_on_one_rank_raises_there_after_the_sum(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_body, 2, env=env, deadline_s=120) == {0: True, 1: True}


@pytest.mark.parametrize("bad, error, words", [(-5, ValueError, "positive number of bytes"),
                                               (0, ValueError, "positive number of bytes"),
                                               ("x", TypeError, "positive int"), (True, TypeError, "positive int"),
                                               (1.5, TypeError, "positive int")])
def test_max_size_is_refused_before_anything_runs(bad, error, words):
    """Refused without torch.distributed: nothing collective has started when it raises."""
    from autosymm.integrations import AutosymmCustomAllReduce
    from autosymm.integrations.serving import check_max_size

    with pytest.raises(error, match=f"max_size .*{words}.*{bad!r}" if error is TypeError else f"max_size.*{bad}"):
        AutosymmCustomAllReduce(device="cpu", max_size=bad)
    assert check_max_size(None) is None and check_max_size(4096) == 4096


class _StackObject:
    """A stack's custom all-reduce with its own ``all_reduce`` / ``reduce_scatter`` / ``max_size``
    (SGLang's ROCm signatures) and a slot answering numel 8."""

    def __init__(self):
        self.disabled, self.max_size, self.calls = False, 1 << 20, []

    def should_custom_ar(self, inp):
        return inp.numel() == 8

    def custom_all_reduce(self, input):
        self.calls.append("custom_all_reduce")
        return torch.full_like(input, -1.0)

    def reduce_scatter(self, input, output, registered=False):
        self.calls.append(("reduce_scatter", registered))
        output.fill_(-2.0)

    def all_reduce(self, inp, *, out=None, registered=False):
        self.calls.append("all_reduce")
        return torch.full_like(inp, -3.0)

    @contextlib.contextmanager
    def capture(self):
        self.calls.append("capture")
        yield

    def close(self):
        self.calls.append("close")


def _in_place(rank, world_size):
    from autosymm.integrations import custom_all_reduce

    stack = _StackObject()
    slot = custom_all_reduce.wrap(stack, device="cpu")
    assert slot is stack and isinstance(slot, _StackObject) and type(slot).__name__ == "Autosymm_StackObject"
    for name in ("all_reduce", "reduce_scatter", "max_size", "__init__"):  # the object's own, unshadowed
        assert name not in vars(type(slot)), name
    for name in ("should_custom_ar", "custom_all_reduce", "capture", "close"):
        assert inspect.signature(getattr(type(slot), name)) == inspect.signature(getattr(_StackObject, name))
    assert pickle.loads(pickle.dumps(type(slot))) is type(slot)
    assert slot.max_size == 1 << 20 and not slot.disabled
    out = torch.empty(4)
    slot.reduce_scatter(torch.ones(8), out, registered=True)  # SGLang ROCm's call, its own signature
    assert torch.equal(out, torch.full((4,), -2.0))
    assert torch.equal(slot.all_reduce(torch.ones(3), registered=True), torch.full((3,), -3.0))
    eight, other = torch.ones(8), torch.full((16,), float(rank + 1))
    assert slot.should_custom_ar(eight) and not slot.should_custom_ar(other)  # gloo: autosymm's is NCCL
    assert torch.equal(slot.custom_all_reduce(input=eight), torch.full((8,), -1.0))
    with adapter_decisions():
        assert slot.should_custom_ar(other)
        assert torch.equal(slot.custom_all_reduce(other), torch.full((16,), 3.0))  # autosymm's sum
        with slot.capture():
            assert slot.autosymm._mode() == "graph"
    assert stack.calls == [("reduce_scatter", True), "all_reduce", "custom_all_reduce", "capture"]
    slot.close()
    assert slot.autosymm.stopped and stack.calls[-1] == "close"
    off = _StackObject()
    off.disabled = True  # the stack's own is off: autosymm's standalone slot, over it
    standalone = custom_all_reduce.wrap(off, device="cpu")
    assert standalone is not off and standalone.fallback is off and not standalone.disabled
    assert standalone.max_size == 1 << 20  # the wrapped object's, not autosymm's
    return True


def test_in_place_slot_keeps_the_objects_own_methods(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    assert run_gloo(_in_place, 2, env=env, deadline_s=120) == {0: True, 1: True}

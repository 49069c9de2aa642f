"""AutosymmCustomAllReduce on 2 gloo ranks: a wrong ``out`` on one rank after warm-up still joins
the sum (in a scratch tensor) and then raises there, so its peer gets its sum and nothing hangs;
what is not a tensor is a TypeError naming it."""

from __future__ import annotations

import pytest
import torch
from _gloo import run_gloo


def _body(rank, world_size):
    from autosymm.integrations import AutosymmCustomAllReduce

    car = AutosymmCustomAllReduce(device="cpu")
    x = torch.full((64,), float(rank + 1))
    want = torch.full_like(x, 3.0)
    assert torch.equal(car.all_reduce(x), want)  # warm-up
    for bad in (torch.empty(32), torch.empty(64, dtype=torch.float16), torch.empty(128)[::2], "out"):
        out = bad if rank == 1 else torch.empty(64)
        if rank == 1:
            with pytest.raises(ValueError, match=r"out .* must be a contiguous \(64,\) torch.float32 tensor on cpu"):
                car.all_reduce(x, out=out)
        else:
            assert car.all_reduce(x, out=out) is out and torch.equal(out, want)
    assert torch.equal(car.all_reduce(x), want)  # still in step
    for call in (car.should_custom_ar, car.custom_all_reduce, car.serves):
        with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
            call([1.0, 2.0])
    return True


def test_a_wrong_out_on_one_rank_raises_there_after_the_sum(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite"), "AUTOSYMM_AGREE_TIMEOUT_S": "10"}}
    assert run_gloo(_body, 2, env=env, deadline_s=120) == {0: True, 1: True}

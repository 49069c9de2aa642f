"""A tuning problem's references (autosymm.tuning.reference): the MoE reference agrees with
autosymm.routing's, and the output check rejects wrong, NaN and misshapen results."""

import pytest
import torch

from autosymm import routing as moe_ref
import _moe_ref as refs
from autosymm.tuning.ops.moe import moe_reference_for_rank
from autosymm.tuning.reference import check_output


@pytest.mark.parametrize("op", ["dp_to_ep", "ep_to_dp"])
def test_moe_reference_matches_autosymm_moe(op):
    R, E, k, d, n_local = 4, 16, 3, 8, 5
    assignment = moe_ref.make_expt_assignment(R, E, moe_ref.make_expt_dict_random(R, E, seed=1))
    expt_indx = moe_ref.random_expt_indx(R * n_local, E, k, seed=3, drop_fraction=0.1)
    gate, topk = moe_ref.route(expt_indx, E)
    indx = gate if op == "dp_to_ep" else topk
    e = expt_indx.reshape(-1).long()
    owner = torch.where((e >= 0) & (e < E), assignment.expt_owner.long()[e.clamp(0, E - 1)], -1)
    rows = n_local if op == "dp_to_ep" else R * n_local * k
    srcs = [torch.randn(rows, d) for _ in range(R)]
    reference = getattr(refs, f"reference_{op}")(srcs, assignment, expt_indx, indx)
    written = refs.rows_written(op, assignment, expt_indx, indx, R)
    for rank in range(R):
        mine, mask = moe_reference_for_rank(op, torch.stack(srcs), owner, indx, rank)
        assert torch.equal(mask, written[rank]) and torch.equal(mine[mask], reference[rank][mask])


def test_check_output_rejects_wrong_and_nan():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    check_output(want.clone(), want, None, exact=True)
    check_output(want + 0.005, want, None, exact=False)  # within bf16 tolerance
    nan = want.clone()
    nan[1, 1] = float("nan")
    for exact in (True, False):
        with pytest.raises(ValueError, match="wrong result"):
            check_output(nan, want, None, exact=exact)
    with pytest.raises(ValueError, match="wrong result"):
        check_output(want * 2, want, None, exact=False)
    check_output(nan, want, torch.tensor([True, False]), exact=True)  # unwritten rows are not compared
    with pytest.raises(ValueError, match="output"):
        check_output(want[:1], want, None, exact=True)
    with pytest.raises(ValueError, match="not a tensor"):
        check_output(None, want, None, exact=True)

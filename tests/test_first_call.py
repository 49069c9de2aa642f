"""A group's first calls on a CPU machine (gloo ranks): they read only this machine's rows of the
shipped databases (none: those are another hardware's), so they validate no row of other
hardware and load no kernel module a CPU group cannot run. scripts/bench_first_call.py times
the same calls in freshly spawned processes."""

import sys

import torch
from _gloo import run_gloo


def _first_calls(rank, world_size):
    import autosymm
    from autosymm.runtime.group import state_of

    before = {m for m in sys.modules if m.startswith("autosymm")}
    autosymm.all_reduce(torch.ones(1024))
    autosymm.all_reduce(torch.ones(1000, dtype=torch.int32), op="max")
    autosymm.all_reduce_rmsnorm(torch.ones(4, 64), torch.ones(4, 64), torch.ones(64))
    autosymm.all_reduce(torch.ones(0))
    state = state_of(None)
    return (state.hardware, [len(source._rows) for source in state.sources],
            sorted(m for m in sys.modules if m.startswith("autosymm") and m not in before),
            sorted(m for m in sys.modules if m.startswith("autosymm.kernels")))


def test_the_first_calls_read_only_this_nodes_rows_and_load_no_kernel(tmp_path):
    env = {"all": {"AUTOSYMM_DB": str(tmp_path / "none.sqlite")}}
    for hardware, rows, imported, kernels in run_gloo(_first_calls, 2, env=env, deadline_s=120).values():
        assert hardware.startswith("cpu") and rows and not any(rows), rows  # the shipped DB, none of its rows
        assert kernels == [] and not [m for m in imported if m.startswith("autosymm.backends.triton")], imported

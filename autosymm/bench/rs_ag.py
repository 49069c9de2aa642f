"""`autosymm bench` of the reduce-scatter and the all-gather: autosymm against NCCL and torch's
symmetric-memory ops, each run as its users run it at its best (autosymm.bench.run's rules: every
output checked against NCCL's first, then timed eager and graph, MAX over ranks), per size (bytes
of the full, unsharded tensor). Implementations (:data:`SHARDED_IMPLS`): ``nccl``; torch's
``_low_contention_*`` ops on a symmetric buffer and on a plain tensor; ``torch_multimem``
(all-gather, only where the workspace has a multicast address); ``autosymm`` on plain tensors and
``autosymm_zero_copy`` on ``autosymm.empty`` tensors.

Design notes: docs/TUNING.md#bench-rs-ag
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from rich.table import Table

import autosymm

from ..backends.nccl_rs_ag import pick_collective
from ..problem import DTYPE_NAMES, Problem
from ..spec import ALL_GATHER, REDUCE_SCATTER
from ..tuning import ops as tuning_ops
from .baselines import Impl, Setup, agree, bench_plan, check_output, measure, pool_bytes
from .report import SHARDED_COPY_OTHERS, SHARDED_NO_COPY_OTHERS, BenchOp, BenchRow, cells, compare, size_label

SHARDED_IMPLS = ("nccl", "torch_low_contention", "torch_low_contention_copy", "torch_multimem", "autosymm",
                 "autosymm_zero_copy")


def _shapes(reduces: bool, numel: int, world_size: int) -> tuple[int, int]:
    """(input, output) elements for a full tensor of ``numel``: the reduce-scatter's (``reduces``)
    or the all-gather's."""
    return (numel, numel // world_size) if reduces else (numel // world_size, numel)


def why_not(reduces: bool, name: str, setup: Setup, caps, nbytes: int, world_size: int) -> Optional[str]:
    """None when implementation ``name`` can run the reduce-scatter (``reduces``) or the
    all-gather of ``nbytes`` here."""
    if name.startswith("torch_"):
        if setup.pool is None:
            return "no torch symmetric memory here (needs CUDA, one node, torch.ops.symm_mem)"
        if name == "torch_multimem" and reduces:
            return "torch has no multimem reduce-scatter op"
        if name == "torch_multimem" and not caps.has_multicast:
            return "needs multicast (autosymm never enables it)"
    if name == "autosymm_zero_copy":
        if setup.workspace is None:
            return "no autosymm workspace here (needs CUDA and one node)"
        count = bench_plan(nbytes, "eager").n_inputs
        have = setup.workspace.capacity("all_reduce") - setup.workspace.empty_bytes
        if (count + world_size) * nbytes > have:
            return f"{count} zero-copy tensors of {nbytes} bytes and a stage exceed the all-reduce region ({have})"
    return None


def build(reduces: bool, name: str, setup: Setup, numel: int, count: int) -> Impl:
    """Implementation ``name`` of the reduce-scatter (``reduces``) or the all-gather for a full
    tensor of ``numel`` elements, ``count`` inputs; ``launch(input, output) -> output``."""
    world_size, group, gname = dist.get_world_size(setup.group), setup.group, setup.group_name
    n_in, n_out = _shapes(reduces, numel, world_size)
    rs = reduces
    if name == "nccl":
        single = pick_collective("reduce_scatter_single", "reduce_scatter_tensor") if rs else \
            pick_collective("all_gather_single", "all_gather_into_tensor")
        return Impl(name, lambda x, out: (single(out, x, group=group), out)[1],
                    list(zip(setup.plain(count, n_in), setup.plain(count, n_out))), "nccl")
    if name in ("torch_low_contention", "torch_low_contention_copy"):
        ops = torch.ops.symm_mem
        inputs = setup.pool.views(count, n_in, setup.dtype) if name == "torch_low_contention" else \
            setup.plain(count, n_in)
        wait = torch.ops._c10d_functional.wait_tensor  # the ops run on torch's side stream: join it
        torch_op = "_low_contention_reduce_scatter" if rs else "_low_contention_all_gather"
        call_op, extra = getattr(ops, torch_op), (("sum",) if rs else ())
        return Impl(name, lambda x, out: out.copy_(wait(call_op(x, *extra, gname))),
                    list(zip(inputs, setup.plain(count, n_out))), f"torch {torch_op}")
    if name == "torch_multimem":
        gather = torch.ops.symm_mem.multimem_all_gather_out
        outputs = setup.pool.views(count, n_out, setup.dtype)
        return Impl(name, lambda x, out: gather(x, gname, out), list(zip(setup.plain(count, n_in), outputs)),
                    "torch multimem_all_gather_out")
    call = autosymm.reduce_scatter_tensor if rs else autosymm.all_gather_into_tensor
    if name == "autosymm":
        inputs, outputs = setup.plain(count, n_in), setup.plain(count, n_out)
    elif rs:  # zero-copy: the input lies in the workspace
        inputs, outputs = [autosymm.empty((n_in,), setup.dtype) for _ in range(count)], setup.plain(count, n_out)
    else:
        inputs, outputs = setup.plain(count, n_in), [autosymm.empty((n_out,), setup.dtype) for _ in range(count)]
    return Impl(name, lambda x, out: (call(out, x), out)[1], list(zip(inputs, outputs)))


def _op_size_rows(tuning, nbytes: int, modes: list[str], setup: Setup, caps) -> list[BenchRow]:
    """Every implementation's rows of one op (``tuning``: its tuning side) at one size (NCCL's
    result on the same data the reference)."""
    world_size, rank = dist.get_world_size(setup.group), dist.get_rank(setup.group)
    op, reduces = tuning.name, tuning.full_input
    elem = torch.empty((), dtype=setup.dtype).element_size()
    label, numel = size_label(nbytes), nbytes // elem
    if nbytes % (elem * world_size):
        note = f"{nbytes} bytes do not split into {world_size} equal shards of {setup.dtype}"
        return [BenchRow(op, label, nbytes, m, name, None, note=note) for name in SHARDED_IMPLS for m in modes]
    gen = torch.Generator(device=setup.device).manual_seed(1234 + rank)
    n_in, n_out = _shapes(reduces, numel, world_size)
    pristine = torch.randn(n_in, generator=gen, device=setup.device).to(setup.dtype)
    count = bench_plan(nbytes, "eager").n_inputs
    reference = build(reduces, "nccl", setup, numel, 1).launch(pristine, torch.empty(n_out, dtype=setup.dtype,
                                                                                     device=setup.device))
    rows = []
    for name in SHARDED_IMPLS:
        reason = why_not(reduces, name, setup, caps, nbytes, world_size)
        if reason is not None:
            rows += [BenchRow(op, label, nbytes, m, name, None, note=reason) for m in modes]
            continue
        try:  # the zero-copy tensors are freed after each size (the region's bottom is reused)
            impl = build(reduces, name, setup, numel, count)
            checked = impl.inputs[-1]
            checked[0].copy_(pristine)
            wrong = check_output(impl.launch(*checked), reference, world_size)
        except Exception as exc:  # argument checks: the same shapes raise on every rank
            impl, wrong = None, f"{type(exc).__name__}: {exc}"
        ok = agree(wrong is None, setup.group)
        for mode in modes:
            backend = impl.backend if impl is not None and impl.backend else \
                autosymm.api.state_of(None).decide(Problem(op, DTYPE_NAMES[setup.dtype], world_size, nbytes=nbytes),
                                                   mode).backend
            us = measure(impl.launch, impl.inputs, bench_plan(nbytes, mode), mode, setup.group, setup.device) \
                if ok else None
            rows.append(BenchRow(op, label, nbytes, mode, name, us, backend,
                                 "" if ok else f"failed, not timed: {wrong or 'failed on another rank'}"))
        if name == "autosymm_zero_copy":
            setup.workspace.reset_empty()
    return rows


def sharded_rows(options, setup: Setup, caps) -> list[BenchRow]:
    """The reduce-scatter's and the all-gather's rows (those in ``options.ops``) at every size."""
    sharded = [tuning_ops.get(spec.name) for spec in (REDUCE_SCATTER, ALL_GATHER) if spec.name in options.ops]
    return [row for op in sharded for nbytes in options.sizes
            for row in _op_size_rows(op, nbytes, options.modes, setup, caps)]


def sharded_table(result, op: str):
    table = Table(title=f"{op}: median us per call (MAX over ranks) at the full tensor's bytes; ratios < 1: "
                        "autosymm faster")
    for column in ["size", "mode", *[i.replace("_", " ") for i in SHARDED_IMPLS], "chosen",
                   "autosymm / best no-copy", "autosymm / best with-copy", "zero-copy / best no-copy"]:
        table.add_column(column, overflow="fold")
    for (label, mode), cell in cells(result.rows, op).items():
        plain, zero = compare(cell, op), compare(cell, op, "autosymm_zero_copy")
        chosen = cell["autosymm"].backend if "autosymm" in cell else "-"
        table.add_row(label, mode, *[f"{cell[i].us:.2f}" if i in cell and cell[i].us else "-" for i in SHARDED_IMPLS],
                      chosen or "-", *[f"{r:.3f}" if r is not None else "-"
                                       for r in (plain.vs_no_copy, plain.vs_copy, zero.vs_no_copy)])
    return table


def sharded_pool_bytes(sizes: list[int], world_size: int) -> int:
    """Bytes of torch's symmetric pool and the zero-copy tensors: every size's rotating full tensors."""
    return pool_bytes(sizes, world_size)


#: How bench measures the reduce-scatter and the all-gather (their specs name it: OpSpec.bench).
SHARDED_BENCH = BenchOp(sharded_rows, sharded_table, (SHARDED_NO_COPY_OTHERS, SHARDED_COPY_OTHERS), sharded_pool_bytes)

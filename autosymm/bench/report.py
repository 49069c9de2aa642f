"""What `autosymm bench` reports, kept free of GPUs and process groups: implementation names,
sizes, the best other implementation per (call, mode), autosymm's ratios against it, where
autosymm loses, the printed tables and the CSV.

Two "best others" per all-reduce (size, mode), because torch's symmetric-memory ops can be run
two ways: on a buffer that already is symmetric (:data:`NO_COPY_OTHERS`: what a caller who owns
its buffers gets) or on a plain tensor with the copy-in it needs (:data:`COPY_OTHERS`). NCCL takes
plain tensors as they are and is in both. autosymm's ratio is its time over the best other's
time: below 1.00 it is faster.
"""

from __future__ import annotations

import csv
import os
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from rich.table import Table

from ..entries import load
from ..spec import ALL_REDUCE, get, registered
from ..problem import format_bytes, parse_bytes, parse_size_range

#: All-reduce implementations, in table order (see autosymm.bench.baselines).
ALL_REDUCE_IMPLS = ("nccl", "nccl_symm", "torch_one_shot", "torch_two_shot", "nccl_symm_copy", "torch_one_shot_copy",
                    "torch_two_shot_copy", "autosymm", "autosymm_zero_copy")
#: MoE conversion implementations: autosymm's dispatcher, its NCCL all_to_all path (backend
#: nccl_all_to_all) and the plain path a user writes (autosymm.bench.moe_plain).
MOE_IMPLS = ("autosymm", "nccl", "plain_all_to_all")
MOE_OTHERS = ("nccl", "plain_all_to_all")
AUTOSYMM_IMPLS = ("autosymm", "autosymm_zero_copy")
NO_COPY_OTHERS = ("nccl", "nccl_symm", "torch_one_shot", "torch_two_shot")
COPY_OTHERS = ("nccl", "nccl_symm_copy", "torch_one_shot_copy", "torch_two_shot_copy")
#: Default `autosymm bench --sizes`: powers of two from 4 KiB to 64 MiB, and sizes between them
#: (decimal ones too: 6000 B, 100 kB, 3 MB, ...) where a bucketed dispatcher is weakest.
DEFAULT_SIZES = "4KiB:64MiB,6000,100000,768KiB,3000000,5000000,12000000"
CSV_EXTRA = ("world_size", "gpu", "vs_best_no_copy", "vs_best_copy", "comm_env")


@dataclass
class BenchRow:
    op: str
    label: str  # size or shape/tokens
    nbytes: int  # all-reduce bytes, or bytes each rank sends for MoE
    mode: str
    impl: str
    us: Optional[float]  # median us per call, MAX over ranks; None: not applicable / failed validation
    backend: str = ""  # what ran (the dispatcher's choice for autosymm rows)
    note: str = ""


@dataclass
class BenchResult:
    hardware: dict
    world_size: int
    peer_read_gbps: float
    peer_write_gbps: float
    rows: list[BenchRow] = field(default_factory=list)
    comm_env: str = ""  # hardware.provenance()["comm_env"] of the run


def parse_bench_sizes(text: str) -> list[int]:
    """'4KiB:64MiB,6000,3MiB' -> the powers of two of each range and the single sizes, ascending,
    each once (see autosymm.problem.parse_size_range)."""
    sizes: set[int] = set()
    for item in (t.strip() for t in text.split(",")):
        if item:
            sizes.update(parse_size_range(item) if ":" in item else [parse_bytes(item)])
    if not sizes or min(sizes) < 1:
        raise ValueError(f"no sizes >= 1 byte in {text!r} (example: {DEFAULT_SIZES})")
    return sorted(sizes)


def size_label(nbytes: int) -> str:
    """Binary units where exact, else decimal ones: 4096 -> '4KiB', 786432 -> '768KiB',
    3000000 -> '3MB', 6000 -> '6kB', 1234567 -> '1234.567kB', 1000 -> '1kB', 500 -> '500B'."""
    if nbytes >= 1024 and nbytes % 1024 == 0:
        return format_bytes(nbytes)
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale and nbytes % (scale // 1000) == 0:  # at most three decimals, exact
            return f"{nbytes / scale:.10g}{unit}"
    return f"{nbytes}B"


#: The sharded ops' others: NCCL and torch's symm_mem ops on symmetric buffers / with the copy.
SHARDED_NO_COPY_OTHERS = ("nccl", "torch_low_contention", "torch_multimem")
SHARDED_COPY_OTHERS = ("nccl", "torch_low_contention_copy")
#: The fused op's others: NCCL + rms_norm, FlashInfer's fused call.
FUSED_OTHERS = ("nccl_fused", "flashinfer_fused")

def _no_pool(sizes: list[int], world_size: int) -> int:
    return 0


@dataclass(frozen=True)
class BenchOp:
    """How `autosymm bench` measures an op (its spec names it: ``OpSpec.bench``): ``rows(options,
    setup, caps)`` its rows (of every op of ``options.ops`` it measures: ops sharing one function
    are measured by one call), ``table(result, op)`` the table it prints, ``others`` the (no-copy,
    with-copy) implementations autosymm is compared with, ``pool_bytes(sizes, world_size)`` the
    bytes of torch's symmetric pool (and zero-copy inputs) it needs."""

    rows: Callable
    table: Callable
    others: tuple[tuple[str, ...], tuple[str, ...]]
    pool_bytes: Callable[[list[int], int], int] = _no_pool


def benches() -> dict:
    """op spec -> its BenchOp, of every registered op that names one, in registry order."""
    return {record: load(record.bench) for record in registered() if record.bench}


def others_of(op: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(no-copy others, with-copy others) autosymm is compared with for ``op``."""
    return load(get(op).bench).others


def best_of(times: dict[str, Optional[float]], impls: tuple[str, ...]) -> Optional[tuple[str, float]]:
    """(impl, us) of the fastest of ``impls`` that has a time; None when none has."""
    timed = [(us, impl) for impl, us in times.items() if impl in impls and us]
    if not timed:
        return None
    us, impl = min(timed)
    return impl, us


@dataclass(frozen=True)
class Comparison:
    """One autosymm implementation's time in one (call, mode) against the best others."""

    impl: str
    us: Optional[float]
    best_no_copy: Optional[tuple[str, float]]
    best_copy: Optional[tuple[str, float]]

    @staticmethod
    def _ratio(us: Optional[float], best: Optional[tuple[str, float]]) -> Optional[float]:
        return us / best[1] if us and best else None

    @property
    def vs_no_copy(self) -> Optional[float]:
        return self._ratio(self.us, self.best_no_copy)

    @property
    def vs_copy(self) -> Optional[float]:
        return self._ratio(self.us, self.best_copy)


def cells(rows: list[BenchRow], op: str) -> dict[tuple[str, str], dict[str, BenchRow]]:
    """{(label, mode): {impl: row}} of ``op``'s rows, in the order they were measured."""
    out: dict[tuple[str, str], dict[str, BenchRow]] = {}
    for row in rows:
        if row.op == op:
            out.setdefault((row.label, row.mode), {})[row.impl] = row
    return out


def compare(cell: dict[str, BenchRow], op: str, impl: str = "autosymm") -> Comparison:
    """``impl`` (an autosymm implementation) in one (call, mode) cell against the best others."""
    times = {name: row.us for name, row in cell.items()}
    no_copy, copy = others_of(op)
    mine = cell.get(impl)
    return Comparison(impl, mine.us if mine else None, best_of(times, no_copy), best_of(times, copy))


def losses(rows: list[BenchRow]) -> list[str]:
    """One line per (call, mode, autosymm implementation, best other) where autosymm is slower,
    e.g. '6kB eager: autosymm 8.20 us = 1.09x torch_two_shot (7.50 us, no copy)'. A zero-copy
    call is compared with the no-copy baselines only (both sides own symmetric buffers)."""
    lines = []
    for op in dict.fromkeys(r.op for r in rows):
        for (label, mode), cell in cells(rows, op).items():
            for impl in AUTOSYMM_IMPLS:
                c = compare(cell, op, impl)
                kinds = [("no copy", c.vs_no_copy, c.best_no_copy)]
                if impl == "autosymm":
                    kinds.append(("with copy", c.vs_copy, c.best_copy))
                lost: dict[tuple[str, float], list[str]] = {}
                for kind, ratio, best in kinds:
                    if ratio is not None and ratio > 1.0 and best is not None:
                        lost.setdefault(best, []).append(kind)
                for (other, us), which in lost.items():
                    lines.append(f"{op} {label} {mode}: {impl} {c.us:.2f} us = {c.us / us:.2f}x {other} "
                                 f"({us:.2f} us, {' and '.join(which)})")
    return lines


#: The range of the issue's strictest all-reduce target (autosymm / best other <= 0.90), bytes.
MID_RANGE = (512 << 10, 8 << 20)


def worst_ratios(rows: list[BenchRow], impl: str = "autosymm") -> list[str]:
    """Per mode, ``impl``'s largest all-reduce ratio against each kind of best other, over every
    size and over :data:`MID_RANGE`, e.g. 'graph: autosymm / best no-copy <= 1.093 (6kB);
    512KiB-8MiB <= 0.912 (3MB)'."""
    lines = []
    by_cell = cells(rows, ALL_REDUCE.name)
    for mode in dict.fromkeys(m for _, m in by_cell):
        parts = []
        for kind in ("no-copy", "with-copy") if impl == "autosymm" else ("no-copy",):  # as in losses()
            ratios = []
            for (label, m), cell in by_cell.items():
                c = compare(cell, ALL_REDUCE.name, impl)
                ratio = c.vs_no_copy if kind == "no-copy" else c.vs_copy
                if m == mode and ratio is not None:
                    ratios.append((ratio, label, cell[impl].nbytes))
            if not ratios:
                continue
            worst = max(ratios)
            mid = [r for r in ratios if MID_RANGE[0] <= r[2] <= MID_RANGE[1]]
            text = f"{impl} / best {kind} <= {worst[0]:.3f} ({worst[1]})"
            if mid:
                text += f", {size_label(MID_RANGE[0])}-{size_label(MID_RANGE[1])} <= {max(mid)[0]:.3f} ({max(mid)[1]})"
            parts.append(text)
        if parts:
            lines.append(f"{mode}: " + "; ".join(parts))
    return lines


def failures(rows: list[BenchRow]) -> list[str]:
    """One line per (op, impl, note) of the rows not timed (a wrong output, or an implementation
    that cannot run the call), naming the calls: 'all_reduce torch_two_shot (6kB eager, 6kB
    graph): wrong output, ...'."""
    calls: dict[tuple[str, str, str], list[str]] = {}
    for r in rows:
        if r.us is None and r.note:
            calls.setdefault((r.op, r.impl, r.note), []).append(f"{r.label} {r.mode}")
    return [f"{op} {impl} ({', '.join(where)}): {note}" for (op, impl, note), where in calls.items()]


def moe_link_gbps(nbytes: int, us: float, world_size: int) -> float:
    """GB/s over NVLink of a MoE conversion moving ``nbytes`` of rows per rank in ``us``: with
    uniformly spread experts a fraction (W-1)/W of the rows goes to peers, the rest stays local."""
    return nbytes * (world_size - 1) / world_size / us / 1e3


def _us(row: Optional[BenchRow]) -> str:
    return f"{row.us:.2f}" if row is not None and row.us else "-"


def _x(ratio: Optional[float]) -> str:
    return f"{ratio:.3f}" if ratio is not None else "-"


def all_reduce_table(result: BenchResult):
    table = Table(title="all_reduce: median us per call (MAX over ranks); ratios < 1: autosymm faster")
    ratio_columns = ["autosymm / best no-copy", "autosymm / best with-copy", "zero-copy / best no-copy"]
    for column in ["size", "mode", *[i.replace("_", " ") for i in ALL_REDUCE_IMPLS], "chosen", *ratio_columns]:
        table.add_column(column, overflow="fold")  # long names wrap, never end in an ellipsis
    for (label, mode), cell in cells(result.rows, ALL_REDUCE.name).items():
        plain, zero = compare(cell, ALL_REDUCE.name), compare(cell, ALL_REDUCE.name, "autosymm_zero_copy")
        chosen = cell["autosymm"].backend if "autosymm" in cell else "-"
        table.add_row(label, mode, *[_us(cell.get(i)) for i in ALL_REDUCE_IMPLS], chosen or "-",
                      _x(plain.vs_no_copy), _x(plain.vs_copy), _x(zero.vs_no_copy))
    return table


def moe_table(result: BenchResult, op: str):
    table = Table(title=f"{op}: median us per call (MAX over ranks); link GB/s = rows leaving the rank / time")
    for column in ["shape/tokens", "mode", *MOE_IMPLS, "chosen", "autosymm / plain", "autosymm / best other",
                   *[f"link GB/s {i}" for i in MOE_IMPLS], "autosymm % peer write"]:
        table.add_column(column, overflow="fold")
    for (label, mode), cell in cells(result.rows, op).items():
        gbps = {i: moe_link_gbps(r.nbytes, r.us, result.world_size) for i, r in cell.items() if r.us}
        auto = gbps.get("autosymm")
        share = f"{auto / result.peer_write_gbps:.0%}" if auto and result.peer_write_gbps else "-"
        chosen = cell["autosymm"].backend if "autosymm" in cell else "-"
        mine, plain = cell.get("autosymm"), cell.get("plain_all_to_all")
        vs_plain = mine.us / plain.us if mine and plain and mine.us and plain.us else None
        table.add_row(label, mode, *[_us(cell.get(i)) for i in MOE_IMPLS], chosen or "-", _x(vs_plain),
                      _x(compare(cell, op).vs_no_copy), *[f"{gbps[i]:.1f}" if i in gbps else "-" for i in MOE_IMPLS],
                      share)
    return table


def csv_rows(result: BenchResult) -> list[dict]:
    """The CSV's rows: each BenchRow's fields, then :data:`CSV_EXTRA` (the ratios on autosymm's
    rows only, empty elsewhere)."""
    by_cell = {op: cells(result.rows, op) for op in dict.fromkeys(r.op for r in result.rows)}
    out = []
    for row in result.rows:
        extra = {"world_size": result.world_size, "gpu": result.hardware.get("gpu_name"),
                 "vs_best_no_copy": "", "vs_best_copy": "", "comm_env": result.comm_env}
        if row.impl in AUTOSYMM_IMPLS:
            c = compare(by_cell[row.op][(row.label, row.mode)], row.op, row.impl)
            extra.update(vs_best_no_copy="" if c.vs_no_copy is None else f"{c.vs_no_copy:.4f}",
                         vs_best_copy="" if c.vs_copy is None else f"{c.vs_copy:.4f}")
        out.append({**asdict(row), **extra})
    return out


def write_bench_csv(result: BenchResult, path: str) -> None:
    """All rows as CSV: op,label,nbytes,mode,impl,us,backend,note, then :data:`CSV_EXTRA`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = [f for f in BenchRow.__dataclass_fields__] + list(CSV_EXTRA)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(csv_rows(result))

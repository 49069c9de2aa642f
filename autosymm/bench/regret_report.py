"""What `autosymm bench --regret` reports, kept free of GPUs and process groups: its records, their
summary, the printed tables, the CSV and the JSON summary. The measures, as FlashInfer's
autotuner RFC (flashinfer-ai/flashinfer#3920) defines them:

* **regret** at a size between tuned points: t(chosen) / t(best at the exact size) - 1, where
  chosen is the dispatcher's pick and best the winner of a tune at that exact size, both
  re-timed interleaved (:class:`RegretRow`; 0 when the two picks are one);
* **winner-flip rate**: of the keys tuned twice on one node, the fraction whose winner (backend
  and config) differs between the two tunes (:class:`FlipRow`);
* **replay fidelity**: a graph row's time against the measured replay of the dispatched call in a
  user's CUDA graph: replay per call / row (:class:`ReplayRow`), and whether the call ran the
  row's pick.

A stand-in run (``--cpu``: gloo ranks, stand-in timings) reports what ran and what was picked,
never a time, a ratio or a regret: they would measure nothing.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..tuning.timing import percentile


@dataclass
class RegretRow:
    """One (size between tuned points, mode): the dispatcher's pick (``chosen``; ``source``: the
    row it came from, ``reason``: the dispatcher's words) and the exact tune's winner (``best``),
    their re-timed medians (us) and the regret (None: not measured, ``note`` says why)."""

    op: str
    label: str
    mode: str
    chosen: str
    source: str
    reason: str
    best: str = ""
    chosen_us: Optional[float] = None
    best_us: Optional[float] = None
    regret: Optional[float] = None
    note: str = ""


@dataclass
class FlipRow:
    """One key tuned twice: each tune's winner, and ``gap``, how much slower the second tune's
    winner was than the first's in the first tune (None where the first did not time it)."""

    op: str
    label: str
    mode: str
    first: str
    second: str
    gap: Optional[float] = None

    @property
    def flipped(self) -> bool:
        return self.first != self.second


@dataclass
class ReplayRow:
    """A graph row's key: its ``row_us`` (the winner's median) and ``row_pick``, what the
    dispatcher ran (``served``), the replay's per-call us in a user's graph of ``calls`` calls,
    and replay / row (None: not measured, ``note`` says why)."""

    op: str
    label: str
    row_pick: str
    served: str
    row_us: float
    calls: int
    replay_us: Optional[float] = None
    ratio: Optional[float] = None
    note: str = ""

    @property
    def as_tuned(self) -> bool:
        return self.row_pick == self.served


@dataclass
class RegretResult:
    """Rank 0's result: the node (``hardware``, ``world_size``), the databases the dispatcher read
    (``sources``), whether timings were stand-ins, and the rows of the three measures."""

    hardware: str
    world_size: int
    stand_in: bool
    sources: list[str] = field(default_factory=list)
    regret: list[RegretRow] = field(default_factory=list)
    flips: list[FlipRow] = field(default_factory=list)
    replay: list[ReplayRow] = field(default_factory=list)


def regret_of(chosen_us: float, best_us: float) -> Optional[float]:
    """t(chosen) / t(best) - 1 with the best the faster of the two timings (so >= 0); None where
    either is not a finite, positive time."""
    if not (math.isfinite(chosen_us) and math.isfinite(best_us)) or min(chosen_us, best_us) <= 0:
        return None
    return chosen_us / min(chosen_us, best_us) - 1.0


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "median": None, "p90": None, "max": None}
    ordered = sorted(values)
    return {"n": len(ordered), "median": statistics.median(ordered), "p90": percentile(ordered, 90),
            "max": ordered[-1]}


def summary(result: RegretResult) -> dict:
    """The JSON summary: per mode the regret's median, p90 and max over the measured sizes and
    the share where the dispatcher picked the exact winner (top-1); the flip rate; the replay
    ratios and the share served as tuned. A stand-in run's times and ratios are left out."""
    out: dict = {"hardware": result.hardware, "world_size": result.world_size, "stand_in": result.stand_in,
                 "sources": result.sources, "regret": {}, "flips": {}, "replay": {}}
    for mode in dict.fromkeys(r.mode for r in result.regret):
        rows = [r for r in result.regret if r.mode == mode]
        measured = [r for r in rows if r.regret is not None]
        stats = _stats([r.regret for r in measured])
        stats.update(sizes=len(rows), not_measured=len(rows) - len(measured),
                     top1=sum(r.chosen == r.best for r in measured) / len(measured) if measured else None)
        out["regret"][mode] = stats
    flipped = [f for f in result.flips if f.flipped]
    out["flips"] = {"keys": len(result.flips), "flipped": len(flipped),
                    "rate": len(flipped) / len(result.flips) if result.flips else None}
    ratios = [r.ratio for r in result.replay if r.ratio is not None]
    out["replay"] = {**_stats(ratios), "keys": len(result.replay), "min": min(ratios) if ratios else None,
                     "as_tuned": sum(r.as_tuned for r in result.replay)}
    return _without_times(out) if result.stand_in else out


def _without_times(out: dict) -> dict:
    """A stand-in summary: counts and picks stay, every time, ratio and regret is None."""
    for stats in out["regret"].values():
        stats.update(median=None, p90=None, max=None, top1=None)
    out["replay"].update(median=None, p90=None, max=None, min=None)
    out["flips"].update(flipped=None, rate=None)  # stand-in timings decide those winners
    return out


def _cell(value: Optional[float], text: str, stand_in: bool) -> str:
    return "-" if value is None or stand_in else text.format(value)


def tables(result: RegretResult) -> list[tuple[str, list[str], list[list[str]]]]:
    """The printed tables as (title, columns, rows): regret per (size, mode), the flipped keys,
    replay fidelity (the CLI draws them)."""
    s = result.stand_in
    regret = [[r.op, r.label, r.mode, r.source, r.chosen, r.best or "-", _cell(r.chosen_us, "{:.2f}", s),
               _cell(r.best_us, "{:.2f}", s), _cell(r.regret, "{:+.1%}", s), r.note] for r in result.regret]
    # a stand-in run's winners are the stand-in timings': which flipped says nothing
    flips = [[f.op, f.label, f.mode, f.first, f.second, _cell(f.gap, "{:+.1%}", s)] for f in result.flips
             if f.flipped and not s]
    replay = [[r.op, r.label, r.served + ("" if r.as_tuned else f" (row: {r.row_pick})"), _cell(r.row_us, "{:.2f}", s),
               _cell(r.replay_us, "{:.2f}", s), _cell(r.ratio, "{:.3f}", s), str(r.calls), r.note] for r in result.replay]
    return [("regret between tuned points: t(chosen) / t(best at the exact size) - 1",
             ["op", "size", "mode", "dispatched from", "chosen (dispatch)", "best (exact tune)", "chosen us",
              "best us", "regret", "note"], regret),
            ("winner flips between two tunes of this node", ["op", "size", "mode", "first tune", "second tune", "gap"],
             flips),
            ("replay fidelity: a graph row against the dispatched call replayed in a user's graph",
             ["op", "key", "served", "row us", "replay us/call", "replay / row", "calls/graph", "note"], replay)]


def lines(result: RegretResult) -> list[str]:
    """The summary lines after the tables."""
    data = summary(result)
    out = [f"{result.hardware}, world size {result.world_size}; the dispatcher read: "
           f"{', '.join(result.sources) or 'no database'}"]
    if result.stand_in:
        out.append("stand-in timings on gloo ranks (--cpu): the plumbing ran; no time, ratio or regret is printed "
                   "(they would measure nothing)")
    for mode, stats in data["regret"].items():
        text = ("regret not printed" if result.stand_in else
                f"regret median {_pct(stats['median'])}, p90 {_pct(stats['p90'])}, max {_pct(stats['max'])}, "
                f"top-1 {_pct(stats['top1'], '.0%')}")
        out.append(f"{mode}: {stats['n']} of {stats['sizes']} sizes measured; {text}")
    flips = data["flips"]
    out.append(f"winner flips: {flips['keys']} keys tuned twice" +
               ("" if result.stand_in else f", {flips['flipped']} flipped ({_pct(flips['rate'], '.0%')})"))
    replay = data["replay"]
    out.append(f"replay fidelity: {replay['n']} of {replay['keys']} graph rows replayed, {replay['as_tuned']} served "
               "as tuned" + ("" if result.stand_in else
                             f"; replay / row median {_num(replay['median'])}, min {_num(replay['min'])}, "
                             f"max {_num(replay['max'])}"))
    return out


def _pct(value: Optional[float], spec: str = "+.1%") -> str:
    return "-" if value is None else format(value, spec)


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


CSV_COLUMNS = ("measure", "op", "label", "mode", "chosen", "best", "chosen_us", "best_us", "regret", "first",
               "second", "gap", "row_pick", "served", "row_us", "replay_us", "ratio", "calls", "note")
#: The columns that hold times or ratios (empty in a stand-in run's CSV).
_TIMED = ("chosen_us", "best_us", "regret", "gap", "row_us", "replay_us", "ratio")


def csv_rows(result: RegretResult) -> list[dict]:
    """One CSV row per record, ``measure`` naming which (regret | flip | replay)."""
    rows = [{"measure": "regret", **asdict(r), "note": "; ".join(filter(None, (r.note, r.reason)))}
            for r in result.regret]
    rows += [{"measure": "flip", **asdict(f)} for f in result.flips]
    rows += [{"measure": "replay", **asdict(r)} for r in result.replay]
    out = []
    for row in rows:
        row["mode"] = row.get("mode", "graph")
        if result.stand_in:
            row.update({column: None for column in _TIMED})
        out.append({column: row.get(column) for column in CSV_COLUMNS})
    return out


def write_csv(result: RegretResult, path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(result))


def write_json(result: RegretResult, path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary(result), f, indent=1)

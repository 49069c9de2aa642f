"""Problem -> Decision: which backend and config serve a call, and why.

The decision is a pure function of (problem, mode, capabilities, database rows), so every rank
that sees the same databases decides the same (api.py checks the databases' digest across ranks
once per group). Rules, in order:

1. ``AUTOSYMM_DISABLE=1`` -> the fallback backend (NCCL) everywhere.
2. all-reduce over world size 1 -> ``noop`` (the identity).
3. a group spanning nodes -> NCCL, the engine for that scale.
4. the user database, then the shipped ones: the rows of (hardware, world size, op, dtype,
   bucket, shape, mode), fastest first; the first whose backend can serve the call wins
   (a faster backend that cannot — dtype, alignment, size over the workspace, no multicast, not
   capturable in graph mode — is skipped for the next). NCCL's own row takes part, so where
   NCCL measured faster it wins.
   Bucket: the smallest tuned bucket >= the call's bucket, else the largest tuned one.
   No row for the mode: the other mode's rows. No row for the dtype: the bf16 rows of the
   same byte bucket (kernels are byte-bound), said in the reason.
5. nothing usable -> the fallback: NCCL for all-reduce; for MoE the Triton conversion with its
   default config where it can serve (no NCCL path is graph-capturable), else NCCL all_to_all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from .backends import FALLBACK, FALLBACK_ORDER, Capabilities, get_backend
from .configs import AnyConfig, config_fields
from .db_schema import Key, version_mismatch
from .hardware import running_versions
from .problem import Problem


@dataclass(frozen=True)
class Decision:
    """What serves a call: backend name, its config, and where that came from."""

    backend: str
    config: Optional[AnyConfig]
    reason: str
    source: str = ""  # database file the row came from ('' for fallbacks)
    expected_us: Optional[float] = None
    nccl_us: Optional[float] = None
    bucket: int = 0
    mode: str = "eager"
    skipped: tuple[str, ...] = field(default=(), compare=False)  # "backend: why" of faster rows passed over

    def describe(self) -> str:
        text = f"{self.backend}"
        if self.config is not None:
            fields = ", ".join(f"{k}={v}" for k, v in config_fields(self.config).items())
            text += f" [{fields}]"
        if self.expected_us is not None:
            text += f", expected {self.expected_us:.2f} us"
            if self.nccl_us:
                text += f" (NCCL {self.nccl_us:.2f} us, {self.nccl_us / self.expected_us:.2f}x)"
        text += f" - {self.reason}"
        if self.source:
            text += f" ({Path(self.source).name})"
        return text


@dataclass
class DBSource:
    """An opened tuning database and the label (path) used in decisions."""

    db: object  # autosymm.db.TuningDB
    label: str


def disabled_by_env() -> bool:
    return os.environ.get("AUTOSYMM_DISABLE", "0") not in ("", "0", "false", "False")


def fallback_decision(problem: Problem, mode: str, caps: Capabilities, reason: str) -> Decision:
    """The decision when no tuned row serves ``problem``: the first backend of the op's
    FALLBACK_ORDER that can serve it, with its ``fallback_config``; else the op's FALLBACK."""
    for name in FALLBACK_ORDER[problem.op]:
        backend = get_backend(name)
        if backend.why_not(problem, caps, mode) is None:
            config = backend.fallback_config(problem)
            note = "; untuned default config" if config is not None else ""
            return Decision(name, config, reason + note, bucket=problem.bucket, mode=mode)
    return Decision(FALLBACK[problem.op], None, reason, bucket=problem.bucket, mode=mode)


def _pick_bucket(tuned: Sequence[int], bucket: int) -> Optional[int]:
    if not tuned:
        return None
    larger = [b for b in tuned if b >= bucket]
    return min(larger) if larger else max(tuned)


def _candidate_keys(problem: Problem, mode: str):
    """(dtype, mode, note) lookups in order of preference."""
    other = "graph" if mode == "eager" else "eager"
    yield problem.dtype, mode, ""
    yield problem.dtype, other, f"no {mode}-mode row, using the {other}-mode row"
    if problem.dtype != "bf16" and problem.op == "all_reduce":
        yield "bf16", mode, f"no {problem.dtype} row, using the bf16 row of the same byte size"
        yield "bf16", other, f"no {problem.dtype} row, using the bf16 {other}-mode row"


def _lookup_problem(problem: Problem, dtype: str) -> tuple[Problem, int]:
    """(problem as keyed in the DB, its bucket) for a lookup under ``dtype``."""
    if dtype == problem.dtype:
        return problem, problem.bucket
    keyed = replace(problem, dtype=dtype)
    return keyed, keyed.bucket


def decide(problem: Problem, mode: str, caps: Capabilities, sources: Sequence[DBSource], hardware: str) -> Decision:
    """The decision for ``problem`` in ``mode`` (see the module docstring for the rules)."""
    if disabled_by_env():
        return Decision(FALLBACK[problem.op], None, "AUTOSYMM_DISABLE=1", bucket=problem.bucket, mode=mode)
    if problem.world_size == 1 and problem.op == "all_reduce":
        return Decision("noop", None, "world size 1: nothing to exchange", bucket=problem.bucket, mode=mode)
    if not caps.intra_node:
        return Decision(FALLBACK[problem.op], None, "group spans nodes: NCCL", bucket=problem.bucket, mode=mode)
    skipped: list[str] = []
    for dtype, row_mode, note in _candidate_keys(problem, mode):
        keyed, call_bucket = _lookup_problem(problem, dtype)
        for source in sources:
            buckets = source.db.buckets(hardware, problem.world_size, problem.op, dtype, keyed.shape_key, row_mode)
            bucket = _pick_bucket(buckets, call_bucket)
            if bucket is None:
                continue
            rows = source.db.ranked(Key(hardware, problem.world_size, problem.op, dtype, bucket, keyed.shape_key,
                                        row_mode))
            nccl_us = next((r.nccl_us for r in rows if r.nccl_us), None)
            for row in rows:
                why_not = _why_not(row.backend, problem, caps, mode)
                if why_not is not None:
                    skipped.append(f"{row.backend}: {why_not}")
                    continue
                reason = f"tuned {bucket}-bucket {row_mode} row"
                for remark in (note, version_mismatch(row, *running_versions())):
                    if remark:
                        reason += f" ({remark})"
                return Decision(row.backend, row.config_obj, reason, source=source.label,
                                expected_us=row.median_us, nccl_us=nccl_us or row.nccl_us, bucket=bucket,
                                mode=mode, skipped=tuple(skipped))
    reason = "no tuned row for this hardware/world size/shape" if not skipped else "no tuned backend can serve the call"
    decision = fallback_decision(problem, mode, caps, reason)
    return replace(decision, skipped=tuple(skipped))


def _why_not(backend_name: str, problem: Problem, caps: Capabilities, mode: str) -> Optional[str]:
    try:
        backend = get_backend(backend_name)
    except (KeyError, ImportError) as exc:
        return f"not available here ({exc})"
    return backend.why_not(problem, caps, mode)


def open_sources(user_db: Optional[Path], shipped: Sequence[Path]) -> list[DBSource]:
    """Open the user DB (if it exists) and the shipped DBs, read-only, user first.

    A missing file is skipped; a corrupt or too-new one is skipped with a warning (the decision
    then falls back), never misread.
    """
    import warnings

    from .db import TuningDB

    sources: list[DBSource] = []
    for path in ([user_db] if user_db else []) + list(shipped):
        if path is None or not Path(path).exists():
            continue
        try:
            sources.append(DBSource(TuningDB(path, readonly=True), str(path)))
        except Exception as exc:  # corrupt / foreign / too-new DB: never misread, say why
            warnings.warn(f"autosymm: ignoring tuning database {path}: {exc}", stacklevel=2)
    return sources

"""Merging tuning databases (`autosymm db merge`): rows from other files are untrusted data, so
each is validated as every read does (autosymm.db_schema.Row, config included) and against the
backend registry (a backend autosymm has, serving the row's op, with a config of its algorithm);
what fails is skipped, warned about naming the file, and counted.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

from .backends import backend_names, get_backend
from .db import LOCK_WAIT_S, PK_COLUMNS, BadRowWarning, MergeCounts, Row, TuningDB


def _unmergeable(row: Row) -> Optional[str]:
    """Why ``row`` may not enter a database through a merge (its backend unknown, not serving
    its op, or holding another algorithm's config); None when it may."""
    if row.backend not in backend_names():
        return f"unknown backend {row.backend!r} (known: {', '.join(backend_names())})"
    try:
        backend = get_backend(row.backend)
    except ImportError:  # registered but not importable here: the name is all that can be checked
        return None
    if row.op not in backend.needs.ops:
        return f"backend {row.backend} does not serve op {row.op!r}"
    config = row.config_obj
    if config is None and backend.needs.compiles_kernels:
        return f"backend {row.backend} needs a launch config, the row holds none"
    want, have = getattr(backend, "algorithm", None), getattr(config, "algorithm", None)
    if config is not None and want is not None and have != want:
        return f"backend {row.backend} runs algorithm {want!r}, the config holds {have!r}"
    return None


def _mergeable_rows(db: TuningDB) -> tuple[list[Row], int]:
    """The rows of ``db`` a merge may copy, and how many it skips (bad or unmergeable, each warned about)."""
    rows, bad = db._select()
    keep = []
    for row in rows:
        why = _unmergeable(row)
        if why is None:
            keep.append(row)
            continue
        named = ", ".join(f"{c}={v!r}" for c, v in zip(PK_COLUMNS, row.pk))
        warnings.warn(f"autosymm: skipping a bad row of tuning database {db.location} ({named}): {why}",
                      BadRowWarning, stacklevel=3)
    return keep, len(bad) + len(rows) - len(keep)


def merge_files(sources: Sequence[Union[str, os.PathLike]], target: Union[str, os.PathLike], *,
                timeout_s: float = LOCK_WAIT_S) -> list[MergeCounts]:
    """Merge the database files ``sources`` into ``target`` (created if absent), in order, in one
    transaction; per key and backend the faster row wins. One MergeCounts per source; a source
    row that does not validate, names a backend autosymm does not have, or does not fit its
    backend is skipped (warned about, counted).

    Every source is opened and read before ``target`` is touched: an unreadable, corrupt or
    newer source raises and leaves ``target`` as it was (no new file when it did not exist); a
    target locked past ``timeout_s`` seconds raises DatabaseLockedError naming it.
    """
    loaded = []
    for source in sources:
        with TuningDB(source, readonly=True) as db:
            loaded.append(_mergeable_rows(db))
    target = Path(target).expanduser()
    created = not target.exists()
    try:
        with TuningDB(target, timeout_s=timeout_s) as into, into._guarded(), into._transaction():
            return [into._merge_rows(rows, skipped) for rows, skipped in loaded]
    except BaseException:
        if created:
            target.unlink(missing_ok=True)
        raise

"""The one read path of the tuning databases: which databases a process reads, which rows a
lookup gets from them, and what a key's winner is.

Precedence: the user database, then the shipped ones (:func:`open_sources`). A key's rows are its
valid rows in the **first database holding any valid row for it**: a user's tune of a point
replaces the shipped point whole, never mixes with it. **The winner** of a key is its fastest row
(ties: backend name): what ``autosymm show`` lists (:func:`winners`) and what the dispatcher serves
at a tuned point where its backend can serve the call. A :class:`DBSource` reads its database's
valid rows once, when opened, and serves every lookup from them: after set-up a call never
touches the file.

Design notes: docs/DISPATCH.md#db-read
"""

from __future__ import annotations

import itertools
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .open import MISSING, path_kind
from .store import DatabaseLockedError, QueryTimeoutError, TuningDB, rows_digest
from .schema import KEY_COLUMNS, NCCL_TRUST_MARGIN, Key, Row, nccl_trust, row_matches, where_clause
from ..hardware import nccl_version

log = logging.getLogger("autosymm")


@dataclass
class DBSource:
    """An opened tuning database, its label (path) for decisions, and its valid rows (read once):
    every row, or ``hardware``'s only (a process serving calls reads its own node's rows, so it
    validates no row of other hardware, nor loads the kernel modules their configs name)."""

    db: TuningDB
    label: str = ""
    hardware: Optional[str] = None
    _rows: list = field(default_factory=list, repr=False, compare=False)
    _families: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.label = self.label or self.db.location
        self._rows = self.db.rows() if self.hardware is None else self.db.rows(hardware=self.hardware)

    def digest(self) -> str:
        """The digest of the rows this source serves (autosymm.db.store.rows_digest): what ranks agree on."""
        return rows_digest(self._rows)

    def nccl_note(self, running: str) -> str:
        """What the NCCL trust rule (autosymm.db.schema.nccl_trust) does with this source's rows
        under the running NCCL ``running``: '' when no row was measured with another major.minor."""
        judged = [(row, nccl_trust(row, running)) for row in self._rows]
        other = [(row, trusted) for row, (trusted, note) in judged if note]
        if not other:
            return ""
        measured = sorted({row.nccl_version for row, _ in other})
        passed_over = sum(not trusted for _, trusted in other)
        return (f"{self.label}: {len(other)} of {len(self._rows)} rows were measured with NCCL "
                f"{', '.join(measured)}, this process runs NCCL {running}: rows that beat that NCCL by "
                f">= {NCCL_TRUST_MARGIN:g}x (and NCCL's own) stay, {passed_over} others are passed over "
                f"(`autosymm explain` names each with its margin)")

    def family(self, key: Key, any_shape: bool = False) -> list[Row]:
        """The rows of ``key`` at every bucket (``any_shape``: and every shape), per key fastest first."""
        lookup = (key.hardware, key.world_size, key.op, key.dtype, key.mode, None if any_shape else key.shape)
        rows = self._families.get(lookup)
        if rows is None:
            rows = self._families[lookup] = [
                r for r in self._rows if (r.hardware, r.world_size, r.op, r.dtype, r.mode) == lookup[:5]
                and (any_shape or r.shape == key.shape)]
        return rows


class Lookup:
    """What one lookup reads: the rows of ``key`` at every bucket (``any_shape``: every shape) in
    each source, and each tuned point's rows from the first source that has it."""

    def __init__(self, sources: Sequence[DBSource], key: Key, any_shape: bool = False) -> None:
        self._families = [(s.label, s.family(key, any_shape)) for s in sources]

    def points(self) -> list[tuple[str, int]]:
        """The tuned (shape, bucket) points of the lookup in any source, sorted."""
        return sorted({(r.shape, r.bucket) for _, rows in self._families for r in rows})

    def at(self, shape: str, bucket: int) -> list[tuple[str, Row]]:
        """(source label, row) of the point's rows in the first source holding any, fastest first
        (the first is the point's winner); [] when no source has it."""
        for label, rows in self._families:
            found = [(label, r) for r in rows if r.shape == shape and r.bucket == bucket]
            if found:
                return found
        return []

    def rows(self, shapes: set[str]) -> list[Row]:
        """Every source's rows of the lookup whose shape is in ``shapes`` (for the backends' floors)."""
        return [r for _, rows in self._families for r in rows if r.shape in shapes]


def winners(sources: Sequence[DBSource], **filters: Any) -> list[tuple[str, Row]]:
    """(source label, winner) of every key (see the module docstring) passing ``filters`` (the
    columns of autosymm.db.store.TuningDB.rows): key columns choose the keys; ``backend`` and ``gpu``
    filter the winners chosen (a key whose winner is another backend is left out). Sorted by key."""
    where_clause(filters)  # checks the names
    by_key = {c: v for c, v in filters.items() if c in KEY_COLUMNS}
    others = {c: v for c, v in filters.items() if c not in KEY_COLUMNS}
    first: dict[Key, tuple[str, Row]] = {}
    for source in sources:
        rows = [r for r in source._rows if row_matches(r, by_key)]
        for key, ranked in itertools.groupby(rows, key=lambda r: r.key):  # per key fastest first
            first.setdefault(key, (source.label, next(ranked)))
    return [first[key] for key in sorted(first, key=_key_order) if row_matches(first[key][1], others)]


def _key_order(key: Key) -> tuple:
    return key.hardware, key.world_size, key.op, key.dtype, key.shape, key.mode, key.bucket


def open_sources(user_db: Optional[Path], shipped: Sequence[Path], hardware: Optional[str] = None) -> list[DBSource]:
    """Open the user DB (if it exists) and the shipped DBs, read-only, user first, and read their
    rows (``hardware``'s only, where given: :class:`DBSource`).

    A missing file is skipped; one that cannot be used (not a regular file: a dangling link, a
    FIFO...; not SQLite, empty, foreign, a newer schema: autosymm.db.store.verdict) is skipped
    with a warning naming it and why (the decisions then fall back), never misread. A lock held
    past ``LOCK_WAIT_S`` or a query stopped by the clock raises (DatabaseLockedError / QueryTimeoutError, naming the file): at a group's first call it
    goes through the ranks' agreement, so every rank takes NCCL and rank 0 says why. A source
    whose rows were measured with another NCCL major.minor than this process runs is logged once
    per call (once per group: the group's set-up opens them) with what the trust rule does
    (:meth:`DBSource.nccl_note`).
    """
    sources: list[DBSource] = []
    for path in ([user_db] if user_db else []) + list(shipped):
        if path is None or path_kind(Path(path)) == MISSING:  # a dangling link, a FIFO...: warned about below
            continue
        try:
            sources.append(DBSource(TuningDB(Path(path), readonly=True), str(path), hardware))  # a Path: a file
        except (DatabaseLockedError, QueryTimeoutError):
            raise
        except Exception as exc:  # corrupt / foreign / too-new DB: never misread, say which and why
            warnings.warn(f"autosymm: ignoring tuning database {path}: {exc}", stacklevel=2)
    running = nccl_version()
    for note in filter(None, (source.nccl_note(running) for source in sources)):
        log.warning("autosymm: %s", note)
    return sources

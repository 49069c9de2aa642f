"""Merging tuning databases (`autosymm db merge`): rows from other files are untrusted data, so
each is validated by the validator every read uses (autosymm.db.schema.checked_row: fields,
vocabulary, bucket bound, config, and a backend autosymm has, serving the row's op, with a
config of its algorithm); what fails is skipped, warned about naming the file, and counted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, Union

from .open import claim
from .store import DatabaseLockedError, MergeCounts, Row, TuningDB

#: How long a merge waits for the target's write lock, seconds: another merge or tune of the
#: same file holds it for as long as its (legitimate, bulk) write takes, minutes for a file of
#: hundreds of thousands of rows on a slow machine. Each statement is bounded by the query clock
#: (autosymm.db.open.QUERY_LIMIT_S, re-armed as rows come back and per written batch) instead.
MERGE_LOCK_WAIT_S = 600.0


def _mergeable_rows(db: TuningDB) -> tuple[list[Row], int]:
    """The rows of ``db`` a merge may copy (those every read keeps: autosymm.db.schema.checked_row),
    and how many it skips (each warned about by the read)."""
    rows, bad = db._select()
    return rows, len(bad)


def merge_files(sources: Sequence[Union[str, os.PathLike]], target: Union[str, os.PathLike], *,
                timeout_s: float = MERGE_LOCK_WAIT_S) -> list[MergeCounts]:
    """Merge the database files ``sources`` into ``target`` (created if absent), in order, in one
    transaction; per key and backend the faster row wins. One MergeCounts per source; a source
    row that does not validate, names a backend autosymm does not have, or does not fit its
    backend is skipped (warned about, counted).

    Every source is opened and read before ``target`` is touched: an unreadable, corrupt or
    newer source raises and leaves ``target`` as it was (no new file when it did not exist); a
    target that is not a regular file (or a link to one) nor a free name raises
    NotADatabaseFileError naming it and what it is, and stays as it is (autosymm.db.open.claim);
    a target locked past ``timeout_s`` seconds raises DatabaseLockedError naming it. A failed
    merge removes only the file (and folders) it made itself.
    """
    loaded = []
    for source in sources:
        with TuningDB(Path(source), readonly=True) as db:
            loaded.append(_mergeable_rows(db))
    target = Path(target).expanduser()
    claimed = claim(target)
    try:
        with TuningDB(target, timeout_s=timeout_s) as into, into._guarded(), into._transaction():
            return [into._merge_rows(rows, skipped) for rows, skipped in loaded]
    except BaseException:
        if claimed.made is not None and _holds_no_rows(target):  # a concurrent merge may have filled it: kept
            claimed.undo()
        raise


def _holds_no_rows(path: Path) -> bool:
    """Whether the database file ``path`` is absent or holds no row (unreadable: treated as empty)."""
    if not path.exists():
        return True
    try:
        with TuningDB(path, readonly=True) as db:
            return len(db) == 0
    except DatabaseLockedError:  # another merge is writing it
        return False
    except Exception:  # a file this merge created and could not finish
        return True

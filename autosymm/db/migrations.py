"""The tuning database's schema on disk: creating its tables and view, and the migrations from
every older version (autosymm.db.store applies them inside one transaction; a read-only opening
of an older file reads its missing columns as NULL). The columns and the row are
autosymm.db.schema's."""

from __future__ import annotations

from typing import Callable

import sqlite_utils

from .schema import (PK_COLUMNS, RESULTS_COLUMNS, RESULTS_DEFAULTS, RESULTS_NOT_NULL, SCHEMA_VERSION, WINNERS_SQL,
                     CorruptDatabaseError)


def _create_meta_and_winners(db: sqlite_utils.Database) -> None:
    db["meta"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
    db.create_view("winners", WINNERS_SQL, ignore=True)


def create_schema(db: sqlite_utils.Database) -> None:
    """Create the current schema's tables and view in an empty database."""
    db["results"].create(RESULTS_COLUMNS, pk=PK_COLUMNS, not_null=RESULTS_NOT_NULL, defaults=RESULTS_DEFAULTS)
    _create_meta_and_winners(db)


def _migrate_0_to_1(db: sqlite_utils.Database) -> None:
    """Version 0 (pre-release) had no meta table, no winners view, no p10_us/p90_us/trials."""
    results = db.table("results")
    for column in ("p10_us", "p90_us", "trials"):
        if column not in results.columns_dict:
            results.add_column(column, RESULTS_COLUMNS[column])
    _create_meta_and_winners(db)


def _migrate_1_to_2(db: sqlite_utils.Database) -> None:
    """Version 1 had no ``comm_env`` (its rows read it as NULL: environment not recorded)."""
    if "results" not in db.table_names():
        raise CorruptDatabaseError("a version-1 tuning database without its results table")
    results = db.table("results")
    if "comm_env" not in results.columns_dict:
        results.add_column("comm_env", RESULTS_COLUMNS["comm_env"])


def _migrate_2_to_3(db: sqlite_utils.Database) -> None:
    """Version 2 had no ``nccl_version`` (its rows read it as NULL: the NCCL they beat unknown)."""
    if "results" not in db.table_names():
        raise CorruptDatabaseError("a version-2 tuning database without its results table")
    results = db.table("results")
    if "nccl_version" not in results.columns_dict:
        results.add_column("nccl_version", RESULTS_COLUMNS["nccl_version"])


def _migrate_3_to_4(db: sqlite_utils.Database) -> None:
    """Version 3 had no ``stack``, ``stack_us``, ``stack_note`` (its rows: tuned outside a stack)."""
    if "results" not in db.table_names():
        raise CorruptDatabaseError("a version-3 tuning database without its results table")
    results = db.table("results")
    for column in ("stack", "stack_us", "stack_note"):
        if column not in results.columns_dict:
            results.add_column(column, RESULTS_COLUMNS[column])


#: MIGRATIONS[n] turns a version-n database into version n + 1 (inside one transaction).
MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_migrate_0_to_1, _migrate_1_to_2, _migrate_2_to_3,
                                                              _migrate_3_to_4]
assert len(MIGRATIONS) == SCHEMA_VERSION

"""Shared helpers of the tuning-database tests: rows, raw SQL, file hashes, old files, processes."""

from __future__ import annotations

import hashlib
import multiprocessing
import sqlite3
from pathlib import Path

from autosymm.configs import AllReduceConfig, MoEConfig
from autosymm.db.store import PK_COLUMNS, Key, Row, TuningDB
from autosymm.db.read import DBSource, Lookup, winners

HW = "nvidia-h200-nvlink"


def make_row(**changes) -> Row:
    fields = dict(hardware=HW, gpu="NVIDIA H200", world_size=2, op="all_reduce", dtype="bf16",
                  bucket=1 << 20, backend="triton_one_shot", mode="eager",
                  config=AllReduceConfig("one_shot", 2048, 32, 8), median_us=10.0, p10_us=9.5,
                  p90_us=11.0, nccl_us=20.0, trials=40, autosymm_version="0.1.0",
                  torch_version="2.6.0", triton_version="3.2.0", cuda_version="12.4",
                  driver_version="550.54", created="2025-01-01T00:00:00+00:00")
    fields.update(changes)
    return Row(**fields)


def moe_row(**changes) -> Row:
    fields = dict(op="dp_to_ep", bucket=256, shape="d7168_e256_k8", backend="triton_moe",
                  config=MoEConfig(block_n=1024, num_warps=4, rows_per_program=2, num_blocks=132))
    fields.update(changes)
    return make_row(**fields)


def key_rows(tdb: TuningDB, key: Key) -> list[Row]:
    """The rows of ``key`` as the dispatcher reads them (autosymm.db.read.Lookup), fastest first."""
    return [row for _, row in Lookup([DBSource(tdb)], key).at(key.shape, key.bucket)]


def key_buckets(tdb: TuningDB, key: Key) -> list[int]:
    """The tuned buckets of ``key``'s lookup (its bucket aside) as the dispatcher sees them."""
    return [bucket for shape, bucket in Lookup([DBSource(tdb)], key).points() if shape == key.shape]


def winner_rows(*tdbs: TuningDB, **filters) -> list[Row]:
    """Each key's winner across ``tdbs`` (autosymm.db.read.winners), first database first."""
    return [row for _, row in winners([DBSource(t) for t in tdbs], **filters)]


def sql(tdb: TuningDB, statement: str, params=()) -> None:
    """Run a raw statement and commit it (what an outside tool, or a bug, might do)."""
    tdb.db.conn.execute(statement, params)
    tdb.db.conn.commit()


def plant(tdb: TuningDB, rows) -> None:
    """Store ``rows`` as they are, past record_many's validator (a file another tool wrote)."""
    tdb.db.table("results").upsert_all([row.to_dict() for row in rows], pk=PK_COLUMNS)
    tdb.db.conn.commit()


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_v0(path: Path) -> None:
    """Version 0 (pre-release): results without p10_us/p90_us/trials, no meta table, no view."""
    conn = sqlite3.connect(path)
    conn.execute("""CREATE TABLE results (hardware TEXT NOT NULL, gpu TEXT NOT NULL DEFAULT '',
        world_size INTEGER NOT NULL, op TEXT NOT NULL, dtype TEXT NOT NULL, bucket INTEGER NOT NULL,
        shape TEXT NOT NULL DEFAULT '', mode TEXT NOT NULL, backend TEXT NOT NULL,
        config TEXT NOT NULL DEFAULT '{}', median_us REAL NOT NULL, nccl_us REAL, speedup REAL,
        autosymm_version TEXT, torch_version TEXT, triton_version TEXT, cuda_version TEXT,
        driver_version TEXT, created TEXT NOT NULL,
        PRIMARY KEY (hardware, world_size, op, dtype, bucket, shape, mode, backend))""")
    conn.execute("INSERT INTO results (hardware, world_size, op, dtype, bucket, mode, backend, median_us, "
                 "nccl_us, created) VALUES (?, 2, 'all_reduce', 'bf16', 4096, 'eager', 'nccl', 8.0, 8.0, "
                 "'2024-06-01T00:00:00+00:00')", [HW])
    conn.commit()
    conn.close()


def run_processes(target, path: Path, count: int) -> list:
    """Run ``target(str(path), worker)`` in ``count`` processes at once; their exit codes."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    workers = [context.Process(target=target, args=(str(path), w)) for w in range(count)]
    for proc in workers:
        proc.start()
    for proc in workers:
        proc.join(timeout=120)
    return [proc.exitcode for proc in workers]


def big_file(path: Path, n_rows: int, median_us: float = 10.0) -> Path:
    """A tuning database of ``n_rows`` valid all-reduce NCCL rows (buckets 1..n_rows bytes),
    written with one executemany (seconds for 400 000 rows)."""
    with TuningDB(path):  # the schema
        pass
    conn = sqlite3.connect(path)
    conn.executemany(
        "INSERT INTO results (hardware, gpu, world_size, op, dtype, bucket, shape, mode, backend, config, "
        "median_us, nccl_us, created) VALUES (?, 'NVIDIA H200', 2, 'all_reduce', 'bf16', ?, '', 'eager', "
        "'nccl', '{}', ?, ?, '2026-01-01T00:00:00+00:00')",
        ((HW, bucket, median_us, median_us) for bucket in range(1, n_rows + 1)))
    conn.commit()
    conn.close()
    return path

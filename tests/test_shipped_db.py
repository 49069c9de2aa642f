"""The shipped tuning databases: found from the package, well-formed, consistent with their names."""

import warnings

import pytest

from autosymm.configs import config_from_json
from autosymm.db.store import SCHEMA_VERSION, BadRowWarning, TuningDB, shipped_db_for, shipped_db_paths
from autosymm.runtime.dispatch import DBSource, decide
from autosymm.backends import Capabilities
from autosymm.problem import Problem

PATHS = shipped_db_paths()


def test_the_2xh200_database_is_shipped():
    path = shipped_db_for("nvidia-h200-nvlink-x2")
    assert path is not None and path in PATHS


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_shipped_database_is_well_formed(path):
    db = TuningDB(path, readonly=True)
    assert db.schema_version == SCHEMA_VERSION
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadRowWarning)  # every shipped row validates
        rows = db.rows()
    assert rows and len(rows) == len(db)
    node_slug = path.stem
    for row in rows:
        assert node_slug.startswith(row.hardware + "-x"), (node_slug, row.hardware)
        assert row.gpu and row.torch_version and row.triton_version and row.driver_version and row.created
        assert row.median_us > 0 and (row.nccl_us is None or row.nccl_us > 0)
        config_from_json(row.config)  # parses
        assert row.nccl_version, "every shipped row records the NCCL it beat"


def test_shipped_h200_rows_beat_nccl_2_28_9_as_their_environment_says():
    # measured with torch 2.11.0+cu130, whose wheel pins nvidia-nccl-cu13==2.28.9 (docs/BENCHMARKS.md)
    with TuningDB(shipped_db_for("nvidia-h200-nvlink-x2"), readonly=True) as db:
        rows = db.rows()
        assert {(r.torch_version, r.nccl_version) for r in rows} == {("2.11.0+cu130", "2.28.9")}
        assert "NCCL 2.28.9" in db.meta()["measured"]


def test_shipped_h200_rows_drive_dispatch():
    path = shipped_db_for("nvidia-h200-nvlink-x2")
    caps = Capabilities(world_size=2, all_reduce_bytes=256 << 20, moe_bytes=256 << 20, intra_node=True,
                        torch_symm_ops=True, compute_capability=(9, 0))
    source = DBSource(TuningDB(path, readonly=True), str(path))
    for nbytes in (4096, 1 << 20, 1 << 28):
        for mode in ("eager", "graph"):
            decision = decide(Problem.all_reduce(nbytes, "bf16", 2), mode, caps, [source], "nvidia-h200-nvlink")
            assert decision.source == str(path) and decision.expected_us and decision.nccl_us
            assert decision.expected_us <= decision.nccl_us * 1.000001  # never slower than NCCL's own row


def test_the_docs_state_the_shipped_h200_database_as_it_is():
    """docs/DATABASE.md and docs/BENCHMARKS.md give the file's row count and its 2^k + 1.5 x 2^k sizes."""
    from pathlib import Path

    from autosymm.problem import parse_size_range

    root = Path(__file__).parent.parent
    db = TuningDB(root / "tuning_db" / "nvidia-h200-nvlink-x2.sqlite", readonly=True)
    rows = db.rows()
    assert f"default sweep, {len(rows)} rows: all-reduce at 2^k and 1.5 x 2^k bytes" in (root / "docs" / "DATABASE.md").read_text()
    assert f"exported: {len(rows)} rows" in (root / "docs" / "BENCHMARKS.md").read_text()
    sizes = sorted({r.bucket for r in rows if r.op == "all_reduce"})
    assert sizes == parse_size_range("4KiB:256MiB:2")

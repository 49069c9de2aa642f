"""The shipped tuning databases: found from the package, well-formed, consistent with their names."""

import warnings

import pytest

from autosymm.configs import config_from_json
from autosymm.db import SCHEMA_VERSION, BadRowWarning, TuningDB, shipped_db_for, shipped_db_paths
from autosymm.dispatch import DBSource, decide
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

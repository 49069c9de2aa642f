"""autosymm.db.read: which databases a process reads, each lookup's rows and a key's winner
(the first database holding the key, its fastest row), over in-memory and temp-file SQLite."""

from __future__ import annotations

import pytest

from autosymm.backends import Capabilities
from autosymm.db.store import TuningDB
from autosymm.db.read import DBSource, Lookup, open_sources
from autosymm.runtime.dispatch import decide
from autosymm.problem import Problem

from _db_rows import HW, make_row, moe_row, winner_rows


def test_open_sources_skips_missing_and_corrupt(tmp_path):
    good = tmp_path / "good.sqlite"
    TuningDB(good).record_many([make_row(backend="nccl", bucket=4096, median_us=20.0, config=None)])
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not sqlite" * 100)
    with pytest.warns(UserWarning, match="ignoring tuning database"):
        sources = open_sources(tmp_path / "missing.sqlite", [good, corrupt])
    assert [s.label for s in sources] == [str(good)]


def test_a_keys_winner_comes_from_the_first_database_holding_it():
    with TuningDB() as user, TuningDB() as shipped:
        user.record_many([make_row(median_us=12.0)])  # the user's tune of the point, slower than shipped
        shipped.record_many([make_row(backend="nccl", median_us=8.0, config=None),
                             make_row(backend="nccl", bucket=4096, median_us=3.0, config=None)])
        assert [(r.bucket, r.backend) for r in winner_rows(user, shipped)] == [(4096, "nccl"), (1 << 20, "triton_one_shot")]
        assert [(r.bucket, r.backend) for r in winner_rows(shipped, user)] == [(4096, "nccl"), (1 << 20, "nccl")]
        assert winner_rows(user, shipped, backend="nccl") == [shipped.rows(bucket=4096)[0]]  # filters the winners
        assert winner_rows(user, shipped, bucket=4096, world_size=[2, 4]) == shipped.rows(bucket=4096)
        with pytest.raises(ValueError, match="median_us"):
            winner_rows(user, median_us=1.0)


def test_a_lookup_takes_each_point_from_the_first_source_that_has_it():
    with TuningDB() as user, TuningDB() as shipped:
        user.record_many([make_row(median_us=12.0)])
        shipped.record_many([make_row(backend="nccl", median_us=8.0, config=None),
                             make_row(backend="nccl", bucket=4096, median_us=3.0, config=None),
                             moe_row(), moe_row(shape="d4096_e8_k2", bucket=16)])
        sources = [DBSource(user, "user"), DBSource(shipped, "shipped")]
        key = make_row().key
        lookup = Lookup(sources, key)
        assert lookup.points() == [("", 4096), ("", 1 << 20)]
        assert [(label, r.backend) for label, r in lookup.at("", 1 << 20)] == [("user", "triton_one_shot")]
        assert [(label, r.backend) for label, r in lookup.at("", 4096)] == [("shipped", "nccl")]
        assert lookup.at("", 8192) == []
        assert len(lookup.rows({""})) == 3  # every source's rows, for the backends' floors
        moe = Lookup(sources, moe_row().key._replace(shape="d1_e2_k1"), any_shape=True)
        assert moe.points() == [("d4096_e8_k2", 16), ("d7168_e256_k8", 256)]


def test_the_user_dbs_point_wins_the_dispatch_even_when_slower(tmp_path):
    caps = Capabilities(world_size=2, all_reduce_bytes=256 << 20, intra_node=True, compute_capability=(9, 0))
    with TuningDB() as user, TuningDB() as shipped:
        user.record_many([make_row(backend="nccl", median_us=25.0, config=None)])
        shipped.record_many([make_row(median_us=8.0), make_row(backend="nccl", median_us=20.0, config=None)])
        decision = decide(Problem.all_reduce(1 << 20), "eager", caps, [DBSource(user, "user"), DBSource(shipped, "s")], HW)
        assert (decision.backend, decision.source, decision.expected_us) == ("nccl", "user", 25.0)


def test_a_source_reads_its_rows_once_when_opened(tmp_path):
    from test_db_untrusted import locked

    path = tmp_path / "t.sqlite"
    with TuningDB(path) as tdb:
        tdb.record_many([make_row()])
    (source,) = open_sources(path, [])
    at_open = source.digest()
    assert at_open == source.db.digest()
    with TuningDB(path) as tdb:
        tdb.record_many([make_row(backend="nccl", median_us=1.0, config=None)])  # written after set-up
    assert source.digest() == at_open != source.db.digest()  # the ranks agree on the rows served
    with locked(path):  # a lock taken after set-up cannot reach a lookup
        assert [r for _, r in Lookup([source], make_row().key).at("", 1 << 20)] == [make_row()]

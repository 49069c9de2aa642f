import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autosymm.backends.triton_all_reduce import all_reduce_space
from autosymm.configs import (AllReduceConfig, FusedConfig, MoEConfig, config_fields, config_from_json,
                              config_to_json, iter_space_fields, moe_space)


@pytest.mark.parametrize("kwargs, message", [
    (dict(algorithm="three_shot", block_size=1024, num_blocks=1, num_warps=4), "algorithm"),
    (dict(algorithm="one_shot", block_size=1000, num_blocks=1, num_warps=4), "power of two"),
    (dict(algorithm="one_shot", block_size=64, num_blocks=1, num_warps=4), "smaller than the 128 threads"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=0, num_warps=4), "num_blocks=0"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=257, num_warps=4), "num_blocks=257"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=1, num_warps=3), "num_warps=3"),
    (dict(algorithm="two_shot", block_size=1024, num_blocks=1, num_warps=4, double_buffer=True), "only for"),
    (dict(algorithm="multimem", block_size=1024, num_blocks=1, num_warps=4, double_buffer=True), "only for"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=1, num_warps=4, double_buffer=1), "must be a bool"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=1, num_warps=4, double_buffer="yes"), "must be a bool"),
    (dict(algorithm=["one_shot"], block_size=1024, num_blocks=1, num_warps=4), "algorithm"),
    (dict(algorithm="one_shot", block_size=-1024, num_blocks=1, num_warps=4), "block_size=-1024"),
    (dict(algorithm="one_shot", block_size=1 << 17, num_blocks=1, num_warps=4), r"power of two in 1\.\.65536"),
    (dict(algorithm="one_shot", block_size=1 << 40, num_blocks=1, num_warps=4), "block_size=1099511627776"),
    (dict(algorithm="one_shot", block_size=1024.0, num_blocks=1, num_warps=4), "block_size=1024.0 must be an int"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=2.0, num_warps=4), "num_blocks=2.0 must be an int"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=True, num_warps=4), "num_blocks=True .*not a bool"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=1, num_warps=True), "num_warps=True .*not a bool"),
    (dict(algorithm="one_shot", block_size=1024, num_blocks=1, num_warps="4"), "num_warps='4' must be an int"),
])
def test_all_reduce_config_rejects_illegal(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AllReduceConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_n=100, num_warps=4), "block_n=100"),
    (dict(block_n=64, num_warps=4), "smaller than the 128 threads"),
    (dict(block_n=512, num_warps=4, rows_per_program=0), "rows_per_program=0"),
    (dict(block_n=512, num_warps=4, num_blocks=-1), "num_blocks=-1"),
    (dict(block_n=1 << 17, num_warps=4), "block_n=131072"),
    (dict(block_n=1024.0, num_warps=4), "block_n=1024.0 must be an int"),
    (dict(block_n=1024, num_warps=4, rows_per_program=True), "rows_per_program=True .*not a bool"),
    (dict(block_n=1024, num_warps=4, num_blocks=1.5), "num_blocks=1.5 must be an int"),
])
def test_moe_config_rejects_illegal(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(**kwargs)


def test_numpy_ints_are_taken_as_python_ints():
    config = AllReduceConfig("one_shot", np.int64(1024), np.int32(2), np.int64(4))
    plain = AllReduceConfig("one_shot", 1024, 2, 4)
    assert config == plain and hash(config) == hash(plain)
    assert type(config.block_size) is int and config_from_json(config_to_json(config)) == config
    assert type(MoEConfig(np.int64(1024), np.int64(4)).block_n) is int


def test_configs_name_their_family_records():
    """An all-reduce or fused config's algorithm is a record of its family (beside its backend):
    the names outside it are refused with the family's names, and double buffering and split
    rows only where the record allows them."""
    from autosymm.backends import triton_all_reduce, triton_fused
    from autosymm.configs import FusedConfig

    for name, record in triton_all_reduce.ALGORITHMS.items():
        assert AllReduceConfig(name, 1024, 1, 4).record is record
        if record.double_buffer:
            assert AllReduceConfig(name, 1024, 1, 4, double_buffer=True).double_buffer
    with pytest.raises(ValueError, match=r"not one of \('one_shot', 'one_shot_push', 'two_shot', 'multimem', 'lamport'\)"):
        AllReduceConfig("three_shot", 1024, 1, 4)
    assert [n for n, a in triton_all_reduce.ALGORITHMS.items() if a.double_buffer] == ["one_shot", "one_shot_push"]
    for name, record in triton_fused.ALGORITHMS.items():
        assert FusedConfig(name, 8192, 8, 8).record is record
    assert [n for n, a in triton_fused.ALGORITHMS.items() if a.row_split] == ["one_shot", "one_shot_push", "lamport"]
    assert [n for n, a in triton_fused.ALGORITHMS.items() if a.lamport] == ["lamport"]
    with pytest.raises(ValueError, match=r"not one of \('one_shot', 'one_shot_push', 'two_shot', 'lamport'\)"):
        FusedConfig("multimem", 8192, 8, 8)


def test_config_json_round_trip_and_unknown_keys():
    for config in (AllReduceConfig("two_shot", 4096, 24, 16), MoEConfig(1024, 8, 2, 132), None):
        assert config_from_json(config_to_json(config)) == config
    text = config_to_json(MoEConfig(512, 4)).replace("{", '{"future_field": 3, ', 1)
    assert config_from_json(text) == MoEConfig(512, 4)
    with pytest.raises(ValueError, match="unknown config type"):
        config_from_json('{"type": "Pickle", "x": 1}')


def test_double_buffer_json_is_backward_compatible():
    # a row written before the field existed (the shipped DB's format) loads as double_buffer=False
    old = '{"algorithm": "one_shot", "block_size": 4096, "num_blocks": 1, "num_warps": 8, "type": "AllReduceConfig"}'
    config = config_from_json(old)
    assert config == AllReduceConfig("one_shot", 4096, 1, 8) and config.double_buffer is False
    assert config_to_json(config) == old, "a config without double buffering serialises as before"
    on = AllReduceConfig("one_shot", 4096, 1, 8, double_buffer=True)
    assert json.loads(config_to_json(on))["double_buffer"] is True
    assert config_from_json(config_to_json(on)) == on
    assert hash(on) != hash(config) and on != config
    with pytest.raises(dataclasses.FrozenInstanceError):
        on.double_buffer = False
    # descriptions (dispatch, tuner, cli) read as before unless it is on
    assert "double_buffer" not in config_fields(config) and config_fields(on)["double_buffer"] is True
    assert dataclasses.replace(on, double_buffer=False) == config and dataclasses.asdict(config)["double_buffer"] is False


AR_JSON = '{"algorithm": "one_shot", "block_size": %s, "num_blocks": 1, "num_warps": 4, "type": "AllReduceConfig"}'


@pytest.mark.parametrize("text", [
    "not json", "{", "[1, 2]", "5", '"text"', "null", "[" * 100_000, b"{}", 7,  # not a JSON object
    '{"x": 1}', '{"type": "Pickle"}', '{"type": ["AllReduceConfig"]}', '{"type": null, "block_n": 1}',  # type
    '{"type": "AllReduceConfig"}', '{"type": "MoEConfig", "num_warps": 4}',  # fields missing
    '{"type": "MoEConfig", "block_n": "1024", "num_warps": 4}', AR_JSON % "true", AR_JSON % "4096.0",
    AR_JSON % "-4096", AR_JSON % (1 << 40), AR_JSON % "NaN", AR_JSON % "[]", AR_JSON % "{}",  # wrong values
], ids=lambda text: repr(text)[:48])
def test_config_from_json_raises_only_value_error_on_malformed_text(text):
    with pytest.raises(ValueError) as info:
        config_from_json(text)
    assert type(info.value) is ValueError  # not JSONDecodeError, TypeError, KeyError, AttributeError


_json_scalars = st.none() | st.booleans() | st.integers(-2, 1 << 41) | st.floats() | st.text(max_size=4)
_json_values = st.recursive(
    _json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6)
_config_dicts = st.dictionaries(
    st.sampled_from(["algorithm", "block_size", "num_blocks", "num_warps", "double_buffer", "block_n",
                     "rows_per_program"]),
    _json_values | st.sampled_from(["one_shot", "two_shot", 4, 16, 1024, 4096]), max_size=7,
).flatmap(lambda d: st.sampled_from(["AllReduceConfig", "MoEConfig", "Other", 3]).map(lambda t: {**d, "type": t}))


@given(st.text(max_size=40) | _json_values.map(json.dumps) | _config_dicts.map(json.dumps))
def test_property_config_from_json_answers_a_config_or_a_value_error(text):
    try:
        config = config_from_json(text)
    except ValueError:
        return
    assert config is None or config_from_json(config_to_json(config)) == config


def test_moe_space():
    space = moe_space(d_model=7168, n_rows=4096)
    assert space and len(space) == len(set(space))
    assert {c.block_n for c in space} >= {1024, 2048, 4096}
    tiny = moe_space(d_model=64, n_rows=1)
    assert all(c.block_n <= 512 for c in tiny)  # BLOCK beyond twice the row only masks
    assert all(c.num_blocks == 0 for c in tiny)  # one row: no persistent grid is narrower


def test_iter_space_fields():
    fields = dict(iter_space_fields(all_reduce_space("two_shot", 1 << 20, 2, 2)))
    assert set(fields) == {"algorithm", "block_size", "num_blocks", "num_warps", "double_buffer", "eager_launch",
                           "spin"}
    assert fields["spin"] == [False]  # the Lamport spin: its record's space at world size 2 alone
    assert fields["algorithm"] == ["two_shot"] and fields["double_buffer"] == [False]
    assert fields["eager_launch"] == ["replay"]  # the eager twins are the sweep's (with_eager_launches)
    assert fields["num_warps"] == sorted(fields["num_warps"])
    assert dict(iter_space_fields(all_reduce_space("one_shot", 8192, 2, 2)))["double_buffer"] == [False, True]
    assert dict(iter_space_fields(all_reduce_space("lamport", 8192, 2, 2)))["spin"] == [False, True]
    assert dict(iter_space_fields(all_reduce_space("lamport", 8192, 4, 2)))["spin"] == [False]


@pytest.mark.parametrize("config", [AllReduceConfig("one_shot", 1024, 4, 4), FusedConfig("one_shot", 8192, 8, 4)])
def test_eager_launch_is_replay_unless_a_row_says_direct(config):
    """Rows written before the field read as 'replay' and serialise unchanged; 'direct' round-trips;
    anything else is a ValueError naming the field."""
    assert config.eager_launch == "replay" and "eager_launch" not in config_to_json(config)
    direct = dataclasses.replace(config, eager_launch="direct")
    assert '"eager_launch": "direct"' in config_to_json(direct)
    assert config_from_json(config_to_json(direct)) == direct != config
    with pytest.raises(ValueError, match="eager_launch='graph' must be one of"):
        dataclasses.replace(config, eager_launch="graph")

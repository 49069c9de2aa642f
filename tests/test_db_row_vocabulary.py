"""autosymm.db.schema.checked_row, the one row validator: a row's op, dtype and mode are autosymm's
words, its bucket fits the largest tensor a call can have, its key is one a call has (the op's and
the epilogue's own rules: NVFP4's hidden size), its backend is one autosymm has; a row
that is not is skipped with a warning by `db merge`, `db export`, `show` and the dispatcher's read
alike (temp-file SQLite; CliRunner for the CLI)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from click.testing import CliRunner

from autosymm import spec
from autosymm.cli.main import main
from autosymm.db.store import BadRowWarning, Key, Row, TuningDB, shipped_db_paths
from autosymm.db.merge import merge_files
from autosymm.db.read import open_sources
from autosymm.db.schema import MAX_TENSOR_BYTES, checked_row
from autosymm.problem import MODEL_SHAPES
from autosymm.spec.all_reduce_rmsnorm import EPILOGUES, shape_key

from _db_rows import HW, make_row, moe_row, plant

GOOD = [make_row(backend="nccl", median_us=20.0, config=None), moe_row()]
#: The rows of the issue (an all-gather at 2**62 B, dtype 'int8x', an unknown backend) and kin.
BAD = {
    "all-gather bucket 2**62 B": dict(op="all_gather", backend="nccl_all_gather", bucket=1 << 62, config="{}"),
    "all-reduce bucket over 1 TiB": dict(bucket=MAX_TENSOR_BYTES + 1),
    "MoE tokens over 1 TiB": dict(op="dp_to_ep", backend="triton_moe", shape="d7168_e256_k8", bucket=1 << 27,
                                  config=moe_row().config),
    "dtype int8x": dict(dtype="int8x"),
    "mode warm": dict(mode="warm"),
    "unknown op": dict(op="broadcast"),
    "shape on an op without one": dict(shape="d7168_e256_k8"),
    "MoE shape not a MoE key": dict(op="dp_to_ep", backend="triton_moe", shape="h8192", bucket=8,
                                    config=moe_row().config),
    "unknown backend": dict(backend="triton_three_shot"),
    # the audit's row: NVFP4 packs blocks of 16 elements, so no call has hidden 40 with it
    "NVFP4 hidden 40": dict(op="all_reduce_rmsnorm", backend="nccl_fused", shape="h40_rms_nvfp4", bucket=8,
                            config="{}"),
    "NVFP4 hidden 8200 with residual": dict(op="all_reduce_rmsnorm", backend="nccl_fused",
                                            shape="h8200_add_rms_nvfp4", bucket=8, config="{}"),
    "epilogue key add_rms (the default is 'h8192')": dict(op="all_reduce_rmsnorm", backend="nccl_fused",
                                                          shape="h8192_add_rms", bucket=8, config="{}"),
    "epilogue key unknown": dict(op="all_reduce_rmsnorm", backend="nccl_fused", shape="h8192_rms_int4", bucket=8,
                                 config="{}"),
    "MoE top-k over experts": dict(op="dp_to_ep", backend="triton_moe", shape="d7168_e8_k16", bucket=8,
                                   config=moe_row().config),
}
MESSAGE = {"all-gather bucket 2**62 B": "Row.bucket=4611686018427387904 bytes is over the largest tensor",
           "all-reduce bucket over 1 TiB": "over the largest tensor a call can have (1099511627776 bytes, 1 TiB)",
           "MoE tokens over 1 TiB": "tokens per rank of 14336 bytes each is over the largest tensor",
           "dtype int8x": "Row.dtype='int8x' is not one of", "mode warm": "Row.mode='warm'",
           "unknown op": "Row.op='broadcast'", "shape on an op without one": "op all_reduce has no shape",
           "MoE shape not a MoE key": "is not a MoE shape key", "unknown backend": "unknown backend 'triton_three_shot'",
           "NVFP4 hidden 40": "Row.shape='h40_rms_nvfp4' at bucket 8: no all_reduce_rmsnorm call has this key "
                              "(all_reduce_rmsnorm: quant='nvfp4' needs hidden % 16 == 0, got hidden=40)",
           "NVFP4 hidden 8200 with residual": "needs hidden % 16 == 0, got hidden=8200",
           "epilogue key add_rms (the default is 'h8192')": "'add_rms' is not an epilogue key",
           "epilogue key unknown": "'rms_int4' is not an epilogue key",
           "MoE top-k over experts": "top-k n_expts_act=16 must be in 1..n_expts_tot=8"}


def unchecked(**changes) -> Row:
    """make_row(**changes) built without Row's checks: what a file written by another tool holds."""
    row = make_row()
    for name, value in changes.items():
        object.__setattr__(row, name, value)
    return row


def file_with(tmp_path, name: str, bad: Row):
    path = tmp_path / name
    with TuningDB(path) as tdb:
        tdb.record_many(GOOD)
        plant(tdb, [bad])
    return path


def bad_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, BadRowWarning)]


@pytest.mark.parametrize("what", sorted(BAD))
def test_the_validator_refuses_the_row_naming_why(what):
    with pytest.raises(ValueError, match=re.escape(MESSAGE[what])):
        checked_row(unchecked(**BAD[what]).to_dict())
    with pytest.raises(ValueError, match=re.escape(MESSAGE[what])):  # and nothing writes it
        TuningDB().record_many([make_row(**BAD[what])])


def test_the_bound_is_the_largest_tensor():
    assert checked_row(make_row(op="all_gather", backend="nccl_all_gather", bucket=MAX_TENSOR_BYTES, config=None))
    tokens = MAX_TENSOR_BYTES // (7168 * 2)  # d_model 7168 in bf16: 14336 bytes a token
    assert checked_row(moe_row(bucket=tokens)).bucket == tokens
    with pytest.raises(ValueError, match="Row.bucket"):
        checked_row(moe_row(bucket=tokens // 2 + 1, dtype="fp32"))  # 4-byte elements: half the tokens fit
    fused = dict(op="all_reduce_rmsnorm", backend="nccl_fused", shape="h8192", config=None)
    assert checked_row(make_row(**fused, bucket=MAX_TENSOR_BYTES // (8192 * 2)))
    with pytest.raises(ValueError, match="Row.bucket"):
        make_row(**fused, bucket=MAX_TENSOR_BYTES // (8192 * 2) + 1)


@pytest.mark.parametrize("what", sorted(BAD))
def test_merge_export_show_and_dispatch_skip_the_same_row(tmp_path, what):
    source = file_with(tmp_path, "source.sqlite", unchecked(**BAD[what]))
    runner = CliRunner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = runner.invoke(main, ["db", "merge", str(source), "--into", str(tmp_path / "merged.sqlite")])
        exported = runner.invoke(main, ["db", "export", str(tmp_path / "out.sqlite"), "--db", str(source)])
        shown = runner.invoke(main, ["show", "--all", "--json", "--db", str(source)])
        (served,) = open_sources(None, [source])
    assert merged.exit_code == 0, merged.output
    assert "2 new" in merged.stdout and "1 bad rows skipped" in merged.stdout
    assert exported.exit_code == 0 and "exported 2 rows" in exported.stdout, exported.output
    assert shown.exit_code == 0, shown.output
    assert sorted(r["backend"] for r in json.loads(shown.stdout)) == ["nccl", "triton_moe"]
    assert set(served._rows) == set(GOOD)
    for out in ("merged.sqlite", "out.sqlite"):
        with TuningDB(tmp_path / out, readonly=True) as tdb:
            assert len(tdb) == 2 and set(tdb.rows()) == set(GOOD)
    said = bad_warnings(caught) + [merged.stderr, exported.stderr, shown.stderr]
    assert any(MESSAGE[what] in text and str(source) in text for text in said), said


def test_every_key_a_call_has_is_valid_and_is_the_key_of_its_problem():
    # each epilogue at a hidden size NVFP4 packs, every op's default points: the row validator
    # takes them, and the op's spec rebuilds the very call (its key is the row's)
    fused = [make_row(op="all_reduce_rmsnorm", backend="nccl_fused", config=None, bucket=8,
                      shape=shape_key(hidden, epilogue), dtype=dtype)
             for epilogue in EPILOGUES for hidden in (16, 4096, 7168) for dtype in ("bf16", "fp16")]
    moe = [moe_row(op=op, shape=shape.key, bucket=tokens) for op in ("dp_to_ep", "ep_to_dp")
           for shape in MODEL_SHAPES.values() for tokens in (1, 4096)]
    for row in fused + moe + GOOD:
        assert checked_row(row) == row
        problem = spec.get(row.op).problem_of_row(row)
        assert Key.for_problem(row.hardware, problem, row.mode) == row.key
    nvfp4 = {row.shape for row in fused if row.shape.endswith("nvfp4")}
    assert nvfp4 == {f"h{h}_{r}rms_nvfp4" for h in (16, 4096, 7168) for r in ("", "add_")}


def test_every_shipped_row_is_the_key_of_a_call():
    (path,) = [p for p in shipped_db_paths() if p.name == "nvidia-h200-nvlink-x2.sqlite"]
    with warnings.catch_warnings(), TuningDB(path, readonly=True) as tdb:
        warnings.simplefilter("error", BadRowWarning)  # not one row skipped
        rows = tdb.rows()
        assert len(rows) == len(tdb) == 908
    for row in rows:
        assert Key.for_problem(row.hardware, spec.get(row.op).problem_of_row(row), row.mode) == row.key


def test_a_source_db_of_another_hardware_keeps_its_rows_valid(tmp_path):
    # the vocabulary is autosymm's words, not this machine's: a row of other hardware is valid
    row = make_row(hardware="nvidia-b200-nvlink", gpu="NVIDIA B200", world_size=8)
    assert checked_row(row) == row and HW != row.hardware

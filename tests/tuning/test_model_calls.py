"""autosymm.tuning.model_calls: the keys a tensor-parallel model calls, from its config.json."""

import json

import pytest

from autosymm.epilogue import DEFAULT, Epilogue
from autosymm.problem import MoEShape
from autosymm.tuning.model_calls import (ModelCalls, ModelShape, default_capture_sizes, model_problems,
                                         parse_capture_sizes, stack_capture_sizes)

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "torch_dtype": "bfloat16", "num_hidden_layers": 32}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "torch_dtype": "bfloat16", "num_experts": 128,
             "num_experts_per_tok": 8}


def test_vllms_default_capture_sizes():
    sizes = default_capture_sizes()
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 51
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    assert default_capture_sizes(max_num_seqs=2) == [1, 2, 4]


def test_a_dense_models_keys_are_its_all_reduce_and_fused_norm_at_each_size():
    shape = ModelShape.from_config(LLAMA_8B)
    assert (shape.hidden, shape.dtype, shape.moe, shape.epilogue) == (4096, "bf16", None, DEFAULT)
    problems = model_problems(shape, 2, [1, 8, 3000])
    assert [(p.op, p.bucket) for p in problems] == [
        ("all_reduce", 4096 * 2), ("all_reduce", 8 * 4096 * 2), ("all_reduce", 3000 * 4096 * 2),
        ("all_reduce_rmsnorm", 1), ("all_reduce_rmsnorm", 8), ("all_reduce_rmsnorm", 3000)]
    assert {p.shape_key for p in problems if p.op == "all_reduce_rmsnorm"} == {"h4096"}
    assert all(p.world_size == 2 for p in problems)


def test_sequence_parallelism_and_moe_add_their_ops():
    shape = ModelShape.from_config(QWEN3_MOE)
    assert shape.moe == MoEShape(2048, 128, 8)
    problems = model_problems(shape, 4, [16], sequence_parallel=True)
    assert [p.op for p in problems] == ["dp_to_ep", "ep_to_dp", "reduce_scatter", "all_gather"]
    assert {p.shape_key for p in problems if p.op in ("dp_to_ep", "ep_to_dp")} == {"d2048_e128_k8"}


@pytest.mark.parametrize("config, epilogue", [
    ({**LLAMA_8B, "model_type": "gemma2"}, Epilogue(gemma=True)),
    ({**LLAMA_8B, "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
     Epilogue(quant="fp8")),
    ({**LLAMA_8B, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, DEFAULT),
    ({**LLAMA_8B, "quantization_config": {"quant_method": "modelopt_fp4"}}, Epilogue(quant="nvfp4")),
    ({"text_config": {**LLAMA_8B}}, DEFAULT),
])
def test_the_checkpoint_decides_the_fused_epilogue(config, epilogue):
    shape = ModelShape.from_config(config)
    assert shape.epilogue == epilogue
    fused = [p for p in model_problems(shape, 2, [4]) if p.op == "all_reduce_rmsnorm"]
    assert fused[0].epilogue == epilogue


def test_a_model_folder_and_bad_configs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    assert ModelShape.from_file(tmp_path).hidden == 4096
    with pytest.raises(ValueError, match="no hidden size"):
        ModelShape.from_config({"torch_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="dtype 'float64'"):
        ModelShape.from_config({**LLAMA_8B, "torch_dtype": "float64"})
    with pytest.raises(ValueError, match="cannot read the model config"):
        ModelShape.from_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="tp=1"):
        model_problems(ModelShape.from_config(LLAMA_8B), 1, [1])


def test_capture_sizes_a_list_or_the_stacks_own_in_a_range():
    assert parse_capture_sizes("8,1,3000,8") == [1, 8, 3000]
    assert parse_capture_sizes("1:512") == default_capture_sizes() == stack_capture_sizes(1, 512)
    assert parse_capture_sizes("250:300") == [256, 272, 288] and stack_capture_sizes(3, 9) == [4, 8]
    assert parse_capture_sizes("1:1024")[-3:] == [992, 1008, 1024]
    for bad in ("", "0", "a", "8:4", "0:4", "1:2:3", ","):
        with pytest.raises(ValueError, match="token"):
            parse_capture_sizes(bad)


def test_model_calls_are_keyed_at_the_tp_they_run_at():
    calls = ModelCalls(ModelShape.from_config(QWEN3_MOE, "qwen3-moe"), 4, (1, 16), sequence_parallel=True)
    assert calls.problems(4) == model_problems(calls.shape, 4, [1, 16], sequence_parallel=True)
    assert calls.describe() == ("qwen3-moe (hidden 2048, bf16, MoE d2048_e128_k8) at TP 4, sequence parallel, "
                                "2 token count(s) 1..16")
    with pytest.raises(ValueError, match="runs at TP 4: its keys are for 4 ranks, not 2"):
        calls.problems(2)

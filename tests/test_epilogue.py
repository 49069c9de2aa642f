"""autosymm.epilogue: the record, its DB keys and the reference formula on hand-computed values
(e2m1 / e4m3 rounding edges, saturation, zero blocks, negative zero, the swizzled scale layout)."""

import pytest
import torch

from autosymm.epilogue import (DEFAULT, FP8_MIN_SCALING_FACTOR, QUANTS, Epilogue, e2m1_codes, nvfp4_quantize,
                               nvfp4_scale_offsets, quantize, reference)

E4M3 = torch.float8_e4m3fn
ALL = [Epilogue(r, g, q) for r in (True, False) for g in (False, True) for q in (None,) + QUANTS]


def test_the_default_key_is_empty_and_every_key_reads_back():
    assert DEFAULT.key == "" and Epilogue.of_key("") == DEFAULT
    keys = {e.key for e in ALL}
    assert len(keys) == len(ALL)
    assert {Epilogue(residual=False).key, Epilogue(gemma=True).key, Epilogue(quant="fp8").key,
            Epilogue(residual=False, quant="nvfp4").key} == {"rms", "add_gemma", "add_rms_fp8", "rms_nvfp4"}
    for e in ALL:
        assert Epilogue.of_key(e.key) == e


@pytest.mark.parametrize("key", ["add_rms", "rms_int4", "fp8", "add_rms_", "h8192"])
def test_other_keys_are_refused(key):
    with pytest.raises(ValueError, match="epilogue key"):
        Epilogue.of_key(key)


def test_an_unknown_quant_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"quant='mxfp4'.*fp8_per_token"):
        Epilogue(quant="mxfp4")


def test_output_specs():
    assert Epilogue(quant="nvfp4").scales_shape(5, 2048) == (128, 128)
    assert Epilogue(quant="nvfp4").scales_shape(130, 5120) == (256, 320)  # 320 blocks: a multiple of 4
    assert Epilogue(quant="nvfp4").scales_shape(1, 16) == (128, 4)
    assert Epilogue(quant="fp8_per_token").scales_shape(7, 4096) == (7, 1)
    assert DEFAULT.scales_shape(7, 4096) is None and Epilogue(quant="fp8").scales_shape(7, 64) is None
    out, scales = Epilogue(quant="nvfp4").empty_outputs(3, 64, torch.bfloat16, "cpu")
    assert out.shape == (3, 32) and out.dtype == torch.uint8
    assert scales.dtype == E4M3 and int(scales.view(torch.uint8).count_nonzero()) == 0
    assert DEFAULT.out_dtype(torch.float16) == torch.float16 and Epilogue(quant="fp8").out_dtype(torch.bfloat16) == E4M3


def test_e2m1_rounds_to_nearest_even_and_saturates():
    values = [0.0, 0.25, 0.2501, 0.5, 0.75, 1.0, 1.25, 1.2501, 1.5, 1.75, 2.0, 2.5, 2.5001, 3.0, 3.5, 4.0, 5.0, 5.0001,
              6.0, 7.0, 1e30, float("inf")]
    codes = [0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 5, 5, 6, 6, 6, 7, 7, 7, 7, 7]
    assert e2m1_codes(torch.tensor(values)).tolist() == codes
    assert e2m1_codes(-torch.tensor(values)).tolist() == [c | 8 for c in codes]  # -0.0 too


def test_e2m1_negatives_that_round_to_zero_keep_the_sign():
    assert e2m1_codes(torch.tensor([-0.0, -0.1, -0.25, 0.1])).tolist() == [8, 8, 8, 0]


def test_the_plain_formula_on_hand_values():
    # s = [2, 2, 2, 2]: sum(s^2) / 4 = 4, rsqrt(4) = 0.5, so y = weight exactly (eps 0).
    total = torch.tensor([[1.0, 1.5, 2.5, 0.0]])
    residual = torch.tensor([[1.0, 0.5, -0.5, 2.0]], dtype=torch.bfloat16)
    weight = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.bfloat16)
    out, new_residual, scales = reference(total, residual, weight, 0.0)
    assert new_residual.tolist() == [[2.0, 2.0, 2.0, 2.0]] and new_residual.dtype == torch.bfloat16
    assert out.tolist() == [[1.0, -2.0, 3.0, 0.5]] and scales is None
    out, _, _ = reference(total, residual, weight, 0.0, Epilogue(gemma=True))
    assert out.tolist() == [[2.0, -1.0, 4.0, 1.5]]
    # no residual: s = [1, 1.5, 2.5, 0], sum(s^2) / 4 = 2.375
    out, new_residual, _ = reference(total, None, weight, 0.0, Epilogue(residual=False))
    assert new_residual is None
    want = (total * torch.rsqrt(torch.tensor(2.375)) * weight.float()).bfloat16()
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="residual is None"):
        reference(total, None, weight, 0.0)


def test_fp8_multiplies_by_the_reciprocal_clamps_and_rounds_to_nearest_even():
    y = torch.tensor([[1.0625, 1.1875, 1.0626, 500.0, -1e6, -0.0, 3 * 2.0**-11, 1.5 * 2.0**-9]])
    out, scales = quantize(y, Epilogue(quant="fp8"), torch.bfloat16, torch.tensor(1.0))
    assert scales is None and out.dtype == E4M3
    assert out.float().tolist() == [[1.0, 1.25, 1.125, 448.0, -448.0, -0.0, 2.0**-9, 2.0**-8]]
    assert out.view(torch.uint8)[0, 5] == 0x80  # negative zero
    # y * fp32(1 / 1.3) rounds to 11 in e4m3 where y / 1.3 rounds to 12: the reciprocal is what vLLM multiplies by
    y = torch.tensor([[float.fromhex("0x1.de6664p+3")]])
    out, _ = quantize(y, Epilogue(quant="fp8"), torch.bfloat16, torch.tensor([1.3]))
    assert out.float().tolist() == [[11.0]] and (y / 1.3).to(E4M3).float().item() == 12.0
    with pytest.raises(ValueError, match="needs a float32 scale"):
        quantize(y, Epilogue(quant="fp8"), torch.bfloat16)


def test_fp8_per_token_scales_rows_by_their_amax_with_vllms_floor():
    y = torch.tensor([[896.0, -448.0, 2.0, 0.0], [0.0, 0.0, -0.0, 0.0], [1e-6, 0.0, 0.0, 0.0],
                      [float.fromhex("0x1.2c2666p+9"), float.fromhex("0x1.c2399ap+8"), 0.0, 0.0]])
    out, scales = quantize(y, Epilogue(quant="fp8_per_token"), torch.bfloat16)
    assert scales.shape == (4, 1) and scales.dtype == torch.float32
    assert scales[:3, 0].tolist() == [2.0, FP8_MIN_SCALING_FACTOR, FP8_MIN_SCALING_FACTOR]
    assert FP8_MIN_SCALING_FACTOR == pytest.approx(1 / (448 * 512), rel=1e-7)
    assert out.float()[0].tolist() == [448.0, -224.0, 1.0, 0.0]
    assert int(out.view(torch.uint8)[1].count_nonzero()) == 1  # only the -0.0
    assert out.float()[2, 0] == 0.234375  # 1e-6 / floor = 0.2294 -> 15 * 2^-6
    # a true division by the row scale: 320 (multiplying by its fp32 reciprocal gives 352)
    assert out.float()[3, 1] == 320.0 and (y[3, 1] * (1.0 / scales[3, 0])).to(E4M3).float() == 352.0


def _block(values):
    return torch.tensor(values + [0.0] * (16 - len(values)))


def test_nvfp4_block_scales_and_packing_on_hand_values():
    # block 0: amax 6 with gs 2 -> sf = 2 * (6 * fp32(1/6)) = 2, output scale 1 / (2 * 0.5) = 1 (ties
    # to even); block 1: all zero (sf 0, output scale 0; -0.0 keeps its sign); block 2: amax 12 -> sf 4,
    # scale 0.5; block 3: amax 7 -> sf 2.333 -> e4m3 2.25, scale 0.889: 7 -> 6.22 saturates at 6.
    y = torch.cat([_block([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0, 0.25, 0.75, 5.0, 1.25, 1.75, 2.5]),
                   _block([-0.0]), _block([12.0, -1.0, 2.5, 7.0]), _block([7.0, -7.0])])[None]
    packed, scales = nvfp4_quantize(y, torch.tensor(2.0))
    assert packed.shape == (1, 32) and scales.shape == (128, 4)
    codes = ([0, 1, 2, 3, 4, 5, 6, 7, 9, 15, 0, 2, 6, 2, 4, 4] + [8] + [0] * 15 + [7, 9, 2, 6] + [0] * 12
             + [7, 15] + [0] * 14)
    want = [codes[i] | (codes[i + 1] << 4) for i in range(0, 64, 2)]
    assert packed[0].tolist() == want
    assert scales[0].float().tolist() == [2.0, 0.0, 4.0, 2.25]
    assert int(scales.view(torch.uint8).count_nonzero()) == 3, "padding and the zero block's scale are 0"


def test_nvfp4_block_scales_round_to_e4m3_and_saturate():
    # amax 6: sf = gs * 1; gs 1.0625 -> e4m3 tie between 1.0 and 1.125 -> 1.0; gs 500 -> 448
    for gs, sf in ((1.0625, 1.0), (1.1875, 1.25), (500.0, 448.0)):
        _, scales = nvfp4_quantize(_block([6.0])[None], torch.tensor(gs))
        assert scales[0, 0].float() == sf


def test_nvfp4_needs_whole_blocks():
    with pytest.raises(ValueError, match="hidden=40"):
        nvfp4_quantize(torch.zeros(2, 40), torch.tensor(1.0))


@pytest.mark.parametrize("row, block, n_blocks, offset", [
    (0, 0, 4, 0), (1, 0, 4, 16), (31, 0, 4, 496), (32, 0, 4, 4), (97, 3, 4, 16 + 12 + 3),
    (0, 4, 8, 512), (33, 5, 8, 512 + 16 + 4 + 1), (128, 0, 8, 1024), (130, 6, 8, 1024 + 512 + 32 + 2),
    (300, 321, 328, (2 * 82 + 80) * 512 + 12 * 16 + 1 * 4 + 1),
])
def test_swizzle_offsets_follow_vllms_formula(row, block, n_blocks, offset):
    """vLLM: (m // 128 * k_tiles + k // 4) << 9 | (m % 32) << 4 | (m // 32 % 4) << 2 | k % 4,
    k_tiles = ceil(n_blocks / 4) (nvfp4_utils.cuh, cvt_quant_to_fp4_get_sf_out_offset)."""
    assert int(nvfp4_scale_offsets(torch.tensor(row), torch.tensor(block), n_blocks)) == offset


def test_nvfp4_scales_land_at_their_swizzled_offsets():
    tokens, hidden = 130, 8 * 16
    y = torch.zeros(tokens, hidden)
    for row, block in ((0, 0), (33, 5), (129, 7), (64, 2)):
        y[row, block * 16] = 6.0 * (1 + block)  # sf = block + 1 with gs 1
    _, scales = nvfp4_quantize(y, torch.tensor(1.0))
    flat = scales.view(torch.uint8).view(-1)
    for row, block in ((0, 0), (33, 5), (129, 7), (64, 2)):
        at = int(nvfp4_scale_offsets(torch.tensor(row), torch.tensor(block), 8))
        assert flat.view(E4M3)[at].float() == 1 + block
    assert int(flat.count_nonzero()) == 4

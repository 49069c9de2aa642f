"""The fused all-reduce + RMSNorm kernels' epilogue (Triton, device side only): weight, output
quantization and the stores of a normalised [ROWS, BLOCK] fp32 tile, as compile-time variants
(autosymm.epilogue states the formula; its QUANT_CODES are the QUANT constexpr here).

Rounding is done in arithmetic, so the interpreter and the GPU give the formula's bits: an e4m3
value is rounded to nearest even onto the e4m3 grid by one fp32 add of a magic number (the add's
own round-to-nearest-even at the grid's spacing) before the cast to float8e4nv (a ``cvt.rn``
that is then exact; the interpreter's cast rounds ties away and truncates subnormals). e2m1 (no
``cvt`` on sm_90) is a code from comparisons with the midpoints between its values, ties to the
even code. Quotients are ``div_rn`` (IEEE), as torch's."""

import triton
import triton.language as tl

from ..epilogue import E2M1_MAX_RECIPROCAL, FP8_E4M3_MAX, FP8_MIN_SCALING_FACTOR, NVFP4_BLOCK

E4M3_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)
MIN_SCALE: tl.constexpr = tl.constexpr(FP8_MIN_SCALING_FACTOR)
RCP_E2M1_MAX: tl.constexpr = tl.constexpr(E2M1_MAX_RECIPROCAL)
SF_BLOCK: tl.constexpr = tl.constexpr(NVFP4_BLOCK)


@triton.jit
def _tile(row0, row_end, col0, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """(element offsets [ROWS, BLOCK], mask, columns [BLOCK]) of columns col0 .. col0 + BLOCK - 1
    (a multiple of BLOCK, < HIDDEN) of rows row0 .. row0 + ROWS - 1 (rows >= row_end and columns
    >= HIDDEN masked)."""
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, BLOCK)
    offs = rows[:, None] * HIDDEN + cols[None, :]
    if HIDDEN % BLOCK == 0:  # whole column blocks, row-constant mask: 128-bit accesses stay possible
        mask = tl.broadcast_to((rows < row_end)[:, None], (ROWS, BLOCK))
    else:
        mask = (rows < row_end)[:, None] & (cols < HIDDEN)[None, :]
    return offs, mask, cols


@triton.jit
def _weight(w_ptr, cols, HIDDEN: tl.constexpr, GEMMA: tl.constexpr):
    """fp32 weight of ``cols`` (0 past HIDDEN), ``1 + w`` for the Gemma norm."""
    w = tl.load(w_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    return w


@triton.jit
def _e4m3(v):
    """float8e4nv of fp32 ``v`` (|v| <= 448, finite), rounded to nearest even (sign kept)."""
    bits = v.to(tl.int32, bitcast=True)
    magnitude = tl.abs(v)
    # e4m3's spacing at the exponent e of |v| (e >= -6: below it the subnormals' 2^-9) is
    # 2^(e-3); adding 1.5 * 2^(e+20) leaves that spacing as the sum's ulp.
    exponent = tl.maximum(magnitude.to(tl.int32, bitcast=True) >> 23, 127 - 6)
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return tl.where(bits < 0, -rounded, rounded).to(tl.float8e4nv)


@triton.jit
def _e2m1_codes(v):
    """int32 e2m1 codes (sign in bit 3) of fp32 ``v``: round to nearest even, saturating at 6."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return code | tl.where(v.to(tl.int32, bitcast=True) < 0, 8, 0)


@triton.jit
def _quantize(y, scale_ptr, BLOCK: tl.constexpr, ROWS: tl.constexpr, QUANT: tl.constexpr):
    """(values, scales) of the fp32 norm output ``y`` [ROWS, BLOCK]: QUANT 0 (y, 0), 1 fp8 static
    (e4m3 [ROWS, BLOCK], 0), 2 fp8 per token (e4m3, fp32 row scales [ROWS]), 3 nvfp4 (packed
    uint8 [ROWS, BLOCK / 2], e4m3 block scales [ROWS, BLOCK / 16])."""
    if QUANT == 1:
        inverse = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
        values = _e4m3(tl.minimum(tl.maximum(y * inverse, -E4M3_MAX), E4M3_MAX))
        scales = 0
    elif QUANT == 2:
        amax = tl.max(tl.abs(y), axis=1)
        scales = tl.maximum(tl.math.div_rn(amax, E4M3_MAX), MIN_SCALE)
        values = _e4m3(tl.minimum(tl.maximum(tl.math.div_rn(y, scales[:, None]), -E4M3_MAX), E4M3_MAX))
    elif QUANT == 3:
        global_scale = tl.load(scale_ptr).to(tl.float32)
        blocks = tl.reshape(y, (ROWS, BLOCK // SF_BLOCK, SF_BLOCK))
        amax = tl.max(tl.abs(blocks), axis=2)
        scales = _e4m3(tl.minimum(global_scale * (amax * RCP_E2M1_MAX), E4M3_MAX))
        sf = scales.to(tl.float32)
        nonzero = tl.where(sf != 0, sf, 1.0)  # a zero block's values are 0 whatever the scale: 0, not 1 / 0
        output_scale = tl.where(sf != 0, tl.math.div_rn(1.0, nonzero * tl.math.div_rn(1.0, global_scale)), 0.0)
        codes = tl.reshape(_e2m1_codes(blocks * output_scale[:, :, None]), (ROWS, BLOCK // 2, 2))
        even, odd = tl.split(codes)
        values = (even | (odd << 4)).to(tl.uint8)
    else:
        values = y
        scales = 0
    return values, scales


@triton.jit
def _store_block_scales(dst, scales, row0, row_end, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr, SWIZZLE: tl.constexpr):
    """Store nvfp4 block scales [ROWS, BLOCK / 16] of rows row0.. (< row_end): row-major
    [rows, HIDDEN / 16], or (SWIZZLE) in vLLM's 128x4 tiles (autosymm.epilogue.nvfp4_scale_offsets)."""
    N_BLOCKS: tl.constexpr = HIDDEN // SF_BLOCK
    offs, mask, blocks = _tile(row0, row_end, 0, N_BLOCKS, BLOCK // SF_BLOCK, ROWS)
    if SWIZZLE:
        K_TILES: tl.constexpr = (N_BLOCKS + 3) // 4
        rows = (row0 + tl.arange(0, ROWS))[:, None]
        cols = blocks[None, :]
        offs = ((rows // 128) * K_TILES + cols // 4) * 512 + (rows % 32) * 16 + (rows // 32 % 4) * 4 + cols % 4
    tl.store(dst + offs, scales, mask=mask)


@triton.jit
def _store_outputs(values, scales, out_ptr, scales_ptr, row0, row_end, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
                   ROWS: tl.constexpr, QUANT: tl.constexpr, SWIZZLE: tl.constexpr):
    """Store :func:`_quantize`'s results of rows row0.. (< row_end) at ``out_ptr`` (rows of HIDDEN
    elements, nvfp4: HIDDEN / 2 bytes) and ``scales_ptr`` (per token: one fp32 a row; nvfp4: see
    :func:`_store_block_scales`)."""
    if QUANT == 3:
        offs, mask, _ = _tile(row0, row_end, 0, HIDDEN // 2, BLOCK // 2, ROWS)
        tl.store(out_ptr + offs, values, mask=mask)
        _store_block_scales(scales_ptr, scales, row0, row_end, HIDDEN, BLOCK, ROWS, SWIZZLE)
    else:
        offs, mask, _ = _tile(row0, row_end, 0, HIDDEN, BLOCK, ROWS)
        tl.store(out_ptr + offs, values.to(out_ptr.dtype.element_ty), mask=mask)
        if QUANT == 2:
            rows = row0 + tl.arange(0, ROWS)
            tl.store(scales_ptr + rows, scales, mask=rows < row_end)


@triton.jit
def _normalise_and_store(s, inv_rms, w_ptr, out_ptr, scale_ptr, scales_ptr, row0, row_end, HIDDEN: tl.constexpr,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr, GEMMA: tl.constexpr, QUANT: tl.constexpr):
    """out (and scales) of rows row0.. of the unrounded fp32 sums ``s`` [ROWS, BLOCK] and their
    inverse RMS [ROWS]: y = s * inv_rms * w, then :func:`_quantize`; returns its (values, scales)."""
    cols = tl.arange(0, BLOCK)
    y = s * inv_rms[:, None] * _weight(w_ptr, cols, HIDDEN, GEMMA)[None, :]
    values, scales = _quantize(y, scale_ptr, BLOCK, ROWS, QUANT)
    _store_outputs(values, scales, out_ptr, scales_ptr, row0, row_end, HIDDEN, BLOCK, ROWS, QUANT, True)
    return values, scales

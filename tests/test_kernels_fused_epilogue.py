"""The fused kernels' epilogue variants (no residual, Gemma, fp8, fp8 per token, nvfp4) under the
Triton interpreter, bit-equal to autosymm.epilogue's formula applied to the kernels' fp32
in-order sum.

Ranks are simulated one after another as in tests/test_kernels_fused_rmsnorm.py. The expected
bits are the formula's stages (``residual_sum``, ``normalized``, ``quantize``) with two things
taken as the kernel computes them, since the formula leaves them to the implementation: the row's
sum of squares (the interpreter's ``tl.sum`` is numpy's pairwise sum over the row's BLOCK, or the
parts' sums of a split row: reproduced here) and the cast of an fp32 value to bf16 / fp16 (the
interpreter's own cast, which truncates bf16; the GPU's rounds to nearest even, as torch).
Quantized outputs need neither: they are the formula's, bit for bit, with torch's e4m3 cast.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from autosymm.backends.triton_fused import split_scratch
from autosymm.epilogue import Epilogue, normalized, quantize, residual_sum
from autosymm.geometry import align
from autosymm.kernels.fused_rmsnorm import _one_shot_all_reduce_rmsnorm, _two_shot_all_reduce_rmsnorm

from _all_reduce_sim import pads, poisoned_workspaces, preset, requires_interpreter, snapshot_workspace

pytestmark = requires_interpreter

REGION_BYTES = 1 << 20
HALF_BYTES = 1 << 16
STAGE = 768
EPS = 1e-6
SCALE = {"fp8": 0.01, "nvfp4": 300.0}  # fp8: |y| / 0.01 passes 448 (saturation); nvfp4: the global scale
BF16, FP16 = torch.bfloat16, torch.float16


@triton.jit
def _cast(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(dst.dtype.element_ty), mask=offs < n)


def _interpreter_cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(values.shape, dtype=dtype)
    _cast[(triton.cdiv(values.numel(), 4096),)](values.contiguous(), out, values.numel(), BLOCK=4096)
    return out


def _inverse_rms(s: torch.Tensor, block: int, split: int) -> torch.Tensor:
    """The kernel's rsqrt(sum(s^2) / hidden + eps) per row under the interpreter (numpy sums)."""
    rows, hidden = s.shape
    squares = np.zeros((rows, block), np.float32)
    squares[:, :hidden] = (s * s).numpy()
    if split == 1:
        total = np.sum(squares, axis=1)
    else:
        chunk = block // split
        parts = np.zeros((rows, split), np.float32)
        for p in range(-(-hidden // chunk)):
            parts[:, p] = np.sum(squares[:, p * chunk:(p + 1) * chunk], axis=1)
        total = np.sum(parts, axis=1)
    return torch.from_numpy(1 / np.sqrt(total / np.float32(hidden) + np.float32(EPS)))[:, None]


def _expected(xs, residual, weight, epilogue, scale, block, split):
    """(out, new residual or None, scales or None) the kernel must write, bit for bit."""
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        total = total + x.float()
    s = residual_sum(total, residual, epilogue)
    y = normalized(s, _inverse_rms(s, block, split), weight, epilogue)
    if epilogue.quant is None:
        out, scales = _interpreter_cast(y, weight.dtype), None
    else:
        out, scales = quantize(y, epilogue, weight.dtype, scale)
    return out, (_interpreter_cast(s, residual.dtype) if epilogue.residual else None), scales


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class Case:
    """One run: kernel 'pull' | 'push' | 'two_shot', the epilogue, and the launch shape."""

    def __init__(self, kernel, epilogue, world_size, dtype, n_rows, hidden, rows=1, programs=2, split=1,
                 double=False):
        self.kernel, self.epilogue, self.world_size, self.dtype = kernel, epilogue, world_size, dtype
        self.n_rows, self.hidden, self.rows, self.programs, self.split = n_rows, hidden, rows, programs, split
        self.double = double
        self.block = max(128, 1 << (hidden - 1).bit_length())

    def __repr__(self):
        return (f"{self.kernel}{'-double' if self.double else ''}-{self.epilogue.key}-w{self.world_size}-"
                f"{str(self.dtype)[6:]}-{self.n_rows}x{self.hidden}-rows{self.rows}-split{self.split}")


def _inputs(case, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (case.n_rows, case.hidden)
    xs = [torch.randn(shape, generator=gen).to(case.dtype) for _ in range(case.world_size)]
    residual = torch.randn(shape, generator=gen).to(case.dtype)
    weight = (0.5 * torch.randn(case.hidden, generator=gen)).to(case.dtype)
    return xs, residual, weight


def _rank_tensors(case, xs, residual):
    """Per rank: [x, residual copy (or x), out, scale, scales] (outputs poisoned: 0xFF bytes)."""
    epilogue, runs = case.epilogue, []
    scale = torch.tensor([SCALE.get(epilogue.quant, 1.0)], dtype=torch.float32)
    for x in xs:
        out, scales = epilogue.empty_outputs(case.n_rows, case.hidden, case.dtype, "cpu")
        out.view(torch.uint8).fill_(0xFF)
        if epilogue.quant == "fp8_per_token":
            scales.fill_(float("nan"))
        runs.append([x.clone(), residual.clone() if epilogue.residual else None, out, scale,
                     out if scales is None else scales])
    return runs


def _epilogue_constexprs(epilogue):
    return dict(HAS_RESIDUAL=epilogue.residual, GEMMA=epilogue.gemma, QUANT=epilogue.quant_code)


def _launch_one_shot(case, ws, run, weight, push, offset, slot_bytes):
    x, res, out, scale, scales = run
    _one_shot_all_reduce_rmsnorm[(case.programs,)](
        x, x if res is None else res, weight, out, scale, scales, ws.region_ptrs("all_reduce"),
        ws.signal_ptrs("all_reduce"), *split_scratch(ws), split_scratch(ws)[0], case.n_rows, EPS, offset, slot_bytes, HALF_BYTES,
        RANK=ws.rank, WORLD_SIZE=case.world_size, HIDDEN=case.hidden, BLOCK=case.block, ROWS=case.rows,
        SPLIT=case.split, PUSH=push, DOUBLE_BUFFER=case.double, num_warps=4, **_epilogue_constexprs(case.epilogue))


def _stage_base(ws, case):
    from autosymm.geometry import DOUBLE_BUFFER_REGION

    if case.double:
        return ws.regions[DOUBLE_BUFFER_REGION].offset - ws.regions["all_reduce"].offset
    return STAGE


def _run_pull(case, xs, runs, weight):
    wss = poisoned_workspaces(case.world_size, REGION_BYTES, HALF_BYTES)
    for ws, x in zip(wss, xs):  # peers' copy-in, ahead of their turn
        ws.buffer[ws.regions["all_reduce"].offset + _stage_base(ws, case):][:x.numel() * x.element_size()].view(
            case.dtype).copy_(x.reshape(-1))
    want = preset([ws.buffer for ws in wss], case.programs, 1 if case.double else 2)
    for ws, run in zip(wss, runs):
        _launch_one_shot(case, ws, run, weight, False, _stage_base(ws, case), 0)
        assert int(split_scratch(ws)[0].count_nonzero()) == 0, "every row's arrival counter is 0 again"
    if not case.double:
        for ws, pad in zip(wss, want):
            assert torch.equal(pads(ws.buffer), pad)


def _run_push(case, xs, runs, weight):
    wss = poisoned_workspaces(case.world_size, REGION_BYTES, HALF_BYTES)
    slot_bytes = align(xs[0].numel() * xs[0].element_size())
    for ws in wss:  # what the peers would push into this rank's stage
        for q in range(case.world_size):
            if q != ws.rank:
                start = (ws.regions["all_reduce"].offset + _stage_base(ws, case)
                         + (q - ws.rank - 1) % case.world_size * slot_bytes)
                ws.buffer[start:start + slot_bytes][:xs[q].numel() * xs[q].element_size()].view(case.dtype).copy_(
                    xs[q].reshape(-1))
    preset([ws.buffer for ws in wss], case.programs, 1 if case.double else 2, all_peers=True)
    for rank, run in enumerate(runs):
        _launch_one_shot(case, snapshot_workspace(wss, rank), run, weight, True, _stage_base(wss[rank], case),
                         slot_bytes)


def _run_two_shot(case, xs, runs, weight):
    wss = poisoned_workspaces(case.world_size, REGION_BYTES, HALF_BYTES)
    out_offset = STAGE + align(xs[0].numel() * xs[0].element_size())
    want = preset([ws.buffer for ws in wss], case.programs, 3)
    for phase in (1, 2, 3):
        for ws, (x, res, out, scale, scales) in zip(wss, runs):
            _two_shot_all_reduce_rmsnorm[(case.programs,)](
                x, x if res is None else res, weight, out, scale, scales, ws.region_ptrs("all_reduce"),
                ws.signal_ptrs("all_reduce"), case.n_rows, EPS, STAGE, out_offset, RANK=ws.rank,
                WORLD_SIZE=case.world_size, HIDDEN=case.hidden, BLOCK=case.block, ROWS=case.rows, PHASE=phase,
                num_warps=4, **_epilogue_constexprs(case.epilogue))
    for ws, pad in zip(wss, want):
        assert torch.equal(pads(ws.buffer), pad)


RUNNERS = {"pull": _run_pull, "push": _run_push, "two_shot": _run_two_shot}


def _check(case, seed=0):
    xs, residual, weight = _inputs(case, seed)
    runs = _rank_tensors(case, xs, residual)
    RUNNERS[case.kernel](case, xs, runs, weight)
    scale = runs[0][3]
    out, new_residual, scales = _expected(xs, residual, weight, case.epilogue, scale, case.block, case.split)
    for rank, (x, res, got_out, _, got_scales) in enumerate(runs):
        assert torch.equal(x, xs[rank]), "x is left unchanged"
        assert torch.equal(_bits(got_out), _bits(out)), f"rank {rank}: out differs at " \
            f"{(_bits(got_out) != _bits(out)).nonzero()[:4].tolist()}"
        if new_residual is not None:
            assert torch.equal(_bits(res), _bits(new_residual)), f"rank {rank}: residual"
        if scales is not None:
            assert torch.equal(_bits(got_scales), _bits(scales)), f"rank {rank}: scales differ at " \
                f"{(_bits(got_scales) != _bits(scales)).nonzero()[:4].tolist()}"


NO_ADD = Epilogue(residual=False)
GEMMA = Epilogue(gemma=True)
NO_ADD_GEMMA = Epilogue(residual=False, gemma=True)
FP8 = Epilogue(quant="fp8")
FP8_TOKEN = Epilogue(quant="fp8_per_token")
NVFP4 = Epilogue(quant="nvfp4")

# Each variant at W = 2, 3, 4, 8 across the kernels; every hidden size of the issue (2048..8192,
# 5120, 7168: BLOCK 8192 masks columns) at least once; odd token counts; bf16 and fp16 (and fp32).
CASES = [
    Case("pull", NO_ADD, 2, BF16, 3, 2048, rows=2),
    Case("two_shot", NO_ADD, 3, FP16, 5, 5120),
    Case("push", NO_ADD_GEMMA, 4, BF16, 3, 4096),
    Case("pull", GEMMA, 8, FP16, 1, 7168, programs=1),
    Case("pull", FP8, 2, BF16, 5, 8192, rows=2),
    Case("push", FP8, 3, FP16, 3, 2048, double=True),
    Case("two_shot", Epilogue(residual=False, gemma=True, quant="fp8"), 4, BF16, 9, 2048, rows=2),
    Case("pull", FP8, 8, BF16, 1, 5120, split=8, programs=5),
    Case("pull", FP8_TOKEN, 2, FP16, 7, 4096, rows=4),
    Case("two_shot", FP8_TOKEN, 3, BF16, 7, 7168),
    Case("push", Epilogue(residual=False, quant="fp8_per_token"), 8, FP16, 1, 2048, split=4, programs=4),
    Case("pull", FP8_TOKEN, 4, BF16, 3, 8192, split=4, programs=3, double=True),
    Case("two_shot", FP8, 3, torch.float32, 5, 2048),  # fp32 x: rows of 4-byte elements, fp8 rows of 1
    Case("pull", NVFP4, 2, BF16, 5, 2048, rows=2),
    Case("two_shot", NVFP4, 8, FP16, 9, 2048),
    Case("push", Epilogue(residual=False, gemma=True, quant="nvfp4"), 3, BF16, 3, 5120),
    Case("pull", NVFP4, 4, FP16, 3, 7168, split=8, programs=4),
    Case("two_shot", NVFP4, 2, BF16, 7, 8192, rows=4),
    # past 128 rows and 4 blocks: every term of the swizzled scale offset (20 blocks: 5 column tiles)
    Case("two_shot", NVFP4, 2, FP16, 131, 320, rows=4, programs=8),
]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_epilogue_variant_is_bit_equal_to_the_formula(case):
    _check(case)

"""Every kernel family at world sizes 2, 4 and 8 on ONE GPU: ranks emulated as concurrent
launches of one process (tests/gpu/_emulated.py), so kernel changes are checked on real
hardware whenever any GPU is lent.

Families: the all-reduces (pull one-shot staged, zero-copy and double-buffered; push one-shot,
single and double-buffered; two-shot staged and zero-copy; the Lamport one-shot; and the floor
bench's small-message configs: one program, and one chunk a program over many), the fused
all-reduce + RMSNorm (pull one-shot, double-buffered, push, two-shot by rows, split rows, the
Lamport exchange; and each epilogue variant: no residual, Gemma, fp8, fp8 per token, nvfp4, on
the Lamport exchange too), the MoE dp->ep and ep->dp
conversions (fused and separate end barrier), the stream-ordered barrier, and, where their kernels
are on the branch, the reduce-scatter and all-gather (push, pull; even and ragged). Three rounds each
(the double buffer's halves alternate; the pads must balance). Sums are compared bit-exactly
with the fp32 in-order sum, MoE buffers bit-exactly (poisoned rows included) with the CPU
reference, the fused output within one ulp of its exact RMSNorm and bit-identical on every rank.
"""

from __future__ import annotations

import pytest
import torch

from ._dist import requires_cuda
from ._emulated import WORLD_SIZES, assert_bits, bits, fp32_sum, random, run_ranks, workspaces

pytestmark = [requires_cuda, pytest.mark.gpu]

ROUNDS = 3
BF16 = torch.bfloat16
EPS = 1e-6


def _all_reduce_case(world_size, algorithm, numel, dtype, *, double_buffer=False, zero_copy=False, block=1024,
                     grid=4, warps=4):
    """(workspaces, launch, check) of one all-reduce algorithm: every rank reduces its input of
    each round (a fresh random tensor per rank and round) and keeps a copy of the result."""
    from autosymm.backends.triton_all_reduce import _AllReduceLauncher
    from autosymm.configs import AllReduceConfig
    from autosymm.problem import Problem, dtype_name

    wss = workspaces(world_size)
    config = AllReduceConfig(algorithm, block, grid, warps, double_buffer=double_buffer)
    problem = Problem.all_reduce(numel * torch.empty((), dtype=dtype).element_size(), dtype_name(dtype), world_size)
    launchers = [_AllReduceLauncher(problem, config, ws) for ws in wss]
    xs = [ws.empty((numel,), dtype) if zero_copy else torch.empty(numel, dtype=dtype, device="cuda") for ws in wss]
    inputs = [[random(numel, dtype, seed=100 * k + r) for r in range(world_size)] for k in range(ROUNDS)]
    results = [[torch.empty(numel, dtype=dtype, device="cuda") for _ in range(ROUNDS)] for _ in range(world_size)]

    def launch(rank, round_):
        xs[rank].copy_(inputs[round_][rank])
        launchers[rank](xs[rank])
        results[rank][round_].copy_(xs[rank])

    def check():
        for round_ in range(ROUNDS):
            want = fp32_sum(inputs[round_])
            for rank in range(world_size):
                assert_bits(results[rank][round_], want, f"{algorithm} rank {rank} round {round_}")

    return wss, launch, check


ALL_REDUCE = [  # (algorithm, double_buffer, zero_copy, numel): odd sizes for the tails
    ("one_shot", False, False, 40_003),
    ("one_shot", False, True, 40_000),
    ("one_shot", True, False, 40_003),
    ("one_shot_push", False, False, 40_003),
    ("one_shot_push", True, False, 12_345),
    ("two_shot", False, False, 40_003),
    ("two_shot", False, True, 40_000),
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", ALL_REDUCE, ids=lambda c: f"{c[0]}{'-double' if c[1] else ''}"
                         f"{'-zero_copy' if c[2] else ''}-{c[3]}")
def test_all_reduce_emulated(world_size, case):
    algorithm, double_buffer, zero_copy, numel = case
    wss, launch, check = _all_reduce_case(world_size, algorithm, numel, BF16, double_buffer=double_buffer,
                                          zero_copy=zero_copy)
    run_ranks(wss, launch, ROUNDS)
    check()


#: The small-message configs the floor bench times (scripts/bench_emulated_floor.py): one program
#: (the epoch / rotation published with no wait), one chunk a program over many programs (the
#: grid's last one waits for the others' counts), at 8 KiB and 64 KiB of bf16.
SMALL = [  # (algorithm, double_buffer, numel, block, grid, warps)
    ("one_shot_push", True, 4096, 4096, 1, 16),
    ("one_shot_push", True, 32768, 1024, 32, 4),
    ("one_shot", True, 4096, 1024, 4, 4),
    ("one_shot", False, 32768, 4096, 8, 16),
    ("two_shot", False, 4096, 1024, 2, 4),
    ("lamport", False, 4096, 4096, 1, 16),
    ("lamport", False, 32768, 1024, 32, 4),
]


def _lamport_case(world_size, numel, block, grid, warps, spin=False):
    """(workspaces, launch, check) of the Lamport one-shot (its own launcher: the Lamport region);
    ``spin``: the config's per-thread spin (world size 2)."""
    from autosymm.backends.triton_lamport import _LamportLauncher
    from autosymm.configs import AllReduceConfig
    from autosymm.problem import Problem

    wss = workspaces(world_size)
    problem = Problem.all_reduce(2 * numel, "bf16", world_size)
    config = AllReduceConfig("lamport", block, grid, warps, spin=spin)
    launchers = [_LamportLauncher(problem, config, ws) for ws in wss]
    xs = [torch.empty(numel, dtype=BF16, device="cuda") for _ in wss]
    inputs = [[random(numel, BF16, seed=100 * k + r) for r in range(world_size)] for k in range(ROUNDS)]
    results = [[torch.empty(numel, dtype=BF16, device="cuda") for _ in range(ROUNDS)] for _ in wss]

    def launch(rank, round_):
        xs[rank].copy_(inputs[round_][rank])
        launchers[rank](xs[rank])
        results[rank][round_].copy_(xs[rank])

    def check():
        for round_ in range(ROUNDS):
            for rank in range(world_size):
                assert_bits(results[rank][round_], fp32_sum(inputs[round_]), f"lamport rank {rank} round {round_}")

    return wss, launch, check


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", SMALL, ids=lambda c: f"{c[0]}{'-double' if c[1] else ''}-{c[2]}-B{c[3]}g{c[4]}w{c[5]}")
def test_small_all_reduce_configs_emulated(world_size, case):
    algorithm, double_buffer, numel, block, grid, warps = case
    if algorithm == "lamport":
        wss, launch, check = _lamport_case(world_size, numel, block, grid, warps)
    else:
        wss, launch, check = _all_reduce_case(world_size, algorithm, numel, BF16, double_buffer=double_buffer,
                                              block=block, grid=grid, warps=warps)
    run_ranks(wss, launch, ROUNDS)
    check()


#: The Lamport wait's per-thread spin (AllReduceConfig.spin; world size 2 only): the floor bench's
#: 2, 8 and 64 KiB configs, SPIN 8, 8 and 4 (8 / 16 / 8 elements a thread).
SPIN = [(1024, 1024, 1, 4), (4096, 4096, 1, 16), (32768, 1024, 32, 4), (32768, 2048, 16, 8)]


@pytest.mark.parametrize("case", SPIN, ids=lambda c: f"{c[0]}-B{c[1]}g{c[2]}w{c[3]}")
def test_lamport_spin_emulated(case):
    numel, block, grid, warps = case
    wss, launch, check = _lamport_case(2, numel, block, grid, warps, spin=True)
    run_ranks(wss, launch, ROUNDS)
    check()


def test_all_reduce_fp32_emulated():
    wss, launch, check = _all_reduce_case(4, "one_shot", 9_999, torch.float32)
    run_ranks(wss, launch, ROUNDS)
    check()


#: Lamport one-shot: element counts of its rounds, larger and smaller than the round before (the
#: re-arm's range), five rounds so the 3-buffer rotation wraps. One kernel variant per run (every
#: module is loaded before a rank spins): ragged counts (TAIL=1), or whole 16-byte vectors (TAIL).
LAMPORT_COUNTS = [(40_003, 777, 131_071, 1, 20_001), (40_000, 8, 131_072, 1024, 16)]


@pytest.mark.parametrize("world_size, spin", [(w, False) for w in WORLD_SIZES] + [(2, True)],
                         ids=[f"{w}" for w in WORLD_SIZES] + ["2-spin"])
@pytest.mark.parametrize("counts", LAMPORT_COUNTS, ids=["ragged", "whole_vectors"])
def test_lamport_all_reduce_emulated(world_size, spin, counts):
    """The Lamport one-shot (no barrier: peers spin on their receive buffers until the data is
    there), -0.0 inputs included; bit-exact with the fp32 in-order sum every round. Its load
    step runs the ranks one after another, so each rank's buffer of round 0 is pre-filled with
    non-sentinel words there (as the barrier pads are pre-set); reset_signals re-arms it.
    ``spin``: the per-thread spin's wait (world size 2)."""
    from autosymm.backends.triton_lamport import _LamportLauncher
    from autosymm.configs import AllReduceConfig
    from autosymm.geometry import LAMPORT_HEADER_BYTES, LAMPORT_REGION, LAMPORT_SLOT_BYTES
    from autosymm.problem import Problem

    wss = workspaces(world_size)
    problem = Problem.all_reduce(2 * max(counts), "bf16", world_size)
    launchers = [_LamportLauncher(problem, AllReduceConfig("lamport", 1024, 4, 4, spin=spin), ws) for ws in wss]
    inputs = [[random(n, BF16, seed=100 * k + r) for r in range(world_size)] for k, n in enumerate(counts)]
    for k, per_rank in enumerate(inputs):
        for r, t in enumerate(per_rank):
            t[r::7] = -0.0  # the sentinel's value: must arrive (as +0.0, same sums)
    xs = [[torch.empty_like(t) for t in per_rank] for per_rank in zip(*inputs)]
    results = [[torch.empty_like(t) for t in per_rank] for per_rank in zip(*inputs)]
    loading = [True]

    def launch(rank, round_):
        if loading[0]:  # load step: ranks run one after another; nothing may wait for a later one
            start = wss[rank].regions[LAMPORT_REGION].offset + LAMPORT_HEADER_BYTES
            wss[rank].buffer[start:start + (world_size - 1) * LAMPORT_SLOT_BYTES].fill_(0x55)
        xs[rank][round_].copy_(inputs[round_][rank])
        launchers[rank](xs[rank][round_])
        results[rank][round_].copy_(xs[rank][round_])

    run_ranks(wss, launch, len(counts), reset=lambda: loading.__setitem__(0, False))
    for round_, per_rank in enumerate(inputs):
        want = fp32_sum(per_rank)
        for rank in range(world_size):
            assert_bits(results[rank][round_], want, f"lamport rank {rank} round {round_}")


FUSED = [  # (algorithm, double_buffer, row_split, rows_per_program, n_tokens, hidden[, spin: world size 2 only])
    ("one_shot", False, 1, 1, 7, 2048),
    ("one_shot", True, 1, 2, 5, 1032),
    ("one_shot_push", False, 1, 1, 7, 2048),
    ("two_shot", False, 1, 1, 9, 2048),
    ("one_shot", False, 4, 1, 3, 4096),
    ("lamport", False, 1, 1, 7, 2048),
    ("lamport", False, 1, 1, 1, 8192),
    ("lamport", False, 4, 1, 3, 4096),
    ("lamport", False, 1, 1, 1, 8192, True),
    ("lamport", False, 1, 1, 1, 4096, True),
    ("lamport", False, 4, 1, 3, 4096, True),
    ("lamport", False, 1, 2, 5, 2048, True),
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", FUSED, ids=lambda c: f"{c[0]}{'-double' if c[1] else ''}-split{c[2]}-rows{c[3]}"
                         f"-{c[4]}x{c[5]}" + ("-spin" if c[6:] else ""))
def test_fused_rmsnorm_emulated(world_size, case):
    from _fused_ref import check as check_fused

    from autosymm.backends.triton_fused import _FusedLauncher
    from autosymm.backends.triton_fused import fused_block_size
    from autosymm.configs import FusedConfig
    from autosymm.problem import Problem

    algorithm, double_buffer, row_split, rows, n_tokens, hidden, *spin = case
    if spin and world_size != 2:
        pytest.skip("the per-thread spin is for world size 2")
    wss = workspaces(world_size)
    block = fused_block_size(hidden)
    config = FusedConfig(algorithm, block, 4, 4, rows_per_program=rows, double_buffer=double_buffer,
                         row_split=row_split, spin=bool(spin))
    problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, "bf16", world_size)
    launchers = [_FusedLauncher(problem, config, ws) for ws in wss]
    xs = [[random((n_tokens, hidden), BF16, seed=100 * k + r) for r in range(world_size)] for k in range(ROUNDS)]
    residual_in = [random((n_tokens, hidden), BF16, seed=7000 + k) for k in range(ROUNDS)]
    weight = (1 + 0.5 * random(hidden, torch.float32, seed=9)).to(BF16)
    residuals = [torch.empty(n_tokens, hidden, dtype=BF16, device="cuda") for _ in range(world_size)]
    outs = [[torch.empty(n_tokens, hidden, dtype=BF16, device="cuda") for _ in range(ROUNDS)] for _ in range(world_size)]
    res_out = [[torch.empty(n_tokens, hidden, dtype=BF16, device="cuda") for _ in range(ROUNDS)]
               for _ in range(world_size)]

    def launch(rank, round_):
        residuals[rank].copy_(residual_in[round_])
        launchers[rank](xs[round_][rank], residuals[rank], weight, EPS, out=outs[rank][round_])
        res_out[rank][round_].copy_(residuals[rank])

    run_ranks(wss, launch, ROUNDS)
    for round_ in range(ROUNDS):
        check_fused(res_out[0][round_], outs[0][round_], xs[round_], residual_in[round_], weight, EPS)
        for rank in range(1, world_size):
            assert_bits(res_out[rank][round_], res_out[0][round_], f"{algorithm} residual rank {rank} round {round_}")
            assert_bits(outs[rank][round_], outs[0][round_], f"{algorithm} out rank {rank} round {round_}")


#: The epilogue variants: (algorithm, double_buffer, row_split, rows_per_program, n_tokens, hidden,
#: dtype, epilogue key): each variant on a one-shot, the two-shot or split rows; hidden 2048 to 8192
#: (5120, 7168: masked columns); odd token counts; bf16 and fp16.
FUSED_EPILOGUES = [
    ("one_shot", False, 1, 1, 7, 2048, BF16, "rms"),
    ("one_shot_push", False, 1, 1, 5, 4096, torch.float16, "add_gemma"),
    ("two_shot", False, 1, 1, 9, 8192, BF16, "add_rms_fp8"),
    ("one_shot_push", True, 1, 1, 3, 8192, BF16, "gemma_fp8"),
    ("one_shot", True, 1, 2, 5, 5120, torch.float16, "add_rms_fp8_per_token"),
    ("two_shot", False, 1, 2, 9, 4096, BF16, "rms_fp8_per_token"),
    ("one_shot", False, 4, 1, 3, 7168, BF16, "rms_nvfp4"),
    ("two_shot", False, 1, 1, 9, 2048, torch.float16, "add_gemma_nvfp4"),
    ("one_shot", False, 8, 1, 1, 8192, torch.float16, "add_rms_nvfp4"),
    ("lamport", False, 1, 1, 1, 8192, BF16, "add_rms_fp8"),
    ("lamport", False, 1, 2, 5, 4096, torch.float16, "rms_fp8_per_token"),
    ("lamport", False, 2, 1, 3, 7168, BF16, "add_gemma_nvfp4"),
]
#: fp8's static scale and nvfp4's global scale of the cases.
EPILOGUE_SCALE = {"fp8": 0.01, "nvfp4": 300.0}


def _close_to_the_formula(got, want, epilogue, what):
    """The GPU's out against autosymm.epilogue.reference of the same fp32 sum: the norm's sum of
    squares (its tree) and rsqrt (rsqrt.approx) may move y by an ulp, so a quantized value may
    land one step away: unquantized within 1 ulp of y rounded; fp8 within one e4m3 step and 99 %
    identical; nvfp4 99 % identical bytes and block scales; per-token scales within 2 fp32 ulp."""
    from _fused_ref import ulps_off

    out, scales = got
    if epilogue.quant is None:
        assert ulps_off(out, want.out.float()) <= 1.0, f"{what}: out more than 1 ulp off"
        return
    same = (bits(out) == bits(want.out)).float().mean().item()
    assert same >= 0.99, f"{what}: only {same:.4f} of the quantized values are the formula's"
    if epilogue.quant in ("fp8", "fp8_per_token"):
        got_f, want_f = out.float(), want.out.float()
        _, exponent = torch.frexp(want_f.abs().clamp_min(2.0**-6))
        assert bool(((got_f - want_f).abs() <= torch.ldexp(torch.ones_like(want_f), exponent - 4)).all()), \
            f"{what}: an e4m3 value more than one step off"
    if epilogue.quant == "fp8_per_token":
        torch.testing.assert_close(scales, want.scales, rtol=2.0**-22, atol=0.0)
    if epilogue.quant == "nvfp4":
        from autosymm.epilogue import NVFP4_BLOCK, nvfp4_scale_offsets

        tokens, n_blocks = out.shape[0], 2 * out.shape[1] // NVFP4_BLOCK
        rows = torch.arange(tokens, device=out.device)[:, None].expand(tokens, n_blocks)
        cols = torch.arange(n_blocks, device=out.device)[None, :].expand(tokens, n_blocks)
        real = torch.zeros(scales.numel(), dtype=torch.bool, device=out.device)
        real[nvfp4_scale_offsets(rows, cols, n_blocks).reshape(-1)] = True
        got_bytes, want_bytes = bits(scales).reshape(-1), bits(want.scales).reshape(-1)
        assert int(got_bytes[~real].count_nonzero()) == 0, f"{what}: the swizzled layout's padding is not 0"
        same = (got_bytes[real] == want_bytes[real]).float().mean().item()
        assert same >= 0.99, f"{what}: only {same:.4f} of the block scales are the formula's"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", FUSED_EPILOGUES, ids=lambda c: f"{c[0]}{'-double' if c[1] else ''}-split{c[2]}"
                         f"-rows{c[3]}-{c[4]}x{c[5]}-{str(c[6])[6:]}-{c[7]}")
def test_fused_epilogues_emulated(world_size, case):
    """Each epilogue variant's launcher on every rank, three rounds: the residual (where added) the
    fp32 in-order sum rounded once, bit for bit; out and scales bit-identical on every rank and
    the formula's up to the norm's last fp32 bit (:func:`_close_to_the_formula`)."""
    from autosymm.backends.triton_fused import _FusedLauncher, fused_block_size
    from autosymm.configs import FusedConfig
    from autosymm.epilogue import Epilogue, reference
    from autosymm.problem import Problem, dtype_name

    algorithm, double_buffer, row_split, rows, n_tokens, hidden, dtype, key = case
    epilogue = Epilogue.of_key(key)
    wss = workspaces(world_size)
    block = fused_block_size(hidden)
    num_warps = max(4, rows * block // (64 * 32))  # FusedConfig: at most 64 values per thread
    config = FusedConfig(algorithm, block, num_warps, 4, rows_per_program=rows,
                         double_buffer=double_buffer, row_split=row_split)
    problem = Problem.all_reduce_rmsnorm(n_tokens, hidden, dtype_name(dtype), world_size)
    launchers = [_FusedLauncher(problem, config, ws, epilogue) for ws in wss]
    scale = torch.tensor([EPILOGUE_SCALE.get(epilogue.quant, 1.0)], dtype=torch.float32, device="cuda")
    xs = [[random((n_tokens, hidden), dtype, seed=100 * k + r) for r in range(world_size)] for k in range(ROUNDS)]
    residual_in = [random((n_tokens, hidden), dtype, seed=7000 + k) for k in range(ROUNDS)]
    weight = random(hidden, torch.float32, seed=9, scale=0.5).to(dtype)
    residuals = [torch.empty(n_tokens, hidden, dtype=dtype, device="cuda") for _ in range(world_size)]
    results = [[epilogue.empty_outputs(n_tokens, hidden, dtype, "cuda") for _ in range(ROUNDS)]
               for _ in range(world_size)]
    res_out = [[torch.empty(n_tokens, hidden, dtype=dtype, device="cuda") for _ in range(ROUNDS)]
               for _ in range(world_size)]

    def launch(rank, round_):
        residuals[rank].copy_(residual_in[round_])
        out, scales = results[rank][round_]
        launchers[rank](xs[round_][rank], residuals[rank] if epilogue.residual else None, weight, EPS,
                        out=out if scales is None else (out, scales), scale=scale)
        res_out[rank][round_].copy_(residuals[rank])

    run_ranks(wss, launch, ROUNDS)
    for round_ in range(ROUNDS):
        total = torch.zeros(n_tokens, hidden, dtype=torch.float32, device="cuda")
        for x in xs[round_]:
            total = total + x.float()
        want = reference(total, residual_in[round_], weight, EPS, epilogue, scale)
        what = f"{key} round {round_}"
        if epilogue.residual:
            assert_bits(res_out[0][round_], want.residual, f"{what} residual")
        else:
            assert_bits(res_out[0][round_], residual_in[round_], f"{what}: the residual is untouched")
        _close_to_the_formula(results[0][round_], want, epilogue, what)
        for rank in range(1, world_size):
            for got, first in zip(results[rank][round_], results[0][round_]):
                if got is not None:
                    assert_bits(got, first, f"{what} rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("fused_barrier", [True, False], ids=["fused_barrier", "barrier_kernel"])
def test_moe_conversions_emulated(world_size, fused_barrier):
    from autosymm.backends.triton_moe import Conversion
    from autosymm.configs import MoEConfig
    from autosymm.geometry import dst_rows, moe_buffer
    from autosymm.routing import make_expt_assignment, make_expt_dict_random, random_expt_indx, route
    from _moe_ref import reference_dp_to_ep, reference_ep_to_dp

    n_tokens, d_model, n_experts, k = 5, 264, 4 * world_size, 4
    wss = workspaces(world_size)
    placement = make_expt_dict_random(world_size, n_experts, seed=3)
    assignment = make_expt_assignment(world_size, n_experts, placement, "cuda")
    expt_indx = random_expt_indx(world_size * n_tokens, n_experts, k, seed=4, drop_fraction=0.1, device="cuda")
    gate_indx, topk_indx = route(expt_indx)
    srcs = [random((n_tokens, d_model), BF16, seed=50 + r) for r in range(world_size)]
    config = MoEConfig(256, 2, rows_per_program=4, num_blocks=3)
    views = {}
    for op in ("dp_to_ep", "ep_to_dp"):
        rows, offset = dst_rows(op, n_tokens, k, world_size), moe_buffer(op, wss[0].capacity("moe"), world_size)[0]
        views[op] = [ws.local_view("moe", (rows, d_model), BF16, offset) for ws in wss]
        for view in views[op]:  # poison: rows no pair writes must keep it
            view.view(torch.int16).copy_(torch.randint(-2**15, 2**15, view.shape, dtype=torch.int16))
    before = {op: [v.clone() for v in views[op]] for op in views}
    conversions = {op: [Conversion(op, ws, config) for ws in wss] for op in views}
    ep_srcs = [random((dst_rows("dp_to_ep", n_tokens, k, world_size), d_model), BF16, seed=80 + r)
               for r in range(world_size)]

    def launch(rank, round_):
        conversions["dp_to_ep"][rank](srcs[rank], assignment.expt_owner, expt_indx, gate_indx, fused_barrier)
        conversions["ep_to_dp"][rank](ep_srcs[rank], assignment.expt_owner, expt_indx, topk_indx, fused_barrier)

    def repoison():  # the load step wrote the buffers: the run must write them again
        for op in views:
            for view, poison in zip(views[op], before[op]):
                view.copy_(poison)

    run_ranks(wss, launch, ROUNDS, reset=repoison)
    cpu_assignment = make_expt_assignment(world_size, n_experts, placement)
    want = reference_dp_to_ep([s.cpu() for s in srcs], cpu_assignment, expt_indx.cpu(), gate_indx.cpu(),
                              out=[b.cpu() for b in before["dp_to_ep"]])
    for rank in range(world_size):
        assert_bits(views["dp_to_ep"][rank], want[rank], f"dp->ep rank {rank}")
    want = reference_ep_to_dp([s.cpu() for s in ep_srcs], cpu_assignment, expt_indx.cpu(), topk_indx.cpu(),
                              out=[b.cpu() for b in before["ep_to_dp"]])
    for rank in range(world_size):
        assert_bits(views["ep_to_dp"][rank], want[rank], f"ep->dp rank {rank}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_barrier_emulated(world_size):
    """The stream-ordered barrier (the 'host' channel): each rank writes a word into every peer
    before it and reads its own words after it; every peer's word of the round must be there."""
    from autosymm.backends.launch import LeanLauncher
    from autosymm.kernels.barrier import _barrier_kernel

    wss = workspaces(world_size)
    rounds = 5
    barriers = [LeanLauncher(_barrier_kernel, (1,), dict(RANK=r, WORLD_SIZE=world_size), num_warps=1)
                for r in range(world_size)]
    marks = torch.zeros(world_size, world_size, dtype=torch.int64, device="cuda")
    seen = torch.zeros(rounds, world_size, world_size, dtype=torch.int64, device="cuda")

    def launch(rank, round_):
        marks[:, rank].fill_(round_ + 1)  # "rank wrote round_ + 1 into every peer's row"
        barriers[rank](wss[rank].signal_ptrs("host"))
        seen[round_, rank].copy_(marks[rank])

    run_ranks(wss, launch, rounds, reset=marks.zero_)
    for round_ in range(rounds):
        row = seen[round_]
        assert bool((row >= round_ + 1).all()), f"round {round_}: a rank passed the barrier before a peer arrived: {row}"


def _rs_ag():
    """(reduce_scatter, all_gather, rs_ag_layout) modules; a broken import fails the test."""
    from autosymm.backends import rs_ag_layout
    from autosymm.kernels import all_gather, reduce_scatter

    return reduce_scatter, all_gather, rs_ag_layout


def _rs_ag_launchers(kernel, wss, layout, block, stage_offset=512):
    """Per rank: launch(out, inp) of ``kernel`` (reduce-scatter or all-gather, staged) with
    ``layout``'s segments; the rank is a run-time argument of these kernels."""
    from autosymm.backends.launch import LeanLauncher

    table = torch.tensor(layout.table(), dtype=torch.int32, device="cuda")
    constexprs = dict(WORLD_SIZE=len(wss), BLOCK=block, ZERO_COPY=False, ALIGNED=stage_offset % 16 == 0,
                      SEG_ALIGNED=layout.seg_aligned, EVEN=layout.even)
    lean = LeanLauncher(kernel, (4,), constexprs, num_warps=4)  # one compiled kernel for every rank
    return [lambda out, inp, ws=ws, rank=rank: lean(out, inp, ws.region_ptrs("all_reduce"), ws.signal_ptrs("all_reduce"),
                                                    table, rank, layout.seg, layout.stage_seg, stage_offset)
            for rank, ws in enumerate(wss)]


RS_AG_COUNTS = {"even": lambda w: [4096] * w, "ragged": lambda w: [1000 + 37 * s for s in range(w)]}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("counts", list(RS_AG_COUNTS))
def test_reduce_scatter_emulated(world_size, counts):
    rs, _, layouts = _rs_ag()
    counts = RS_AG_COUNTS[counts](world_size)
    wss = workspaces(world_size)
    layout = layouts.segments(counts, 8, padded=True)  # bf16: 8 elements in 16 bytes
    launchers = _rs_ag_launchers(rs._reduce_scatter, wss, layout, 1024)
    inputs = [[random(layout.total, BF16, seed=100 * k + r) for r in range(world_size)] for k in range(ROUNDS)]
    outs = [[torch.empty(counts[r], dtype=BF16, device="cuda") for _ in range(ROUNDS)] for r in range(world_size)]
    run_ranks(wss, lambda rank, k: launchers[rank](outs[rank][k], inputs[k][rank]), ROUNDS)
    for k in range(ROUNDS):
        total = fp32_sum(inputs[k])
        for rank in range(world_size):
            start = layout.starts[rank]
            assert_bits(outs[rank][k], total[start:start + counts[rank]], f"reduce-scatter rank {rank} round {k}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("counts", list(RS_AG_COUNTS))
@pytest.mark.parametrize("push", [True, False], ids=["push", "pull"])
def test_all_gather_emulated(world_size, counts, push):
    _, ag, layouts = _rs_ag()
    counts = [2 * c for c in RS_AG_COUNTS[counts](world_size)]  # bytes of bf16 shards
    wss = workspaces(world_size)
    layout = layouts.segments(counts, 16, padded=push)
    launchers = _rs_ag_launchers(ag._all_gather_push if push else ag._all_gather_pull, wss, layout, 2048)
    shards = [[random(c // 2, BF16, seed=100 * k + r).view(torch.uint8) for r, c in enumerate(counts)]
              for k in range(ROUNDS)]
    outs = [[torch.empty(layout.total, dtype=torch.uint8, device="cuda") for _ in range(ROUNDS)]
            for _ in range(world_size)]
    run_ranks(wss, lambda rank, k: launchers[rank](outs[rank][k], shards[k][rank]), ROUNDS)
    for k in range(ROUNDS):
        want = torch.cat(shards[k])
        for rank in range(world_size):
            assert_bits(outs[rank][k], want, f"all-gather ({'push' if push else 'pull'}) rank {rank} round {k}")

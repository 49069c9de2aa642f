"""Batch-invariant bits: a row's output does not depend on the call's size, config or algorithm.

Every Triton all-reduce (pull one-shot staged, double-buffered or zero-copy; push one-shot
single or double-buffered; two-shot staged or zero-copy) computes each element as the fp32 sum
of the ranks' values in the order 0..W-1, rounded once: an elementwise function of that
element's inputs alone. So the bits of token j's row are the same in a call of 1 token and of
8192, in every BLOCK, grid, warp count and algorithm. Here each call's rows come from one fixed
bank (token j has the same inputs in every call), and every rank's result must equal
:func:`ordered_sum` bit for bit: equal to one formula, the results are equal to each other.

The Lamport one-shot (the same sum, its data carrying its own arrival mark) and the
reduce-scatters (pull and push: rank r's shard is segment r of that sum) are checked the same
way.

The fused all-reduce + RMSNorm's ``residual`` output is elementwise too (the fp32 sum plus the
residual, rounded once) and is checked the same way across its algorithms, split rows and
double buffering. Its ``out`` is not claimed: the row's sum of squares is a ``tl.sum`` whose
reduction tree follows the program's layout (BLOCK / num_warps / rows per program, the pointer
alignment the compiler vectorises for) and, with split rows, the parts' partial sums, so its
bits may change with the config on GPUs (the interpreter's numpy sum cannot show that).

Rounding in the interpreter: its fp32 -> bf16 cast truncates (triton/runtime/interpreter.py
``cast_impl`` passes no rounding mode), while GPUs round to nearest even (``cvt.rn.bf16.f32``);
fp16 rounds to nearest even in both. :func:`round_like_kernels` models the cast that runs, so
the check is exact either way, and invariance does not depend on it: every path rounds the
same fp32 value once with the same instruction.
"""

import os

import pytest
import torch

from autosymm import spec
from autosymm.backends import backend_names, get_backend, nccl_ordered
from autosymm.configs import AllReduceConfig, FusedConfig

import _lamport_sim as lamport_sim
import _rs_ag_sim as rs_ag_sim
from _all_reduce_sim import requires_interpreter
from _invariance_sim import run_all_reduce, run_fused

pytestmark = requires_interpreter

#: Tokens per call: one, odd, a power of two, a ragged thousand, the top of the default sweep.
TOKENS = (1, 3, 64, 1000, 8192)
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bank(world_size: int, tokens: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[world_size, tokens, hidden]: rank r's row of token j, the same in every call."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(world_size, tokens, hidden, generator=gen).to(dtype)


def round_like_kernels(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' fp32 -> ``dtype`` cast as it runs here (see the module docstring)."""
    if dtype is torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return (acc.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)  # toward zero
    return acc.to(dtype)


def ordered_sum(rows) -> torch.Tensor:
    """fp32 accumulator from +0.0, the ranks' values added in order 0..W-1 (unrounded): the
    formula of the deterministic fallback nccl_ordered, so kernels equal to it equal the fallback."""
    return nccl_ordered.ordered_sum(torch.stack(list(rows)))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    differ = bits(got) != bits(want)
    if differ.any():
        where = differ.nonzero()[0].tolist()
        pytest.fail(f"{what}: {int(differ.sum())} elements differ, first at {where}: "
                    f"{got[tuple(where)].item()!r} != {want[tuple(where)].item()!r}")


# (algorithm, config, zero-copy): BLOCK from the space's smallest to its largest, one program to
# many, and the double-buffered configs (their halves hold the small calls; larger ones take the
# single-buffer path of the same config: both must give the same bits).
ALL_REDUCE_CASES = [
    ("one_shot", AllReduceConfig("one_shot", 1024, 1, 4), False),
    ("one_shot", AllReduceConfig("one_shot", 32768, 3, 32), False),
    ("one_shot", AllReduceConfig("one_shot", 1024, 8, 8, double_buffer=True), False),
    ("one_shot", AllReduceConfig("one_shot", 4096, 5, 16), True),
    ("one_shot_push", AllReduceConfig("one_shot_push", 1024, 2, 4), False),
    ("one_shot_push", AllReduceConfig("one_shot_push", 8192, 7, 8, double_buffer=True), False),
    ("two_shot", AllReduceConfig("two_shot", 1024, 1, 4), False),
    ("two_shot", AllReduceConfig("two_shot", 2048, 5, 8), True),
    ("two_shot", AllReduceConfig("two_shot", 32768, 6, 32), False),
]


def _case_id(case) -> str:
    algorithm, config, zero_copy = case
    extra = "-double" if config.double_buffer else ""
    return f"{algorithm}-B{config.block_size}-G{config.num_blocks}{extra}{'-zero_copy' if zero_copy else ''}"


def _check_all_reduce(case, world_size: int, hidden: int, dtype: torch.dtype, tokens=TOKENS) -> None:
    algorithm, config, zero_copy = case
    rows = bank(world_size, max(tokens), hidden, dtype, seed=hidden)
    for n_tokens in tokens:
        inputs = [rows[r, :n_tokens].reshape(-1).clone() for r in range(world_size)]
        want = round_like_kernels(ordered_sum(inputs), dtype)
        for rank, got in enumerate(run_all_reduce(algorithm, config, inputs, zero_copy=zero_copy)):
            _assert_same_bits(got, want, f"{_case_id(case)}, {n_tokens} tokens of {hidden}, rank {rank}")


@pytest.mark.parametrize("case", ALL_REDUCE_CASES, ids=_case_id)
def test_all_reduce_rows_have_the_same_bits_at_every_size(case):
    """3 ranks (where NCCL's ring is not invariant), bf16 rows of 8 (16-byte rows)."""
    _check_all_reduce(case, 3, 8, torch.bfloat16)


@pytest.mark.parametrize("case, world_size, hidden, dtype", [
    (ALL_REDUCE_CASES[1], 4, 5, torch.float32),  # rows of 20 bytes: ragged vectors
    (ALL_REDUCE_CASES[5], 2, 12, torch.float16),
    (ALL_REDUCE_CASES[7], 4, 3, torch.float16),
], ids=lambda v: _case_id(v) if isinstance(v, tuple) else str(v))
def test_all_reduce_other_dtypes_and_world_sizes(case, world_size, hidden, dtype):
    _check_all_reduce(case, world_size, hidden, dtype, tokens=(1, 3, 1000))


# Fused configs over hidden=200 (BLOCK 256): whole rows of 1..4 per program, split rows (2 and 4
# parts: 200 columns span 2 and 4 parts of 128 and 64), double buffering, push and two-shot.
FUSED_CONFIGS = [
    FusedConfig("one_shot", 256, 4, 3, 1),
    FusedConfig("one_shot", 256, 2, 2, 4, double_buffer=True),
    FusedConfig("one_shot", 256, 4, 6, 1, row_split=2),
    FusedConfig("one_shot_push", 256, 2, 5, 2),
    FusedConfig("one_shot_push", 256, 2, 12, 1, double_buffer=True, row_split=4),
    FusedConfig("two_shot", 256, 4, 2, 1),
]
FUSED_TOKENS = (1, 3, 20)  # the interpreter takes ~0.1 s per row and rank; 20: a ragged group of 4


def _fused_id(config: FusedConfig) -> str:
    return (f"{config.algorithm}-R{config.rows_per_program}-S{config.row_split}"
            f"{'-double' if config.double_buffer else ''}")


@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=_fused_id)
def test_fused_residual_rows_have_the_same_bits_at_every_size(config):
    world_size, hidden, dtype, eps = 3, 200, torch.bfloat16, 1e-6
    xs_bank = bank(world_size, max(FUSED_TOKENS), hidden, dtype, seed=1)
    res_bank, weight = bank(2, max(FUSED_TOKENS), hidden, dtype, seed=2)[0], bank(1, 1, hidden, dtype, seed=3)[0, 0]
    for n_tokens in FUSED_TOKENS:
        xs = [xs_bank[r, :n_tokens].clone() for r in range(world_size)]
        residual = res_bank[:n_tokens].clone()
        want = round_like_kernels(ordered_sum(xs) + residual.float(), dtype)
        results = run_fused(config, xs, residual, weight, eps)
        for rank, (new_residual, out) in enumerate(results):
            _assert_same_bits(new_residual, want, f"{_fused_id(config)}, {n_tokens} tokens, rank {rank}")
            _assert_same_bits(out, results[0][1], f"{_fused_id(config)}, {n_tokens} tokens: out of rank {rank}")


# Lamport (block, programs, warps): one program to several, small and large blocks. Tokens up to
# 1000 of 8 bf16 (16 KB a rank, within its 256 KiB cap); the calls run in sequence on the same
# workspaces, so the receive buffers rotate and are re-armed between them, as in a server.
LAMPORT_LAUNCHES = [(256, 1, 2), (1024, 3, 4), (128, 8, 1)]


@pytest.mark.parametrize("launch", LAMPORT_LAUNCHES, ids=lambda v: "B{}-G{}-W{}".format(*v))
def test_lamport_rows_have_the_same_bits_at_every_size(launch):
    world_size, hidden, dtype = 3, 8, torch.bfloat16
    rows = bank(world_size, 1000, hidden, dtype, seed=4)
    wss = lamport_sim.workspaces(world_size)
    for n_tokens in (1, 3, 64, 1000, 3):
        inputs = [rows[r, :n_tokens].reshape(-1).clone() for r in range(world_size)]
        want = round_like_kernels(ordered_sum(inputs), dtype)
        block, programs, warps = launch
        launchers = lamport_sim.launchers(wss, dtype, n_tokens * hidden, block, programs, warps)
        for rank, got in enumerate(lamport_sim.run_call(launchers, inputs)):
            _assert_same_bits(got, want, f"lamport B{block} G{programs}, {n_tokens} tokens, rank {rank}")


# Reduce-scatter (algorithm, block, programs, warps, the per-rank table path): the pull's and the
# push's kernels, grids of one program and of several, equal segments through the stride and
# through the table.
SCATTER_CASES = [("pull", 1024, 1, 4, True), ("pull", 128, 5, 2, False), ("push", 256, 3, 4, True),
                 ("push", 2048, 2, 8, False)]


@pytest.mark.parametrize("case", SCATTER_CASES, ids=lambda c: "{}-B{}-G{}-W{}-{}".format(
    *c[:4], "even" if c[4] else "table"))
def test_reduce_scatter_shards_have_the_same_bits_at_every_size(case):
    """3 ranks, bf16 rows of 8: segment s's token j has the same inputs in every call, and every
    shard equals the formula (so the all-reduce's rows, above)."""
    algorithm, block, programs, warps, even = case
    world_size, hidden, dtype = 3, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(world_size, world_size, 1000, hidden, generator=gen).to(dtype)  # [rank, segment, token]
    for n_tokens in (1, 3, 64, 1000):
        ins = [rows[r, :, :n_tokens].reshape(-1).clone() for r in range(world_size)]
        wss = rs_ag_sim.workspaces(world_size, region_bytes=1 << 17)
        outs, _, expected = rs_ag_sim.reduce_scatter(wss, ins, [n_tokens * hidden] * world_size,
                                                     dict(block=block, programs=programs, warps=warps), even=even,
                                                     push=algorithm == "push")
        rs_ag_sim.check_pads(wss, expected)
        for rank, got in enumerate(outs):
            want = round_like_kernels(ordered_sum(rows[q, rank, :n_tokens].reshape(-1) for q in range(world_size)),
                                      dtype)
            _assert_same_bits(got, want, f"reduce-scatter {case}, {n_tokens} tokens, rank {rank}")


def test_the_backends_declared_batch_invariant_are_the_ones_shown_so():
    """Backend.batch_invariant (what the deterministic setting dispatches to) holds for the
    all-reduce families, the Lamport one-shot and the reduce-scatters tested above, the ordered
    NCCL fallbacks (tests/test_backends_nccl_ordered) and the MoE conversions and all-gathers
    (rows are copied, never summed); not for multimem (the switch adds in an unspecified order),
    NCCL's all-reduce and reduce-scatter (ring order per chunk, a rounding per step at W > 2),
    torch's symm_mem ops (bf16 adds rounded per peer), nor the fused kernels (out's tree, above)."""
    invariant = {name for name in backend_names() if get_backend(name).batch_invariant}
    gathers = set(spec.ALL_GATHER.backends) - set(spec.STACK_BACKENDS)  # a stack's own path: its own order
    assert invariant == {"triton_one_shot", "triton_one_shot_push", "triton_two_shot", "triton_lamport",
                         "triton_reduce_scatter_pull", "triton_reduce_scatter_push", "nccl_ordered",
                         "nccl_ordered_fused", "nccl_ordered_reduce_scatter", "triton_moe",
                         "nccl_all_to_all", "noop"} | gathers  # gathers copy too; noop exchanges nothing
    assert "nccl_all_gather" in gathers
    assert {case[0] for case in ALL_REDUCE_CASES} == {"one_shot", "one_shot_push", "two_shot"}

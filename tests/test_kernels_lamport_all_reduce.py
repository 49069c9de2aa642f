"""The Lamport one-shot all-reduce under the Triton interpreter, through its launcher, on ranks
simulated one after another (tests/_lamport_sim: pushes first, then the reads). Results are compared bit for bit with the fp32 in-order sum rounded once
(what every one-shot computes), over several rounds of changing sizes (the rotation wraps), and
the receive buffers are checked after each round: every call re-arms what it read, so once every
rank ran a call every buffer is the sentinel again, and the header holds the next rotation index
and a zero arrival counter.
"""

import pytest
import torch

from autosymm.backends.base import BackendError
from autosymm.geometry import LAMPORT_BUFFERS, LAMPORT_HEADER_BYTES, LAMPORT_REGION, LAMPORT_SLOT_BYTES

from _all_reduce_sim import error_counts, random_inputs, requires_interpreter, tiny_poll_limit
from _lamport_sim import SENTINEL, launchers, run_call, workspaces
from _rs_ag_sim import reference_sum

pytestmark = requires_interpreter

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def in_order_sum(inputs):
    """fp32 sum over ranks 0..W-1 from +0.0, rounded once (by triton's conversion, as the
    kernels round): the one-shots' result bits."""
    return reference_sum(inputs, inputs[0].dtype)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def header(ws):
    """(rotation index, arrival counter, unused word) of a rank's Lamport region."""
    start = ws.regions[LAMPORT_REGION].offset
    return tuple(ws.buffer[start:start + 12].view(torch.int32).tolist())


def slot_words(ws, buffer, slot, elem_bytes):
    """Rank ``ws.rank``'s slot ``slot`` of receive buffer ``buffer`` (raw words)."""
    start = (ws.regions[LAMPORT_REGION].offset + LAMPORT_HEADER_BYTES
             + (buffer * (ws.world_size - 1) + slot) * LAMPORT_SLOT_BYTES)
    raw = ws.buffer[start:start + LAMPORT_SLOT_BYTES]
    return raw.view({2: torch.int16, 4: torch.int32}[elem_bytes])


def assert_every_buffer_rearmed(wss, round_, elem_bytes):
    """Every rank ran the call: every word it read is re-armed (and none past the call was written)."""
    for ws in wss:
        assert header(ws) == ((round_ + 1) % LAMPORT_BUFFERS, 0, 0)
        for buffer in range(LAMPORT_BUFFERS):
            for slot in range(ws.world_size - 1):
                words = slot_words(ws, buffer, slot, elem_bytes)
                assert int(words.count_nonzero()) == 0, f"rank {ws.rank} buffer {buffer} slot {slot} not re-armed"


# (world_size, dtype, element counts per round): odd counts, single elements, a count of whole
# 16-byte vectors (TAIL), larger and smaller than the round before.
CASES = [
    (2, torch.bfloat16, (1001, 17, 4096, 1)),
    (3, torch.float16, (999, 1000, 3, 513)),
    (4, torch.float32, (257, 1024, 31, 600)),
    (8, torch.bfloat16, (777, 1, 2048, 129)),
]


@pytest.mark.parametrize("world_size,dtype,counts", CASES, ids=lambda v: str(v))
def test_lamport_bit_exact_over_rounds(world_size, dtype, counts, monkeypatch):
    tiny_poll_limit(monkeypatch)  # a bug that misses an arrival ends in an error count, not a hang
    wss = workspaces(world_size)
    elem_bytes = torch.tensor([], dtype=dtype).element_size()
    for round_, numel in enumerate(counts + counts[:2]):  # six rounds: the rotation wraps twice
        inputs = random_inputs(world_size, numel, dtype, seed=round_)
        xs = run_call(launchers(wss, dtype, numel), inputs)
        want = bits(in_order_sum(inputs))
        for rank, x in enumerate(xs):
            assert torch.equal(bits(x), want), f"rank {rank} round {round_}: bits differ from the in-order sum"
        assert all(error_counts(ws)["all_reduce"] == 0 for ws in wss)
        assert_every_buffer_rearmed(wss, round_, elem_bytes)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: DTYPES[d])
def test_negative_zero_and_special_values(dtype, monkeypatch):
    """-0.0 (the sentinel's value) arrives as +0.0; sums keep the other one-shots' bits, the
    sign of all-zero sums included; infinities and NaNs cross unchanged."""
    tiny_poll_limit(monkeypatch)
    world_size, numel = 3, 40
    wss = workspaces(world_size)
    inputs = [torch.full((numel,), -0.0, dtype=dtype) for _ in range(world_size)]
    inputs[1][:10] = 0.0  # mixed signs of zero
    inputs[2][10:20] = torch.tensor(1.5, dtype=dtype)
    inputs[0][20:21] = float("inf")
    inputs[1][21:22] = float("-inf")
    inputs[0][22:23] = float("nan")
    launch_of = launchers(wss, dtype, numel)
    for round_ in range(4):
        xs = run_call(launch_of, inputs)
        want = bits(in_order_sum(inputs))
        for rank, x in enumerate(xs):
            assert torch.equal(bits(x), want), f"rank {rank} round {round_}"
        assert all(error_counts(ws)["all_reduce"] == 0 for ws in wss), "a -0.0 input read as not arrived"
    assert int(bits(xs[0])[20]) == int(bits(torch.tensor([float("inf")], dtype=dtype))[0])


def test_dead_peer_counts_an_error_and_ends(monkeypatch):
    """A peer that never launches: the others' waits give up after the poll limit (then at once,
    fail fast), count it in the 'all_reduce' error slot, and the kernel ends; reset_signals
    re-arms the buffers and restarts the rotation."""
    tiny_poll_limit(monkeypatch)
    world_size, numel = 4, 600
    wss = workspaces(world_size)
    inputs = random_inputs(world_size, numel, torch.bfloat16)
    run_call(launchers(wss, torch.bfloat16, numel), inputs, dead=(3,))
    for ws in wss[:3]:
        assert error_counts(ws)["all_reduce"] >= 1, f"rank {ws.rank} did not count the dead peer"
        assert header(ws)[:2] == (1, 0)  # the call ran to its end
    assert error_counts(wss[3])["all_reduce"] == 0
    for ws in wss:
        ws.reset_signals()
        region = ws.regions[LAMPORT_REGION]
        assert int(ws.buffer[region.offset:region.offset + region.nbytes].count_nonzero()) == 0
        assert ws.barrier_errors() == 0
    xs = run_call(launchers(wss, torch.bfloat16, numel), inputs)  # healthy again
    assert all(torch.equal(bits(x), bits(in_order_sum(inputs))) for x in xs)


def test_one_rank_and_empty_launch_nothing():
    wss = workspaces(2)
    launch = launchers(wss, torch.float32, 0)[0]
    x = torch.empty(0)
    assert launch(x) is x and header(wss[0]) == (0, 0, 0)


def test_launcher_rejects_what_it_cannot_serve():
    wss = workspaces(2)
    launch = launchers(wss, torch.bfloat16, 16)[0]
    with pytest.raises(BackendError, match="dtype|prepared for"):
        launch(torch.zeros(16, dtype=torch.float16))
    with pytest.raises(BackendError, match="at most"):
        launch(torch.zeros(LAMPORT_SLOT_BYTES // 2 + 1, dtype=torch.bfloat16))
    with pytest.raises(BackendError, match="contiguous"):
        launch(torch.zeros(32, dtype=torch.bfloat16)[::2])
    region = wss[0].regions[LAMPORT_REGION]
    inside = wss[0].buffer[region.offset + 4096:region.offset + 4096 + 32].view(torch.bfloat16)
    with pytest.raises(BackendError, match="Lamport receive buffers"):
        launch(inside)


def _round_like_kernels(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' fp32 -> dtype cast under the interpreter (bf16 truncates: tests/test_batch_invariance.py)."""
    if dtype is torch.bfloat16:
        return (acc.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return acc.to(dtype)


@pytest.mark.parametrize("world_size", [2, 3])
def test_concurrent_ranks_all_reduce_and_fused_share_the_rotation(world_size):
    """Ranks as concurrent processes (tests/_forked_ranks.py: a peer may run a call ahead, as on
    GPUs), each running five Lamport calls in a row: all-reduces over 3 programs (one holding two
    chunks) and the fused all-reduce + RMSNorm's Lamport variant, whole rows and split rows, which
    no sequential simulation can run (a row's poll has no phase to split at). Every result is the
    fp32 in-order sum's bits (the residual too); out is bit-identical on every rank and within an
    ulp of the formula; afterwards the rotation moved by five, every receive buffer is re-armed,
    every counter is 0 and no wait gave up."""
    from _forked_ranks import run_forked, shared, shared_workspaces
    from _fused_ref import reference, ulps_off

    from autosymm.backends import get_backend
    from autosymm.backends.base import RunContext
    from autosymm.configs import AllReduceConfig, FusedConfig
    from autosymm.problem import Problem

    dtype, numel, rows, hidden, eps = torch.bfloat16, 1000, 3, 256, 1e-6
    wss = shared_workspaces(world_size, all_reduce_bytes=1 << 12, moe_bytes=1 << 12, double_buffer_bytes=0)
    gen = torch.Generator().manual_seed(7)
    calls = ["ar", "fused", "ar", "fused_split", "ar"]
    xs = [[shared(torch.randn(numel if c == "ar" else (rows, hidden), generator=gen).to(dtype))
           for _ in range(world_size)] for c in calls]
    inputs = [[x.clone() for x in per_rank] for per_rank in xs]  # the all-reduce is in place
    residual_in = shared(torch.randn(rows, hidden, generator=gen).to(dtype))
    residuals = [[shared(residual_in.clone()) for _ in range(world_size)] for _ in calls]
    outs = [[shared(torch.zeros(rows, hidden, dtype=dtype)) for _ in range(world_size)] for _ in calls]
    weight = shared((1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype))
    configs = {"ar": AllReduceConfig("lamport", 256, 3, 2), "fused": FusedConfig("lamport", 256, 2, 2),
               "fused_split": FusedConfig("lamport", 256, 2, 4, row_split=2)}

    def body(rank: int) -> None:
        ctx = RunContext(workspace=wss[rank])
        ar = get_backend("triton_lamport").prepare(Problem.all_reduce(2 * numel, "bf16", world_size), configs["ar"],
                                                   ctx)
        fused = {key: get_backend("triton_fused_lamport").prepare(
            Problem.all_reduce_rmsnorm(rows, hidden, "bf16", world_size), configs[key], ctx)
            for key in ("fused", "fused_split")}
        for k, call in enumerate(calls):
            if call == "ar":
                ar(xs[k][rank])
            else:
                fused[call](xs[k][rank], residuals[k][rank], weight, eps, out=outs[k][rank])

    run_forked(world_size, body)
    for k, call in enumerate(calls):
        total = torch.zeros(inputs[k][0].shape, dtype=torch.float32)
        for x in inputs[k]:
            total = total + x.float()
        if call == "ar":
            for rank in range(world_size):
                assert torch.equal(bits(xs[k][rank]), bits(_round_like_kernels(total, dtype))), f"call {k} rank {rank}"
            continue
        want_residual = _round_like_kernels(total + residual_in.float(), dtype)
        _, exact_out = reference(inputs[k], residual_in, weight, eps)
        for rank in range(world_size):
            assert torch.equal(bits(residuals[k][rank]), bits(want_residual)), f"call {k} residual rank {rank}"
            assert torch.equal(bits(outs[k][rank]), bits(outs[k][0])), f"call {k} out rank {rank} differs from rank 0"
        assert ulps_off(outs[k][0], exact_out) <= 1.0, f"call {k}: out more than an ulp off"
    for ws in wss:
        assert header(ws) == (len(calls) % LAMPORT_BUFFERS, 0, 0)
        region = ws.regions[LAMPORT_REGION]
        receive = ws.buffer[region.offset + LAMPORT_HEADER_BYTES:region.offset + region.nbytes]
        assert int(receive.count_nonzero()) == 0, f"rank {ws.rank}: a receive buffer is not re-armed"
        assert error_counts(ws)["all_reduce"] == 0

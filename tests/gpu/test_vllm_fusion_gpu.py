"""The vLLM fusion pass (autosymm.integrations.vllm_fusion, vllm_fusion_quant) on real GPUs (every
local GPU, one process each), with stand-ins of vLLM's ops (tests/_vllm_stand_ins): for each
pattern the pass rewrites (RMSNorm or Gemma RMSNorm, with and without the residual add; RMSNorm
then static FP8 in both QuantFP8 forms, or NVFP4; a Gemma norm before FP8, which fuses
unquantized), inductor's CUDA code calls ``autosymm.vllm_all_reduce_rmsnorm`` or
``autosymm.vllm_all_reduce_rmsnorm_quant`` in place of vLLM's ops, and its outputs match the
unfused step (the stand-ins run eagerly) in both run-time branches, eagerly and in replays of a
CUDA graph of the compiled step with new data (a failure names the pattern, branch and run):

* ``autosymm``: the group's adapter on vLLM's communicator, which serves the call where its
  decision is not NCCL (at one rank: ``noop``, autosymm's one-rank formula; the stand-ins must
  not run); where it decides NCCL the op runs vLLM's ops (the stand-ins must run);
* ``vllm``: no adapter (vLLM without the plugin): the op's fallback runs vLLM's all-reduce, norm
  and quant ops (no vLLM pass in the compile, so no FlashInfer), bit for bit the unfused step.

Tolerances of the autosymm branch against the unfused step (autosymm rounds once from fp32;
vLLM's RMSNorm with a bf16 weight rounds the normalized value, then its product with the weight,
and vLLM's quant reads that rounded output): the new residual / the sum bit-exact (x and the
residual are multiples of 1/8 whose sums are exact in bf16 on up to 8 ranks; the residual and
the weight are the same on every rank); the norm within 2 ulp of bf16; e4m3 values, and NVFP4's
e4m3 block scales and e2m1 codes, within one step of the unfused step's, at least 90% of them
bit-equal. The stand-ins' quant kernels are autosymm's reference formula
(autosymm.epilogue.quantize: vLLM's FP8 kernel bit for bit, its NVFP4 kernel but for its
approximate reciprocals), so the quantized comparisons check the fused path's rounding and
plumbing (items, scale layout, padding), not vLLM's CUDA kernels themselves."""

from __future__ import annotations

import types

import pytest
import torch

from ._dist import requires_cuda, run_on_gpus

pytestmark = [requires_cuda, pytest.mark.gpu]

TOKENS, HIDDEN = 7, 4096
#: The fused calls in inductor's generated code.
FUSED = {False: "torch.ops.autosymm.vllm_all_reduce_rmsnorm.default(",
         True: "torch.ops.autosymm.vllm_all_reduce_rmsnorm_quant.default("}
#: Pattern name -> (residual add, Gemma, quant form of tests/_vllm_stand_ins.chain, the pass's key).
PATTERNS = {
    "add_rms": (True, False, None, "add_rms"), "rms": (False, False, None, "rms"),
    "add_gemma": (True, True, None, "add_gemma"), "gemma": (False, True, None, "gemma"),
    "add_rms_fp8": (True, False, "fp8", "add_rms_fp8"), "rms_fp8": (False, False, "fp8", "rms_fp8"),
    "add_rms_fp8_native": (True, False, "fp8_native", "add_rms_fp8"),
    "rms_fp8_native": (False, False, "fp8_native", "rms_fp8"),
    "add_rms_nvfp4": (True, False, "nvfp4", "add_rms_nvfp4"), "rms_nvfp4": (False, False, "nvfp4", "rms_nvfp4"),
    # vLLM's quantized patterns take no Gemma weight: the norm fuses unquantized, the quant op stays
    "add_gemma_then_fp8": (True, True, "fp8", "add_gemma"),
}
#: vLLM's ops each pattern's unfused step calls (the stand-ins' CALLS names), norm then quant.
_NORM_CALLS = {True: "vllm_ir.fused_add_rms_norm", False: "vllm_ir.rms_norm"}
_QUANT_CALLS = {None: (), "fp8": ("_C.static_scaled_fp8_quant",), "fp8_native": (),
                "nvfp4": ("_C.scaled_fp4_quant.out",)}
#: The static FP8 scale and NVFP4's global scale (float32), before and after the new data.
#: (FP8: 448 * 0.01 = 4.5 clamps the norm's tail; NVFP4: 600 saturates the largest blocks' scales.)
_SCALES = {"fp8": (0.01, 0.03), "fp8_native": (0.01, 0.03), "nvfp4": (336.0, 600.0), None: (1.0, 1.0)}


def _exact_values(gen, shift: int, device) -> torch.Tensor:
    """bf16 [TOKENS, HIDDEN] multiples of 1/8 in [-2, 2] plus ``shift`` / 8 (< 1): a residual plus
    8 ranks' x stays within 25, 200 eighths, so every sum of them, in any order, is exact in bf16."""
    values = torch.randn((TOKENS, HIDDEN), generator=gen, device=device) * 2
    return ((values * 8).round().clamp(-16, 16) + shift).div(8).bfloat16()


def _inputs(gens, rank: int, device, quant) -> list[torch.Tensor]:
    """(x, residual, weight, scale) of one rank: x its own (``gens[1]``), the others the same on
    every rank (``gens[0]``), as vLLM's TP ranks hold them; x and residual exactly summable."""
    return [_exact_values(gens[1], rank, device), _exact_values(gens[0], 0, device),
            torch.randn(HIDDEN, generator=gens[0], device=device).bfloat16(),
            torch.tensor([_SCALES[quant][0]], dtype=torch.float32, device=device)]


def _new_data(args, gens, rank: int, quant) -> None:
    """New x, residual and scale in the same tensors (what a CUDA-graph replay reads)."""
    args[0].copy_(_exact_values(gens[1], rank, args[0].device))
    args[1].copy_(_exact_values(gens[0], 0, args[0].device))
    args[3].fill_(_SCALES[quant][1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _steps(codes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Sign-magnitude codes (e4m3: sign bit 7; e2m1: 3) as signed step counts from 0 (+-0 alike)."""
    codes = codes.to(torch.int32)
    magnitude = codes & ((1 << sign_bit) - 1)
    return torch.where((codes >> sign_bit) & 1 == 1, -magnitude, magnitude)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """NVFP4's packed uint8 [tokens, hidden / 2] as e2m1 codes [tokens, hidden] (even column low)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _within_one_step(what: str, got: torch.Tensor, want: torch.Tensor, sign_bit: int) -> None:
    off = (_steps(got, sign_bit) - _steps(want, sign_bit)).abs()
    assert int(off.max()) <= 1, f"{what}: {int(off.max())} quantization steps off the unfused step's"
    equal = float((off == 0).float().mean())
    assert equal >= 0.9, f"{what}: only {equal:.1%} bit-equal to the unfused step's (rounding alone flips few)"


def _within_ulps(what: str, got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    got, want = got.cpu(), want.cpu()  # nextafter of bf16 on the CPU
    up = torch.nextafter(want, torch.full_like(want, float("inf"))).float() - want.float()
    down = want.float() - torch.nextafter(want, torch.full_like(want, float("-inf"))).float()
    err = (got.float() - want.float()).abs()
    assert bool((err <= ulps * torch.maximum(up, down)).all()), \
        f"{what}: max error {err.max().item()} beyond {ulps} ulp of the unfused step's"


def _compare(what: str, quant, got, want, exact: bool) -> None:
    """``got`` (the compiled step's outputs) against ``want`` (the unfused step's); ``exact``: bit for bit."""
    assert len(got) == len(want), f"{what}: {len(got)} outputs, the unfused step has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} output {i}: {g.dtype} {tuple(g.shape)}, " \
                                                          f"want {w.dtype} {tuple(w.shape)}"
    if exact:
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(_bits(g), _bits(w)), f"{what} output {i}: not bit-equal to the unfused step's"
        return
    assert torch.equal(got[-1], want[-1]), f"{what}: the new residual / the sum is not bit-exact"
    if quant is None:
        _within_ulps(f"{what} norm", got[0], want[0], 2)
    elif quant == "nvfp4":
        _within_one_step(f"{what} e4m3 block scales", got[1].view(torch.uint8), want[1].view(torch.uint8), 7)
        _within_one_step(f"{what} e2m1 codes", _nibbles(got[0]), _nibbles(want[0]), 3)
    else:
        _within_one_step(f"{what} e4m3 values", got[0].view(torch.uint8), want[0].view(torch.uint8), 7)


def _fused_quant(name: str) -> bool:
    """Whether the pattern's quant goes into the fused call (else it stays after it, if any)."""
    return PATTERNS[name][3].endswith(("_fp8", "_nvfp4"))


def _compile(name: str, step, args):
    """``step`` compiled with a fresh pass as inductor's post-grad pre pass (as the plugin installs
    it; vLLM's setting: auto_functionalized v1), run once; checks the rewrite and the generated code."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    from autosymm.integrations import vllm_fusion

    quant, key, fused_quant = PATTERNS[name][2], PATTERNS[name][3], _fused_quant(name)
    fusion = vllm_fusion.VllmAllReduceRMSNormPass()
    options = {vllm_fusion.PRE_PASS_KEY: fusion, "fx_graph_cache": False, "enable_auto_functionalized_v2": False}
    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=False, options=options)
    got, code = run_and_get_code(compiled, *args)
    code = "\n".join(code)
    assert fusion.rewrites == 1 and dict(fusion.patterns) == {key: 1}, f"{name}: the pass made {dict(fusion.patterns)}"
    assert code.count(FUSED[fused_quant]) == 1 and FUSED[not fused_quant] not in code, \
        f"{name}: inductor's code does not hold one {FUSED[fused_quant]}...):\n{code}"
    quant_stays = quant is not None and not fused_quant
    for gone in ("torch.ops.vllm.all_reduce", "torch.ops.vllm_ir.") + (() if quant_stays else ("torch.ops._C.",)):
        assert gone not in code, f"{name}: {gone} is still in inductor's code:\n{code}"
    for kept in () if fused_quant else _QUANT_CALLS[quant]:
        assert f"torch.ops.{kept}" in code, f"{name}: vLLM's {kept} is not after the fused call:\n{code}"
    return compiled, got


def _expect_calls(what: str, name: str, ran: list, served: bool) -> None:
    """The stand-ins that ran: where autosymm served the fused call, only a quant op left after
    it; else vLLM's chain."""
    residual, _, quant, _ = PATTERNS[name]
    after = [] if _fused_quant(name) else list(_QUANT_CALLS[quant])
    want = after if served else ["vllm.all_reduce", _NORM_CALLS[residual], *_QUANT_CALLS[quant]]
    assert ran == want, f"{what}: vLLM's ops that ran in the fused call: {ran}, want {want} (served={served})"


def _replays(name: str, branch: str, compiled, args, serving) -> None:
    """Capture ``compiled`` in a CUDA graph (the adapter in graph mode), replay it twice on new
    data, each against the unfused step on that data. ``serving``: (the adapter, the epilogue
    the op asks it about, the generators of :func:`_inputs`, rank)."""
    from _vllm_stand_ins import CALLS, chain

    adapter, epilogue, gens, rank = serving
    residual, gemma, quant, _ = PATTERNS[name]
    with adapter.capture():  # where the adapter is on the communicator, its graph-mode decision serves
        served = branch == "autosymm" and adapter.serves_fused(args[0], epilogue=epilogue)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compiled(*args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    CALLS.clear()
    with adapter.capture(), torch.cuda.graph(graph):
        outs = compiled(*args)
    _expect_calls(f"{name} ({branch}, captured)", name, list(CALLS), served)
    for trial in range(2):
        _new_data(args, gens, rank, quant)
        graph.replay()
        torch.cuda.synchronize()
        want = chain(residual, gemma, quant)(*args)
        _compare(f"{name} ({branch}, replay {trial})", quant, outs, want, exact=not served)
    del graph


def _run_pattern(name: str, rank: int, adapter, communicator) -> None:
    """One pattern: compile (the autosymm branch), then each branch eagerly (its outputs, the vLLM
    ops that ran) and in CUDA-graph replays."""
    from _vllm_stand_ins import CALLS, chain

    from autosymm.epilogue import Epilogue
    from autosymm.integrations.vllm_fusion_quant import FORMS

    residual, gemma, quant, _ = PATTERNS[name]
    device = adapter.device
    gens = (torch.Generator(device=device).manual_seed(3), torch.Generator(device=device).manual_seed(100 + rank))
    args = _inputs(gens, rank, device, quant)
    step = chain(residual, gemma, quant)
    # the epilogue the fused call asks the adapter about (it passes a zero residual where there is none)
    epilogue = Epilogue(residual=True, gemma=gemma, quant=FORMS[quant] if _fused_quant(name) else None)
    compiled = None
    with torch.no_grad():
        want = step(*args)
        for branch in ("autosymm", "vllm"):
            communicator.autosymm = adapter if branch == "autosymm" else None
            served = branch == "autosymm" and adapter.serves_fused(args[0], epilogue=epilogue)
            CALLS.clear()
            if compiled is None:
                compiled, got = _compile(name, step, args)
            else:
                got = compiled(*args)
            _expect_calls(f"{name} ({branch})", name, list(CALLS), served)
            _compare(f"{name} ({branch}, eager)", quant, got, want, exact=not served)
            if device.type == "cuda":
                _replays(name, branch, compiled, [a.clone() for a in args], (adapter, epilogue, gens, rank))


def _body(rank, world_size, names, device_type="cuda"):
    """Every pattern of ``names`` on this rank (``device_type`` 'cpu': the same checks without CUDA graphs)."""
    import torch.distributed as dist

    from _vllm_stand_ins import define_vllm_quant_stand_ins
    from autosymm.integrations import vllm_ops
    from autosymm.integrations.serving import AutosymmServing

    define_vllm_quant_stand_ins()
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    adapter = AutosymmServing(group=dist.new_group(backend="gloo"), device=device,
                              device_group=dist.group.WORLD)  # what attach puts on the communicator
    communicator = types.SimpleNamespace(autosymm=adapter)
    coordinator = types.SimpleNamespace(device_communicator=communicator, world_size=world_size,
                                        all_reduce=lambda t: torch.ops.vllm.all_reduce(t, "tp:0"))
    vllm_ops.group_coordinator = lambda name: coordinator
    for name in names:
        _run_pattern(name, rank, adapter, communicator)


@pytest.mark.parametrize("quant", [None, "fp8", "fp8_native", "nvfp4"], ids=["plain", "fp8", "fp8_native", "nvfp4"])
def test_the_fused_call_compiles_runs_and_replays_on_gpus(quant):
    run_on_gpus(_body, [name for name, spec in PATTERNS.items() if spec[2] == quant])

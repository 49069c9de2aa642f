"""Backend ``flashinfer_fused``: FlashInfer's fused all-reduce + (residual add) + RMSNorm (+ FP8 /
NVFP4 quant), the call vLLM's ``AllReduceFusionPass`` rewrites to, as a candidate the tuner times
beside the Triton and NCCL backends of ``all_reduce_rmsnorm``, so the database (not vLLM's size
table) decides between them. It serves only where ``flashinfer.comm`` imports; no row of it exists
until a GPU node with FlashInfer tunes.

Invariants: only FlashInfer's "trtllm" (IPC) workspace, never one that needs or may pick NVLink
multicast; one workspace per (process group, fp32-or-16-bit x), created collectively by the first
``prepare`` that needs it, on every rank at the same point, recreated larger for a bigger call,
freed by :func:`close` / :func:`close_all`. The result is FlashInfer's arithmetic, not autosymm's
reference bit for bit (not batch-invariant): the tuner's validation decides whether it may enter
the database at all.

Design notes: docs/BACKENDS.md#backends-flashinfer-fused
"""

from __future__ import annotations

import atexit
import importlib
import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..configs import FlashInferFusedConfig
from ..epilogue import DEFAULT, Epilogue
from ..problem import DTYPES, Problem, next_pow2
from .base import Backend, BackendError, Capabilities, Needs, RunContext

#: FlashInfer's pattern (AllReduceFusionPattern attribute) of each autosymm quant mode.
PATTERNS = {None: "kARResidualRMSNorm", "fp8": "kARResidualRMSNormFP8Quant",
            "nvfp4": "kARResidualRMSNormFP4Quant", "fp8_per_token": "kARResidualRMSNormDynamicFP8Quant"}
#: Rank counts FlashInfer's fused kernels are instantiated for.
WORLD_SIZES = (2, 4, 8, 16)
#: Bytes one FlashInfer thread loads per access: hidden must be a multiple of it in elements.
ACCESS_BYTES = 16
#: FlashInfer's cap on the one-shot Lamport buffer (bytes): INT32_MAX rounded down to 2 MiB.
MAX_COMM_SIZE = 2147483647 & ~((1 << 21) - 1)
#: The only workspace backend asked for: the IPC (multicast-free) one.
WORKSPACE_BACKEND = "trtllm"
#: Fewest tokens a workspace is sized for (rows of the problem's hidden size).
MIN_WORKSPACE_TOKENS = 128
#: What flashinfer.comm must have (vLLM's own check is the first two: allreduce_rms_fusion.py:92-93).
REQUIRED = ("allreduce_fusion", "create_allreduce_fusion_workspace", "AllReduceFusionPattern",
            "QuantizationSFLayout")


def flashinfer_comm() -> tuple[Any, Optional[str]]:
    """(``flashinfer.comm``, None), or (None, why it cannot serve: not importable, or lacking
    the fused API)."""
    try:
        comm = importlib.import_module("flashinfer.comm")
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return None, f"flashinfer not importable ({type(exc).__name__}: {exc})"
    missing = [name for name in REQUIRED if not hasattr(comm, name)]
    if missing:
        return None, f"flashinfer.comm has no {', '.join(missing)} (a FlashInfer without the fused all-reduce API)"
    return comm, None


def has_weight_bias(comm) -> bool:
    """Whether this FlashInfer's ``allreduce_fusion`` takes ``weight_bias`` (the Gemma norm)."""
    try:
        return "weight_bias" in inspect.signature(comm.allreduce_fusion).parameters
    except (TypeError, ValueError):
        return False


def lamport_bytes(problem: Problem) -> int:
    """Bytes of the one-shot Lamport buffer a call needs: world_size x tokens x hidden x (2, or 4
    for fp32 x) (trtllm_ar.py:1117-1121)."""
    elem = 4 if problem.dtype == "fp32" else 2
    return problem.world_size * problem.n_tokens_local * problem.hidden * elem


def strategies(problem: Problem) -> tuple[bool, ...]:
    """The ``use_oneshot`` values FlashInfer really runs for ``problem`` (True: one-shot)."""
    out = []
    if lamport_bytes(problem) <= MAX_COMM_SIZE:
        out.append(True)
    if problem.n_tokens_local > problem.world_size:
        out.append(False)
    return tuple(out)


class FlashInferFused(Backend):
    """FlashInfer's ``allreduce_fusion`` on its IPC workspace: ``launcher(x, residual, weight, eps,
    *, scale=None)`` with autosymm's contract (residual += sum in place where there is one; x,
    weight and scale read only; the outputs new tensors)."""

    name = "flashinfer_fused"
    needs = Needs(dtypes=("bf16", "fp16", "fp32"), intra_node=True, min_compute_capability=(9, 0))

    def why_not(self, problem: Problem, caps: Capabilities, mode: str = "eager") -> Optional[str]:
        if not self.serves(problem.record):
            return super().why_not(problem, caps, mode)
        _, missing = flashinfer_comm()
        if missing:
            return missing
        if tuple(caps.compute_capability) == (0, 0):
            return "not CUDA (no GPU compute capability on this group)"
        return super().why_not(problem, caps, mode)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        comm, missing = flashinfer_comm()
        if missing:
            return missing
        if problem.world_size not in WORLD_SIZES:
            return f"world size {problem.world_size} (FlashInfer's fused kernels serve {WORLD_SIZES})"
        vec = ACCESS_BYTES // problem.elem_bytes
        if problem.hidden % vec:
            return f"hidden {problem.hidden} is not a multiple of {vec} elements (FlashInfer loads 16 bytes per access)"
        epilogue = problem.epilogue or DEFAULT
        pattern = PATTERNS[epilogue.quant]
        if not hasattr(comm.AllReduceFusionPattern, pattern):
            return f"this FlashInfer has no AllReduceFusionPattern.{pattern} (quant={epilogue.quant!r})"
        if epilogue.quant == "nvfp4" and problem.dtype == "fp32":
            return "quant='nvfp4' with fp32 x (FlashInfer's FP4 patterns take fp16/bf16)"
        if epilogue.gemma and not has_weight_bias(comm):
            return "gemma=True, but this FlashInfer's allreduce_fusion has no weight_bias"
        if not strategies(problem):
            return (f"{problem.n_tokens_local} tokens: two-shot needs more than {problem.world_size} (the ranks) "
                    f"and one-shot's {lamport_bytes(problem)} B Lamport buffer exceeds {MAX_COMM_SIZE} B")
        return None

    def search_space(self, problem: Problem) -> list[FlashInferFusedConfig]:
        """One-shot / two-shot (where FlashInfer runs it as asked) x fp32 accumulation or not
        (fp32 x: accumulated in fp32 either way, so only True)."""
        accumulations = (True,) if problem.dtype == "fp32" else (True, False)
        return [FlashInferFusedConfig(use_oneshot=o, fp32_acc=a) for o in strategies(problem) for a in accumulations]

    def prepare(self, problem: Problem, config: Optional[FlashInferFusedConfig], ctx: RunContext) -> "FlashInferLauncher":
        """The launcher of ``problem`` with ``config`` (None: vLLM's settings, FlashInfer's own
        one-shot heuristic and fp32 accumulation, allreduce_rms_fusion.py:243-248, :322)."""
        comm, missing = flashinfer_comm()
        if missing:
            raise BackendError(f"{self.name}: {missing}")
        if config is not None and not isinstance(config, FlashInferFusedConfig):
            raise BackendError(f"{self.name}: config must be a FlashInferFusedConfig, got {type(config).__name__}")
        workspace = workspace_for(comm, ctx.group, problem)
        return FlashInferLauncher(comm, workspace, problem.epilogue or DEFAULT, config)


class FlashInferLauncher:
    """``launcher(x, residual, weight, eps=1e-6, *, scale=None)``: one ``allreduce_fusion`` call.
    Returns out (x's dtype, or fp8), or (out, scales) for fp8_per_token and nvfp4."""

    def __init__(self, comm, workspace, epilogue: Epilogue, config: Optional[FlashInferFusedConfig]) -> None:
        self.call = comm.allreduce_fusion
        self.workspace = workspace
        self.epilogue = epilogue
        self.constants = call_constants(comm, epilogue, config)

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6,
                 *, scale: Optional[torch.Tensor] = None):
        epilogue = self.epilogue
        if epilogue.residual:
            if residual is None:
                raise BackendError("flashinfer_fused: this epilogue adds a residual, but residual is None")
            residual_in = residual_out = residual  # in place, as vLLM passes it
        else:  # vLLM's no-residual form: add zeros; the pre-norm sum goes to a scratch tensor, x stays
            residual_in, residual_out = torch.zeros_like(x), torch.empty_like(x)
        quant_out, scale_out = (None, None) if epilogue.quant is None else \
            epilogue.empty_outputs(x.shape[0], x.shape[1], x.dtype, x.device)
        norm_out = torch.empty_like(x) if epilogue.quant in (None, "fp8", "nvfp4") else None
        self.call(input=x, workspace=self.workspace, output=None, residual_out=residual_out, norm_out=norm_out,
                  quant_out=quant_out, scale_out=scale_out, residual_in=residual_in, rms_gamma=weight,
                  rms_eps=float(eps), scale_factor=scale, **self.constants)
        if epilogue.quant is None:
            return norm_out
        return quant_out if scale_out is None else (quant_out, scale_out)


def call_constants(comm, epilogue: Epilogue, config: Optional[FlashInferFusedConfig]) -> dict[str, Any]:
    """The keyword arguments of every call of a prepared launcher: the pattern, the config's flags,
    the NVFP4 layout, Gemma's weight bias. No PDL: the next kernel is not known to wait for its
    grid dependency, so completion is signalled at the end (allreduce.py:635-643)."""
    constants: dict[str, Any] = {
        "pattern": int(getattr(comm.AllReduceFusionPattern, PATTERNS[epilogue.quant])),
        "launch_with_pdl": False, "trigger_completion_at_end": True,
        "use_oneshot": None if config is None else config.use_oneshot,
        "fp32_acc": True if config is None else config.fp32_acc,
        "layout_code": int(comm.QuantizationSFLayout.SWIZZLED_128x4) if epilogue.quant == "nvfp4" else None,
    }
    if epilogue.gemma:
        constants["weight_bias"] = 1.0
    return constants


# --------------------------------------------------------------------------------------------
# Workspaces: one per (group, fp32 x or not), created collectively, freed on close
# --------------------------------------------------------------------------------------------

_WORKSPACES: dict[tuple, Any] = {}
_AT_EXIT: list[bool] = []


def _group_key(group) -> Any:
    group = group if group is not None else dist.group.WORLD
    return getattr(group, "group_name", None) or id(group)


def workspace_for(comm, group, problem: Problem):
    """The group's FlashInfer workspace for ``problem``: the existing one where it holds the call
    (its ``is_buffer_size_sufficient``), else a new one (collective over ``group``) for
    ``next_pow2(tokens)`` rows of ``hidden`` (at least :data:`MIN_WORKSPACE_TOKENS` rows)."""
    dtype = DTYPES[problem.dtype]
    key = (_group_key(group), problem.dtype == "fp32")
    workspace = _WORKSPACES.get(key)
    if workspace is not None and workspace.is_buffer_size_sufficient(problem.world_size, problem.n_tokens_local,
                                                                     problem.hidden, dtype):
        return workspace
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise BackendError(f"flashinfer_fused: FlashInfer's workspace for {problem.describe()} would be created "
                           "(collectively) inside a CUDA-graph capture; make the call once eagerly first")
    if workspace is not None:
        close_key(key)
    tokens = next_pow2(max(problem.n_tokens_local, MIN_WORKSPACE_TOKENS))
    workspace = comm.create_allreduce_fusion_workspace(
        backend=WORKSPACE_BACKEND, world_size=problem.world_size, rank=dist.get_rank(group), max_token_num=tokens,
        hidden_dim=problem.hidden, dtype=dtype, group=group)
    if getattr(workspace, "backend", None) != WORKSPACE_BACKEND:
        workspace.destroy()
        raise BackendError(f"flashinfer_fused: asked for FlashInfer's {WORKSPACE_BACKEND!r} (multicast-free) workspace, "
                           f"got {getattr(workspace, 'backend', None)!r}")
    _WORKSPACES[key] = workspace
    if not _AT_EXIT:
        atexit.register(close_all)
        _AT_EXIT.append(True)
    return workspace


def close_key(key: tuple) -> None:
    workspace = _WORKSPACES.pop(key, None)
    if workspace is not None:
        workspace.destroy()


def close(group=None) -> None:
    """Free ``group``'s FlashInfer workspaces (local: FlashInfer's destroy drops references)."""
    group_key = _group_key(group)
    for key in [k for k in _WORKSPACES if k[0] == group_key]:
        close_key(key)


def close_all() -> None:
    """Free every FlashInfer workspace this process created."""
    for key in list(_WORKSPACES):
        close_key(key)


flashinfer_fused = FlashInferFused()
BACKENDS = (flashinfer_fused,)

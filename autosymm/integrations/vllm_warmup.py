"""vLLM's own path as a warm-up candidate, and the warm-up itself (vLLM 0.33.0).

:func:`stack_path`: what vLLM runs for a call without autosymm, on one communicator, as the
launchers warm-up tuning times beside autosymm's (autosymm.backends.stack): its all-reduce chain,
its all-gather and reduce-scatter, each with autosymm out of the slot, and for the fused
all-reduce + RMSNorm the form vLLM's graph uses at that call (:data:`FORMS`): FlashInfer's fused
call (``single-rounding``) or vLLM's all-reduce then its ``vllm_ir`` norm (``native-chain``), the
reference a candidate must match. :class:`AutosymmWorker` (named as vLLM's worker where vLLM would
use its own): vLLM's GPU worker whose ``compile_or_warm_up_model`` runs inside
``autosymm.autotune`` with ``AUTOSYMM_STACK_AUTOTUNE``'s budget (default 30 s; off: none), so the
keys the model calls are tuned on every TP rank together and read back at the next start.

Design notes: docs/INTEGRATIONS.md#integrations-vllm-warmup
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from autosymm.backends.stack import StackPath
from autosymm.epilogue import DEFAULT, NATIVE_CHAIN, SINGLE_ROUNDING
from autosymm.problem import Problem

from .serving import stack_warmup

#: The fused call's form per (tokens, hidden, dtype, epilogue key) as vLLM's graph ran it last:
#: 'flashinfer' with its call's parameters, or 'unfused'. Filled by the run-time ops.
FORMS: dict[tuple, tuple[str, dict]] = {}


def form_key(x: torch.Tensor, epilogue) -> tuple:
    return int(x.shape[0]), int(x.shape[1]), x.dtype, (epilogue or DEFAULT).key


def record_form(x: torch.Tensor, epilogue, form: str, params: Optional[dict] = None) -> None:
    """The run-time ops' word: vLLM's graph runs this fused call in ``form`` ('flashinfer' with
    vLLM's op's other arguments ``params``, or 'unfused')."""
    FORMS[form_key(x, epilogue)] = (form, dict(params or {}))


def stack_path(comm, adapter) -> StackPath:
    """vLLM's own path on communicator ``comm`` (an AutosymmCudaCommunicator) whose slot holds
    ``adapter`` (module docstring)."""
    # vLLM is optional: imported only when vLLM runs
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    def bypassing(call: Callable):
        @functools.wraps(call)
        def run(*args, **kwargs):
            with adapter.bypassed():
                return call(*args, **kwargs)
        return run

    vllm_all_reduce = bypassing(functools.partial(CudaCommunicator.all_reduce, comm))
    vllm_all_gather = bypassing(functools.partial(CudaCommunicator.all_gather, comm))
    vllm_reduce_scatter = bypassing(functools.partial(CudaCommunicator.reduce_scatter, comm))

    def all_reduce(problem: Problem):
        def launcher(x: torch.Tensor) -> torch.Tensor:
            return x.copy_(vllm_all_reduce(x))  # the launchers' form: in place
        return launcher

    def all_gather(problem: Problem):
        def launcher(output: torch.Tensor, input: torch.Tensor, counts=None) -> torch.Tensor:
            return output.copy_(vllm_all_gather(input, 0).view(output.shape))
        return launcher

    def reduce_scatter(problem: Problem):
        def launcher(output: torch.Tensor, input: torch.Tensor, counts=None) -> torch.Tensor:
            return output.copy_(vllm_reduce_scatter(input, 0).view(output.shape))
        return launcher

    def fused(problem: Problem):
        form, params = _form_of(problem)
        if form == "flashinfer":
            return _flashinfer_launcher(problem, params)
        return _unfused_launcher(problem, vllm_all_reduce)

    return StackPath("vllm", {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
                              "all_reduce_rmsnorm": fused},
                     formula=_formula, why_not=_why_not)


def _form_of(problem: Problem) -> tuple[str, dict]:
    epilogue = problem.epilogue or DEFAULT
    key = (problem.n_tokens_local, problem.hidden, problem.torch_dtype, epilogue.key)
    return FORMS.get(key, ("unfused", {}))


def _formula(problem: Problem) -> str:
    if problem.epilogue is None:  # not the fused op: its own formula
        return problem.record.formula
    return SINGLE_ROUNDING if _form_of(problem)[0] == "flashinfer" else NATIVE_CHAIN


def _why_not(problem: Problem, mode: str) -> Optional[str]:
    """vLLM's own path is captured only inside vLLM's graph capture (its custom all-reduce
    registers the graph's buffers as that context ends): not timed in graph mode here; nor a
    quantized fused call, whose outputs are the graph's own buffers."""
    if mode == "graph":
        return "vLLM's path is captured only inside vLLM's own graph capture (its buffers registered there)"
    if problem.epilogue is not None and problem.epilogue.quant is not None:
        return "vLLM's quantized chain writes the graph's own buffers (not one callable step)"
    return None


def _flashinfer_launcher(problem: Problem, params: dict):
    """vLLM's FlashInfer fused call with the graph's parameters, on the launcher's buffers:
    the norm into x, the new residual into ``residual`` (vLLM's form with a residual)."""
    op = torch.ops.vllm.flashinfer_trtllm_fused_allreduce_norm.default

    def launcher(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6, *,
                 scale: Optional[torch.Tensor] = None):
        if residual is None:  # vLLM's form without a residual: a zero one, the norm into its own buffer
            out = torch.empty_like(x)
            op(allreduce_in=x, residual=torch.zeros_like(x), rms_gamma=weight, rms_eps=eps, norm_out=out,
               quant_out=None, scale_out=None, scale_factor=None, **params)
            return out
        op(allreduce_in=x, residual=residual, rms_gamma=weight, rms_eps=eps, norm_out=None, quant_out=None,
           scale_out=None, scale_factor=None, **params)
        return x

    return launcher


def _unfused_launcher(problem: Problem, vllm_all_reduce: Callable):
    """vLLM's all-reduce then its fused add + RMSNorm (Gemma: ``1 + w`` in fp32), as its graph
    runs them where its pass does not fuse."""
    gemma = (problem.epilogue or DEFAULT).gemma

    def launcher(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float = 1e-6, *,
                 scale: Optional[torch.Tensor] = None):
        summed = vllm_all_reduce(x)
        norm_weight = weight.float() + 1.0 if gemma else weight
        if residual is None:
            return torch.ops.vllm_ir.rms_norm.default(summed, norm_weight, eps, None)
        out, new_residual = torch.ops.vllm_ir.fused_add_rms_norm.default(summed, residual, norm_weight, eps, None)
        residual.copy_(new_residual)
        return out

    return launcher


@functools.cache
def worker_class():
    """:class:`AutosymmWorker`, built (importing vLLM) on first use."""
    from vllm.v1.worker.gpu_worker import Worker  # vLLM is optional: imported only when vLLM runs

    class AutosymmWorker(Worker):
        """vLLM's GPU worker whose warm-up runs inside autosymm's warm-up tuning (module docstring)."""

        def compile_or_warm_up_model(self, *args, **kwargs):
            with stack_warmup():
                return super().compile_or_warm_up_model(*args, **kwargs)

    AutosymmWorker.__module__ = "autosymm.integrations.vllm_plugin"
    AutosymmWorker.__qualname__ = "AutosymmWorker"  # pickled by reference: vllm_plugin.__getattr__
    return AutosymmWorker

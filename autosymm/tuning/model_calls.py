"""The collective calls a tensor-parallel model makes, from its Hugging Face ``config.json``: what
``autosymm tune --model CONFIG --tp N`` tunes (those keys, every op, no others).

Per forward of ``T`` tokens (each TP rank holds every token's activations) a decoder layer sums
its attention output and its MLP (or MoE) output over the TP group, each ``[T, hidden]`` in the
model's dtype, and the next RMSNorm reads the sum: a serving stack at its defaults fuses the pair
(vLLM's ``AllReduceFusionPass``, autosymm's pass), so the keys are the all-reduce of
``T * hidden`` elements and the fused all-reduce + residual add + RMSNorm at ``h{hidden}``, with
the norm and quant a checkpoint implies (Gemma's ``1 + w``, static FP8, NVFP4). With sequence
parallelism the sum is a reduce-scatter and the next layer's input an all-gather of the same
tensor. A MoE model's experts, with expert parallelism over the TP ranks, add the dp -> ep and
ep -> dp conversions of its routing shape at ``T`` tokens per rank. ``T`` runs over the stack's
CUDA-graph capture sizes (:func:`default_capture_sizes`: vLLM 0.33's default list).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .. import spec
from ..epilogue import Epilogue
from ..problem import DTYPE_NAMES, MoEShape, Problem, any_dtype_name

#: The config fields that hold each number, in the order models use them.
_HIDDEN = ("hidden_size", "d_model", "n_embd")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def default_capture_sizes(max_num_seqs: int = 256, max_size: int = 512) -> list[int]:
    """vLLM 0.33's default CUDA-graph capture sizes (config/vllm.py ``_set_cudagraph_sizes``):
    1, 2, 4, multiples of 8 below 256, multiples of 16 from 256, up to ``min(2 * max_num_seqs,
    max_size)`` tokens (512 on Hopper)."""
    return stack_capture_sizes(1, min(2 * max_num_seqs, max_size))


def stack_capture_sizes(low: int, high: int) -> list[int]:
    """The token counts from ``low`` to ``high`` (inclusive) that vLLM's rule captures: 1, 2, 4,
    multiples of 8 below 256, multiples of 16 from 256."""
    sizes = [s for s in (1, 2, 4) if s <= high] + list(range(8, min(high + 1, 256), 8))
    return [s for s in sizes + list(range(256, high + 1, 16)) if s >= low]


def parse_capture_sizes(text: str) -> list[int]:
    """``--capture-sizes``: '1,2,4,3000' -> those token counts (sorted, each once); 'low:high' ->
    the stack's capture sizes in that range (:func:`stack_capture_sizes`). ValueError naming
    ``text`` otherwise."""
    try:
        if ":" in text:
            low, high = (int(part) for part in text.split(":"))
            if not 1 <= low <= high:
                raise ValueError("low:high needs 1 <= low <= high")
            sizes = stack_capture_sizes(low, high)
        else:
            sizes = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a token list like 1,2,4,8 or a range low:high like 1:512 ({exc})") \
            from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{text!r} holds no token count >= 1 (a list like 1,2,4,8 or a range like 1:512)")
    return sizes


@dataclass(frozen=True)
class ModelShape:
    """What decides a model's collective keys: hidden size, dtype name, MoE routing (or None),
    the fused op's epilogue, and the model's name for messages."""

    name: str
    hidden: int
    dtype: str
    moe: Optional[MoEShape]
    epilogue: Epilogue

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "model") -> "ModelShape":
        """The shape of a Hugging Face config (a ``text_config`` inside a multimodal one serves);
        ValueError naming the field a model without it lacks."""
        text = config.get("text_config") or config
        hidden = _first(text, _HIDDEN, "hidden size")
        dtype_text = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
        dtype = _dtype(dtype_text.removeprefix("torch."))
        experts = _first(text, _EXPERTS, "", default=0)
        moe = MoEShape(hidden, experts, _first(text, _TOP_K, "experts per token")) if experts else None
        gemma = str(text.get("model_type", config.get("model_type", ""))) in _GEMMA_TYPES
        return cls(name, hidden, dtype, moe, Epilogue(residual=True, gemma=gemma, quant=_quant(config)))

    @classmethod
    def from_file(cls, path) -> "ModelShape":
        """The shape of the ``config.json`` at ``path`` (a file, or a model folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the model config {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a model config (a JSON object)")
        return cls.from_config(config, path.parent.name or str(path))


def model_problems(shape: ModelShape, tp: int, capture_sizes: Sequence[int], sequence_parallel: bool = False
                   ) -> list[Problem]:
    """The problems ``shape``'s model calls at TP ``tp`` for each of ``capture_sizes`` tokens (see
    the module docstring), deduplicated, in registry order of their ops."""
    if not isinstance(tp, int) or tp < 2:
        raise ValueError(f"tp={tp!r}: tensor parallelism needs at least 2 ranks")
    if not capture_sizes or min(capture_sizes) < 1:
        raise ValueError(f"capture sizes {list(capture_sizes)} must be token counts >= 1")
    elem = 2 if shape.dtype in ("bf16", "fp16") else 4
    out: list[Problem] = []
    for tokens in sorted(set(capture_sizes)):
        nbytes = tokens * shape.hidden * elem
        if sequence_parallel:
            out += [Problem("reduce_scatter", shape.dtype, tp, nbytes=nbytes),
                    Problem("all_gather", shape.dtype, tp, nbytes=nbytes)]
        else:
            out.append(Problem.all_reduce(nbytes, shape.dtype, tp))
            if shape.epilogue.quant != "nvfp4" or shape.hidden % 16 == 0:
                out.append(Problem.all_reduce_rmsnorm(tokens, shape.hidden, shape.dtype, tp, epilogue=shape.epilogue))
        if shape.moe is not None:
            out += [Problem.moe(op, shape.moe, tokens, shape.dtype, tp) for op in ("dp_to_ep", "ep_to_dp")]
    order = spec.names()
    return sorted(dict.fromkeys(out), key=lambda p: (order.index(p.op), p.bucket))


@dataclass(frozen=True)
class ModelCalls:
    """What ``autosymm tune --model`` asks for: the model's :class:`ModelShape`, the TP world size
    ``tp`` it runs at, the token counts ``capture_sizes`` of its forwards and whether sequence
    parallelism splits its sums (``sequence_parallel``). Plain data: it travels to the workers."""

    shape: ModelShape
    tp: int
    capture_sizes: tuple[int, ...]
    sequence_parallel: bool = False

    def problems(self, world_size: int) -> list[Problem]:
        """The keys the model calls (:func:`model_problems`); ValueError unless ``world_size`` is
        the TP size the model runs at."""
        if world_size != self.tp:
            raise ValueError(f"{self.shape.name} runs at TP {self.tp}: its keys are for {self.tp} ranks, "
                             f"not {world_size}")
        return model_problems(self.shape, self.tp, self.capture_sizes, self.sequence_parallel)

    def describe(self) -> str:
        """'llama-8b (hidden 4096, bf16) at TP 2, 51 token counts 1..512'."""
        sizes = self.capture_sizes
        moe = f", MoE {self.shape.moe.key}" if self.shape.moe is not None else ""
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return (f"{self.shape.name} (hidden {self.shape.hidden}, {self.shape.dtype}{moe}) at TP {self.tp}{sp}, "
                f"{len(sizes)} token count(s) {min(sizes)}..{max(sizes)}")


def _first(config: dict, names: Sequence[str], what: str, default: Optional[int] = None) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    if default is not None:
        return default
    raise ValueError(f"the model config has no {what} (looked for {', '.join(names)})")


def _dtype(text: str) -> str:
    dtype = getattr(torch, text, None)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"the model's dtype {text!r} is not one autosymm's kernels compute in "
                         f"({', '.join(any_dtype_name(d) for d in DTYPE_NAMES)})")
    return DTYPE_NAMES[dtype]


def _quant(config: dict) -> Optional[str]:
    """The fused op's output quant a checkpoint's ``quantization_config`` implies: static FP8
    activations ('fp8'), NVFP4 ('nvfp4'), else None (the norm's output in the model's dtype)."""
    quant = config.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    algo = str(quant.get("quant_algo", "")).lower()
    if method in ("modelopt_fp4", "nvfp4") or "nvfp4" in algo or "fp4" in algo:
        return "nvfp4"
    if method in ("fp8", "modelopt") and str(quant.get("activation_scheme", "static")).lower() == "static":
        return "fp8"
    return None

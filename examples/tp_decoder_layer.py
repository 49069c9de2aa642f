"""A tensor-parallel Llama-style decoder layer with a pluggable all-reduce (NCCL, torch symm_mem, autosymm).

The layer (Llama-3-70B sizes by default: hidden 8192, intermediate 28672, 64 query heads, 8
KV heads of 128, bf16; random weights, no RoPE — it changes no communication):

    x = x + AllReduce(Attention(RMSNorm(x)) @ W_o)        QKV column-parallel, O row-parallel
    x = x + AllReduce((silu(gate) * up)(RMSNorm(x)) @ W_down)   gate/up column-parallel, down row-parallel

Each rank holds 1/world_size of the heads and of the intermediate features; the activations
``x`` [n_tokens, hidden] are replicated, so two all-reduces of n_tokens * hidden elements per layer.

* ``decode(x)``: ``x`` holds one new token for each of n_tokens sequences; each attends to a KV
  cache of ``context`` positions (random, fixed, read-only) plus itself. The cache is not
  appended to, so a step is repeatable (what a benchmark wants) and costs what a decode step
  of a ``context + 1``-token sequence costs.
* ``prefill(x)``: ``x`` is one sequence of n_tokens, causal attention (scaled_dot_product_attention).

The all-reduce is a callable ``all_reduce(t) -> t`` (in place): see ``make_all_reduce``. One that
has a ``fused(y, residual, weight, eps)`` attribute (backend ``autosymm_fused``:
``autosymm.all_reduce_rmsnorm``) serves the first all-reduce together with the residual add and
the MLP's RMSNorm in one call.
Under ``compile_step`` (torch.compile with autosymm's fusion pass) the plain ``autosymm`` backend
gets the same fused call without the layer asking for it.
Run ``scripts/bench_tp_layer.py`` to time it with each all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerConfig:
    """Sizes of the whole (unsplit) layer."""

    hidden: int = 8192
    intermediate: int = 28672
    n_heads: int = 64
    n_kv_heads: int = 8
    context: int = 512  # decode: KV-cache positions each new token attends to
    max_batch: int = 128  # decode: sequences the KV cache holds
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def check(self, world_size: int) -> None:
        for name in ("n_heads", "n_kv_heads", "intermediate"):
            if getattr(self, name) % world_size:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by world size {world_size}")


LLAMA_70B = LayerConfig()
TINY = LayerConfig(hidden=64, intermediate=128, n_heads=4, n_kv_heads=2, context=8, max_batch=8)


class ShardWeights(torch.nn.Module):
    """This rank's shard of the layer's weights: random, seeded by ``seed`` and the rank; the
    RMSNorm weights (replicated, like the activations) by ``seed`` alone."""

    def __init__(self, cfg: LayerConfig, rank: int, world_size: int, dtype: torch.dtype, device, seed: int = 0):
        super().__init__()
        cfg.check(world_size)
        self.cfg = cfg
        self.n_heads = cfg.n_heads // world_size
        self.n_kv_heads = cfg.n_kv_heads // world_size
        inter = cfg.intermediate // world_size
        d = cfg.head_dim
        replicated = torch.Generator(device=device).manual_seed(seed * 7919)
        gen = torch.Generator(device=device).manual_seed(seed * 7919 + 1 + rank)

        def weight(*shape, fan_in, generator=gen):
            w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) / math.sqrt(fan_in)
            return torch.nn.Parameter(w.to(dtype), requires_grad=False)

        self.norm1 = weight(cfg.hidden, fan_in=1, generator=replicated)
        self.norm2 = weight(cfg.hidden, fan_in=1, generator=replicated)
        self.wqkv = weight((self.n_heads + 2 * self.n_kv_heads) * d, cfg.hidden, fan_in=cfg.hidden)
        self.wo = weight(cfg.hidden, self.n_heads * d, fan_in=cfg.n_heads * d)
        self.w_gate_up = weight(2 * inter, cfg.hidden, fan_in=cfg.hidden)
        self.w_down = weight(cfg.hidden, inter, fan_in=cfg.intermediate)
        cache = (cfg.max_batch, self.n_kv_heads, cfg.context, d)
        self.register_buffer("k_cache", torch.randn(cache, generator=gen, device=device).to(dtype))
        self.register_buffer("v_cache", torch.randn(cache, generator=gen, device=device).to(dtype))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class TPDecoderLayer(torch.nn.Module):
    """The layer over ``weights`` with ``all_reduce`` after the two row-parallel projections."""

    def __init__(self, weights: ShardWeights, all_reduce: AllReduce):
        super().__init__()
        self.w = weights
        self.all_reduce = all_reduce

    def _qkv(self, x: torch.Tensor):
        w, d = self.w, self.w.cfg.head_dim
        qkv = _rms_norm(x, w.norm1, w.cfg.eps) @ w.wqkv.t()
        q, k, v = qkv.split([w.n_heads * d, w.n_kv_heads * d, w.n_kv_heads * d], dim=-1)
        return q, k, v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """O projection + all-reduce + residual (+ the MLP's RMSNorm: one fused call where the
        all-reduce offers ``fused``), then the MLP + all-reduce + residual."""
        w = self.w
        fused = getattr(self.all_reduce, "fused", None)
        if fused is not None:  # residual += all_reduce(o); h = rmsnorm(residual) * norm2, one kernel
            residual = x.clone()
            h = fused(attn @ w.wo.t(), residual, w.norm2, w.cfg.eps)
            x = residual
        else:
            x = x + self.all_reduce(attn @ w.wo.t())
            h = _rms_norm(x, w.norm2, w.cfg.eps)
        gate, up = (h @ w.w_gate_up.t()).chunk(2, dim=-1)
        return x + self.all_reduce((F.silu(gate) * up) @ w.w_down.t())

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """One decode step: ``x`` [n_sequences, hidden], one new token per sequence."""
        w, d = self.w, self.w.cfg.head_dim
        n = x.shape[0]
        if n > w.cfg.max_batch:
            raise ValueError(f"decode of {n} sequences: the KV cache holds max_batch={w.cfg.max_batch}")
        q, k, v = self._qkv(x)
        group = w.n_heads // w.n_kv_heads
        q = q.view(n, w.n_kv_heads, group, d)
        k_cache, v_cache = w.k_cache[:n], w.v_cache[:n]  # [n, kv heads, context, d]
        scores = torch.cat([q @ k_cache.transpose(-1, -2), q @ k.view(n, w.n_kv_heads, d, 1)], dim=-1)
        probs = torch.softmax(scores.float() / math.sqrt(d), dim=-1).to(x.dtype)
        context = w.cfg.context
        attn = probs[..., :context] @ v_cache + probs[..., context:] @ v.view(n, w.n_kv_heads, 1, d)
        return self._finish(x, attn.reshape(n, w.n_heads * d))

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """A prefill of one sequence: ``x`` [n_tokens, hidden], causal attention."""
        w, d = self.w, self.w.cfg.head_dim
        n = x.shape[0]
        q, k, v = self._qkv(x)
        q = q.view(n, w.n_heads, d).transpose(0, 1).unsqueeze(0)
        group = w.n_heads // w.n_kv_heads
        k, v = (t.view(n, w.n_kv_heads, d).transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
                for t in (k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self._finish(x, attn.squeeze(0).transpose(0, 1).reshape(n, w.n_heads * d))


# ------------------------------------------------------------------------------------------
# The all-reduces
# ------------------------------------------------------------------------------------------

_TORCH_SYMM: dict[str, Callable] = {}  # algorithm -> autosymm's torch_symm launcher (in place)


@torch.library.custom_op("tp_layer_example::symm_mem_all_reduce_", mutates_args=("x",))
def _symm_mem_all_reduce_(x: torch.Tensor, algorithm: str) -> None:
    """torch.ops.symm_mem one/two-shot, staged through a symmetric buffer (opaque to compile)."""
    _TORCH_SYMM[algorithm](x)


@_symm_mem_all_reduce_.register_fake
def _(x: torch.Tensor, algorithm: str) -> None:
    return None


def _torch_symm(algorithm: str, group, max_bytes: int, dtype: torch.dtype) -> AllReduce:
    """torch's symm_mem ``algorithm`` ('one_shot' | 'two_shot') with the copy a plain tensor
    needs (through autosymm's torch_symm backend: a staging buffer of ``max_bytes``).
    Collective: every rank must call it together."""
    from autosymm.backends import RunContext, get_backend
    from autosymm.problem import Problem, dtype_name

    problem = Problem.all_reduce(max_bytes, dtype_name(dtype), dist.get_world_size(group))
    _TORCH_SYMM[algorithm] = launcher = get_backend(f"torch_{algorithm}").prepare(problem, None, RunContext(group))
    op = torch.ops.tp_layer_example.symm_mem_all_reduce_

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            op(t, algorithm)
        else:
            launcher(t)  # eager: no op-dispatcher overhead
        return t

    return all_reduce


def _autosymm(group, fused: bool = False) -> AllReduce:
    """autosymm's all-reduce; ``fused``: with ``.fused``, autosymm.all_reduce_rmsnorm, which the
    layer then calls for its first all-reduce and the RMSNorm after it."""
    import autosymm

    autosymm.init(group)
    call = autosymm.all_reduce
    try:
        import autosymm.ops  # noqa: F401  (torch.ops.autosymm: traceable by torch.compile)
    except ImportError:  # without the custom ops, a compiled layer breaks the graph here on purpose
        call = torch.compiler.disable(call)

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        call(t, group=group, op="sum")
        return t

    if fused:
        all_reduce.fused = lambda y, residual, weight, eps: autosymm.all_reduce_rmsnorm(y, residual, weight, eps,
                                                                                         group=group)
    return all_reduce


def _nccl(group) -> AllReduce:
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return all_reduce


def compile_step(fn: Callable, *, fuse: bool = True, cuda_graphs: bool = True, dynamic=None) -> Callable:
    """``torch.compile(fn)`` with inductor's CUDA graphs (what ``mode="reduce-overhead"`` sets) and,
    with ``fuse``, autosymm's pass that rewrites all-reduce -> residual add -> RMSNorm into
    ``torch.ops.autosymm.all_reduce_rmsnorm`` (here: the first all-reduce of ``_finish`` and the
    MLP's RMSNorm, as the ``autosymm_fused`` backend calls it by hand)."""
    options: dict = {"triton.cudagraphs": cuda_graphs}
    if fuse:
        from autosymm.integrations.fusion_pass import AllReduceRMSNormPass

        options["post_grad_custom_post_pass"] = AllReduceRMSNormPass()
    return torch.compile(fn, options=options, dynamic=dynamic)


BACKENDS = ("nccl", "torch_one_shot", "torch_two_shot", "autosymm", "autosymm_fused")


def make_all_reduce(backend: str, group=None, max_bytes: int = 1 << 20,
                    dtype: torch.dtype = torch.bfloat16) -> AllReduce:
    """The in-place sum over ``group`` of one of BACKENDS; ``max_bytes``/``dtype``: the largest
    tensor the torch symm_mem staging buffer must hold. Collective (every rank, same order)."""
    if backend == "nccl":
        return _nccl(group)
    if backend in ("autosymm", "autosymm_fused"):
        return _autosymm(group, fused=backend == "autosymm_fused")
    if backend in ("torch_one_shot", "torch_two_shot"):
        return _torch_symm(backend.removeprefix("torch_"), group, max_bytes, dtype)
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")

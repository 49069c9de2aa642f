"""autosymm's collectives as torch custom ops, ``torch.ops.autosymm.*``: graph nodes for torch.compile.

    autosymm::all_reduce_(Tensor(a!) tensor, str op, str group_name) -> ()
    autosymm::all_reduce(Tensor tensor, str op, str group_name) -> Tensor
    autosymm::dp_to_ep(Tensor src, Tensor[] assignment, SymInt[] n_expts_per_shard, Tensor expt_indx,
                       Tensor gate_indx, str group_name) -> Tensor
    autosymm::ep_to_dp(Tensor src, Tensor[] assignment, SymInt[] n_expts_per_shard, Tensor expt_indx,
                       Tensor topk_indx, str group_name) -> Tensor
    autosymm::all_reduce_rmsnorm(Tensor(a0!) x, Tensor(a1!)? residual, Tensor weight, float eps,
                                 str group_name, bool gemma=False, str? quant=None,
                                 Tensor? scale=None) -> Tensor
    autosymm::all_reduce_rmsnorm_quant(Tensor(a0!) x, Tensor(a1!)? residual, Tensor weight, float eps,
                                       str group_name, bool gemma, str quant,
                                       Tensor? scale) -> (Tensor, Tensor)
    autosymm::reduce_scatter_tensor(Tensor input, str op, int group_size, str group_name) -> Tensor
    autosymm::all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor
    autosymm::all_reduce_rmsnorm_functional(Tensor x, Tensor? residual, Tensor weight, float eps,
                                            str group_name, bool gemma=False) -> (Tensor out, Tensor new_residual)

The fused op's epilogues (autosymm.epilogue): ``all_reduce_rmsnorm`` returns one tensor (``quant``
None: x's dtype; "fp8": float8_e4m3fn), ``all_reduce_rmsnorm_quant`` two ("fp8_per_token": out and
its [tokens, 1] scales; "nvfp4": the packed values and the swizzled block scales); each refuses the
other's quant modes. Only the unquantized epilogues have a functional, differentiable form.

``op`` is a reduce op's name ("sum", "avg", "max", "min", "product", "band", "bor", "bxor");
``group_name`` the name torch.distributed resolves a group by (``group.group_name``; see
:func:`autosymm.dist_compat.group_name`), as torch's ``symm_mem`` and functional collectives take
it. ``assignment`` is an ExptAssignment's tensors ``[expt_bitmask, expt_boolmask, expt_map,
expt_owner]`` and ``n_expts_per_shard`` its list: the op rebuilds the dataclass from them (no
device work, no host sync), so a compiled graph passes only tensors and ints.

Each op is declared by its op's door (autosymm.collectives) and registered here, iterating
``DOORS``. Its implementation is the door's eager path: the cached prepared call of its call key
(autosymm.spec.CallKey), where the mode is read when the op runs, so a call inside a
CUDA graph capture (inductor's ``mode="reduce-overhead"`` included) takes the graph-mode rows, and
the dispatcher decides once per key, not per call. ``autosymm.all_reduce`` and the conversions
call these ops only while torch.compile traces (or for a tensor subclass); eager calls of plain
tensors go straight to the runtime, without the op dispatcher's overhead.

Aliasing. ``all_reduce_`` mutates its input (torch.compile functionalizes it through
``auto_functionalize`` and inductor re-inplaces it). ``all_reduce`` returns a new tensor: a
contiguous copy of the input reduced in place. The MoE conversions are *functional*: they return
a tensor the caller owns, a copy of the workspace rows the peers wrote. Their eager form returns
those rows as a workspace view valid until the next call of the same op, an alias a compiled
graph cannot see (it may reorder, fuse or keep two results alive at once). An ``out=`` variant
would not save the copy, since the rows must land in symmetric memory that peers write, and
``out`` is a plain tensor; it would only save an allocation, which the caching allocator (and a
CUDA graph's private pool) makes nearly free, at the price of a mutating op. So: clone out.

Autograd. The functional ops (``all_reduce``, ``all_reduce_rmsnorm_functional``, ``dp_to_ep``,
``ep_to_dp``) carry the formulas of autosymm.collectives.autograd (torch.distributed.nn.functional's where it
has one), ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` theirs (each the other's
gradient: autosymm.collectives.reduce_scatter / all_gather); the mutating ones have none (torch cannot differentiate a custom op that mutates), so
``autosymm.all_reduce`` and ``autosymm.all_reduce_rmsnorm`` take the functional op and copy back
when an input requires grad.
"""

from __future__ import annotations

import torch

from .collectives import DOORS

__all__ = ["OPS"]


def _register() -> dict:
    """Register every door's custom ops (registry order) under ``autosymm::<name>``."""
    ops = {}
    for door in DOORS:
        for op in door.custom_ops():
            registered = torch.library.custom_op(f"autosymm::{op.name}", op.impl, mutates_args=op.mutates_args)
            registered.register_fake(op.fake)
            if op.backward is not None:
                registered.register_autograd(op.backward, setup_context=op.setup_context)
            ops[op.name] = registered
    return ops


#: op name -> its registered custom op (``torch.ops.autosymm.<name>`` is the same op).
OPS = _register()

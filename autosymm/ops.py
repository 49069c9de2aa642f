"""autosymm's collectives as torch custom ops, ``torch.ops.autosymm.*``: graph nodes for torch.compile.

Each op is declared by its op's door (autosymm.collectives: ``Door.custom_ops``) and registered
here, iterating ``autosymm.collectives.doors()`` (the shipped ops' doors, at import). Its
implementation is the door's eager path: the cached prepared call of its call key
(autosymm.spec.CallKey), the mode read when the op runs, so a call inside a CUDA graph capture
takes the graph-mode rows. Eager calls of plain tensors skip these ops and go straight to
the runtime. Aliasing: ``all_reduce_`` mutates its input; ``all_reduce`` and the MoE conversions
are functional (a new tensor the caller owns). Autograd: the functional ops carry the formulas of
autosymm.collectives.autograd; the mutating ones have none. The schemas and the reasons behind
these choices are in the design notes.

Design notes: docs/DISPATCH.md#ops
"""

from __future__ import annotations

import torch

from .collectives import doors

__all__ = ["OPS"]


def _register() -> dict:
    """Register every door's custom ops (registry order) under ``autosymm::<name>``."""
    ops = {}
    for door in doors():
        for op in door.custom_ops():
            registered = torch.library.custom_op(f"autosymm::{op.name}", op.impl, mutates_args=op.mutates_args)
            registered.register_fake(op.fake)
            if op.backward is not None:
                registered.register_autograd(op.backward, setup_context=op.setup_context)
            ops[op.name] = registered
    return ops


#: op name -> its registered custom op (``torch.ops.autosymm.<name>`` is the same op).
OPS = _register()

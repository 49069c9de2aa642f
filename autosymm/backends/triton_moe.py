"""MoE dp->ep / ep->dp backend ``triton_moe``: the symmetric-memory conversion kernels.

Launchers (autosymm.backends.base): dp_to_ep ``launcher(src, assignment, expt_indx, gate_indx)
-> dst [n_tokens_global * k, d_model]``, ep_to_dp ``launcher(src, assignment, expt_indx,
topk_indx) -> dst [n_tokens_local * k, d_model]`` (autosymm.routing; rows of dropped pairs left
unwritten). ``dst`` is a workspace view, valid until the next call of the same op by any rank.
The two ops own disjoint parts of the MoE region and end with a barrier, so the cycle dp->ep ->
experts -> ep->dp needs no host sync; one op called twice while its first result is still read
needs a copy or a host barrier between. Waits are bounded: failures are reported after the fact
(``Workspace.barrier_errors()``, then ``Workspace.reset_signals()`` on every rank).

Design notes: docs/BACKENDS.md#backends-triton-moe
"""

from __future__ import annotations

from typing import Optional

import torch

from ..configs import MoEConfig, moe_space
from ..spec import DP_TO_EP, EP_TO_DP
from ..problem import DTYPES, Problem, next_pow2
from ..geometry import MOE_REGION, MOE_SIGNAL_SLOT, dst_rows, grid_rows, moe_buffer, moe_region_bytes
from .base import Backend, BackendError, Capabilities, Needs, RunContext
from .launch import LeanLauncher
from .moe_inputs import check_inputs, shape_reason

#: The end barrier is fused into the copy kernel when the grid has at most this many programs
#: (each program adds one acq_rel.sys atomic), else barrier._barrier_kernel runs after it. On
#: 2 x H200 (DeepSeek-V3 rows, best configs) fusing saved ~9 us per call in eager mode at 8
#: tokens per rank (one launch fewer) and was within -1.1..+0.4 us under graph replay; at 128
#: tokens (1024-program grids) it cost up to 3.7 us under graph replay.
FUSED_BARRIER_MAX_PROGRAMS = 256
#: Config of a conversion no database row serves (TritonMoE.fallback_config).
DEFAULT_MOE_CONFIG = MoEConfig(block_n=4096, num_warps=8, rows_per_program=2, num_blocks=0)


def _vec(d_model: int, elem_bytes: int) -> int:
    """Largest power-of-two element count <= 16 bytes dividing d_model."""
    vec = 16 // elem_bytes
    while d_model % vec:
        vec //= 2
    return vec


class Conversion:
    """``op``'s kernel and end barrier bound to a workspace and a config; no input checks (the
    launcher of :meth:`TritonMoE.prepare` validates). Launches go through LeanLauncher (argument
    binding skipped after the first call), one per specialisation of the kernel."""

    def __init__(self, op: str, ws, config: MoEConfig) -> None:
        # The kernels load with the first Conversion (a workspace exists): a group without one,
        # a CPU group, asks this backend why not and never imports a Triton kernel.
        from ..kernels.barrier import _barrier_kernel
        from ..kernels.moe_conversion import _convert_dp_to_ep, _convert_ep_to_dp  # Triton, as above

        self.kernel_fn = _convert_dp_to_ep if op == DP_TO_EP.name else _convert_ep_to_dp
        self.op, self.ws, self.config = op, ws, config
        self.world_size, self.rank = ws.world_size, ws.rank
        self.dst_ptrs = ws.region_ptrs(MOE_REGION, moe_buffer(op, ws.capacity(MOE_REGION), ws.world_size)[0])
        self.signal_ptrs = _signal_ptrs(ws, op)
        self._kernels: dict[tuple, LeanLauncher] = {}
        self._barrier = LeanLauncher(_barrier_kernel, (1,), dict(RANK=ws.rank, WORLD_SIZE=ws.world_size),
                                     num_warps=1)

    def __call__(self, src: torch.Tensor, expt_owner: torch.Tensor, expt_indx: torch.Tensor, indx: torch.Tensor,
                 fused_barrier: Optional[bool] = None) -> None:
        """Run the conversion. ``fused_barrier`` None: the config's ``fused_barrier`` if it has
        one, else fused for grids of at most FUSED_BARRIER_MAX_PROGRAMS programs."""
        world_size, config = self.world_size, self.config
        n_expts_act = expt_indx.shape[1]
        n_tokens_local = expt_indx.shape[0] // world_size
        d_model = src.shape[1]
        groups = -(-grid_rows(self.op, n_tokens_local, n_expts_act, world_size) // config.rows_per_program)
        grid = min(config.num_blocks, groups) if config.num_blocks else groups
        if fused_barrier is None:  # a config may say (a future MoEConfig field); else by grid size
            fused_barrier = getattr(config, "fused_barrier", None)
        if fused_barrier is None:
            fused_barrier = grid <= FUSED_BARRIER_MAX_PROGRAMS
        fused = world_size > 1 and grid > 0 and bool(fused_barrier)
        vec = _vec(d_model, src.element_size())
        if grid > 0:
            # One LeanLauncher per specialisation: grid, constexprs, dtypes and pointer alignment.
            key = (grid, fused, src.dtype, vec, n_expts_act, expt_indx.dtype, indx.dtype, src.data_ptr() % 16 == 0,
                   expt_owner.data_ptr() % 16 == 0, expt_indx.data_ptr() % 16 == 0, indx.data_ptr() % 16 == 0)
            kernel = self._kernels.get(key) or self._kernel(key)
            kernel(self.dst_ptrs, src, expt_owner, expt_indx, indx, self.signal_ptrs, n_tokens_local,
                   expt_owner.numel(), d_model // vec)
        if world_size > 1 and not fused:
            self._barrier(self.signal_ptrs)

    def _kernel(self, key: tuple) -> LeanLauncher:
        grid, fused, _, vec, n_expts_act = key[:5]
        rows = self.config.rows_per_program
        constexprs = dict(N_EXPTS_ACT=n_expts_act, RANK=self.rank, WORLD_SIZE=self.world_size, VEC=vec,
                          BLOCK_N=self.config.block_n, ROWS=rows, ROWS_PAD=next_pow2(rows), FUSED_BARRIER=fused)
        kernel = self._kernels[key] = LeanLauncher(self.kernel_fn, (grid,), constexprs,
                                                   num_warps=self.config.num_warps)
        return kernel


def launch(op: str, ws, config: MoEConfig, src: torch.Tensor, expt_owner: torch.Tensor, expt_indx: torch.Tensor,
           indx: torch.Tensor, *, fused_barrier: Optional[bool] = None) -> None:
    """One unchecked conversion on ``ws`` (tests and tools; launchers keep their Conversion)."""
    Conversion(op, ws, config)(src, expt_owner, expt_indx, indx, fused_barrier)


def _signal_ptrs(ws, op: str) -> torch.Tensor:
    """int64 [world_size + 1]: each rank's program MOE_SIGNAL_SLOT[op] of the 'moe_end' channel, then
    this rank's error slot of that channel (autosymm.workspace.symm.Workspace.signal_ptrs)."""
    return ws.signal_ptrs("moe_end", MOE_SIGNAL_SLOT[op])


class TritonMoE(Backend):
    """The Triton conversion kernels writing into the workspace's MoE region."""

    name = "triton_moe"
    batch_invariant = True  # rows are copied, never summed
    needs = Needs(compiles_kernels=True, workspace_region=MOE_REGION, intra_node=True)

    def why_not(self, problem: Problem, caps: Capabilities, mode: str = "eager") -> Optional[str]:
        """The contract of Backend.why_not, then room: the output must fit this op's buffer of
        the MoE region the call can have (eager: the region may grow, Capabilities.moe_room)."""
        reason = super().why_not(problem, caps, mode)
        if reason is None:
            need, room = buffer_bytes(problem), caps.moe_room(mode)
            have = moe_buffer(problem.op, room, problem.world_size)[1]
            if need > have:
                grown = " (after growing the region to its limit)" if room > caps.moe_bytes else ""
                reason = f"needs {need} bytes, the MoE workspace buffer has {have}{grown}"
                if mode == "graph":  # nothing grows inside a capture: only a declaration reserves it
                    reason += (f"; reserve it before capturing: autosymm.init(moe=[autosymm.MoEPlan("
                               f"'{problem.shape_key}', {problem.n_tokens_local})])")
        return reason

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        return shape_reason(problem)

    def fallback_config(self, problem: Problem) -> MoEConfig:
        """Used where no database row serves a conversion: wide rows, two per program."""
        return DEFAULT_MOE_CONFIG

    def search_space(self, problem: Problem) -> list[MoEConfig]:
        rows = grid_rows(problem.op, problem.n_tokens_local, problem.shape.n_expts_act, problem.world_size)
        return moe_space(problem.shape.d_model, rows)

    def prepare(self, problem: Problem, config: Optional[MoEConfig], ctx: RunContext):
        ws = ctx.workspace
        if ws is None:
            raise BackendError(f"{self.name} needs a symmetric-memory workspace (RunContext.workspace is None)")
        if ws.world_size != problem.world_size:
            raise BackendError(f"workspace has world size {ws.world_size}, the problem {problem.world_size}")
        if not isinstance(config, MoEConfig):
            raise BackendError(f"{self.name} needs a MoEConfig, got {config!r}")
        op, shape, world_size = problem.op, problem.shape, ws.world_size
        offset, capacity = moe_buffer(op, ws.capacity(MOE_REGION), world_size)
        conversion = Conversion(op, ws, config)
        dtype = DTYPES[problem.dtype]
        row_bytes = shape.d_model * problem.elem_bytes
        views: dict[int, torch.Tensor] = {}

        def launcher(src, assignment, expt_indx, indx):
            n_tokens_local = check_inputs(problem, ws.device, world_size, src, assignment, expt_indx, indx)
            rows = dst_rows(op, n_tokens_local, shape.n_expts_act, world_size)
            dst = views.get(rows)
            if dst is None:
                if rows * row_bytes > capacity:
                    raise BackendError(f"{op}: the [{rows}, {shape.d_model}] {dtype} output needs "
                                       f"{rows * row_bytes} bytes, the MoE workspace buffer has {capacity} "
                                       f"(declare the call: autosymm.init(moe=[autosymm.MoEPlan(...)]))")
                dst = views[rows] = ws.local_view(MOE_REGION, (rows, shape.d_model), dtype, offset)
            conversion(src, assignment.expt_owner, expt_indx, indx)
            return dst

        return launcher


def buffer_bytes(problem: Problem) -> int:
    """Bytes of ``problem``'s output buffer in the MoE region."""
    return dst_rows(problem.op, problem.n_tokens_local, problem.shape.n_expts_act, problem.world_size) \
        * problem.shape.d_model * problem.elem_bytes


def region_bytes_for(problem: Problem) -> int:
    """Bytes of a MoE region in which both ops of ``problem``'s size fit (geometry.moe_region_bytes)."""
    return moe_region_bytes(problem.n_tokens_local, problem.shape.n_expts_act,
                            problem.shape.d_model * problem.elem_bytes, problem.world_size)


def fits(problem: Problem, moe_bytes: int) -> bool:
    """Does ``problem``'s output fit its op's buffer of a MoE region of ``moe_bytes``?"""
    return buffer_bytes(problem) <= moe_buffer(problem.op, moe_bytes, problem.world_size)[1]


TRITON_MOE = TritonMoE()

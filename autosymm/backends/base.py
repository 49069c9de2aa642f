"""What every backend is: a named way to run one or more ops, with a config space.

A backend never decides; it answers three questions for the tuner and the dispatcher:

* ``unsupported_reason(problem, caps)``: None when it can serve ``problem`` on a group with
  capabilities ``caps``, else a short reason ("no multicast", "dtype fp32", ...);
* ``search_space(problem)``: the configs worth trying ([None] for backends without any);
* ``prepare(problem, config, ctx)``: a launcher bound to everything but the tensors, so a
  repeated call costs one Python call plus the kernel launch.

Launchers:
  all_reduce: ``launcher(x) -> x`` (sum in place over the group);
  dp_to_ep:   ``launcher(src, assignment, expt_indx, gate_indx) -> dst`` (this rank's EP buffer);
  ep_to_dp:   ``launcher(src, assignment, expt_indx, topk_indx) -> dst`` (this rank's DP rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ..configs import AnyConfig
from ..problem import Problem


@dataclass(frozen=True)
class Capabilities:
    """What a process group offers, as far as backend choice goes (same on every rank)."""

    world_size: int
    all_reduce_bytes: int = 0  # capacity of the workspace's all-reduce region (0: no workspace)
    moe_bytes: int = 0  # capacity of the MoE region
    has_multicast: bool = False
    intra_node: bool = True  # False when the group spans nodes
    torch_symm_ops: bool = False  # torch.ops.symm_mem one/two-shot available
    compute_capability: tuple[int, int] = (0, 0)


@dataclass
class RunContext:
    """Per-rank objects a launcher needs: the group and its workspace (None for NCCL)."""

    group: Any = None
    workspace: Any = None


Launcher = Callable[..., Any]


class Backend(Protocol):
    name: str
    ops: tuple[str, ...]
    # Backends whose launcher cannot be captured in a CUDA graph set ``graph_capturable = False``
    # (read with getattr, default True): the tuner and the dispatcher skip them in graph mode.

    def unsupported_reason(self, problem: Problem, caps: Capabilities) -> Optional[str]: ...

    def search_space(self, problem: Problem) -> list[Optional[AnyConfig]]: ...

    def prepare(self, problem: Problem, config: Optional[AnyConfig], ctx: RunContext) -> Launcher: ...


class BackendError(RuntimeError):
    """A backend cannot run a call it was asked to (the message names the offending value)."""

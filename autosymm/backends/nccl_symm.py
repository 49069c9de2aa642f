"""Backend ``nccl_symm``: NCCL's all-reduce on window-registered (symmetric) buffers.

NCCL >= 2.27 runs its symmetric kernels when both buffers lie in a window registered with
``NCCL_WIN_COLL_SYMMETRIC`` at the same offset on every rank. The window is the group's whole
workspace buffer, registered once per workspace through ``ncclCommWindowRegister`` on torch's
communicator (ctypes, the library torch loaded), a collective: the first prepare on every rank.
A tensor of ``autosymm.empty`` is reduced where it lies (zero-copy); any other is copied into the
top of the region, reduced there and copied back. Gated on the NCCL in use (:data:`MIN_NCCL`,
:func:`nccl_version`: recorded in every reason). Why not torch's own registration paths: the
design notes.

Design notes: docs/BACKENDS.md#backends-nccl-symm
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

import torch
import torch.distributed as dist

from ..geometry import ALIGN, ALL_REDUCE_REGION
from ..problem import Problem
from .base import Backend, BackendError, Capabilities, Needs, RunContext

#: First NCCL with window registration and symmetric collective kernels.
MIN_NCCL = (2, 27, 0)
NCCL_WIN_COLL_SYMMETRIC = 1

_LOCK = threading.Lock()
_WINDOWS: dict[tuple[int, int], int] = {}  # (comm, buffer address) -> ncclWindow_t


def nccl_version() -> Optional[tuple[int, int, int]]:
    """(major, minor, patch) of the NCCL torch uses, or None (a build without NCCL or CUDA)."""
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, TypeError):
        return None
    return tuple(int(v) for v in version[:3]) if isinstance(version, tuple) else None


def version_reason(version: Optional[tuple[int, int, int]]) -> Optional[str]:
    """Why NCCL ``version`` cannot run symmetric all-reduces, or None when it can."""
    if version is None:
        return "no NCCL in this torch build"
    if tuple(version) < MIN_NCCL:
        have, want = ".".join(map(str, version)), ".".join(map(str, MIN_NCCL))
        return f"NCCL {have} has no window registration (symmetric kernels need NCCL >= {want})"
    return None


def nccl_library() -> str:
    """Path of the libnccl this process has loaded (torch's), else the soname."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if path.startswith("/") and os.path.basename(path).startswith("libnccl"):
                    return path
    except OSError:
        pass
    return "libnccl.so.2"


def _nccl():
    lib = ctypes.CDLL(nccl_library())
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib


def comm_pointer(group, device: torch.device) -> int:
    """torch's ``ncclComm_t`` of ``group`` on ``device`` (a collective first if not yet created)."""
    backend = group._get_backend(device)
    get = getattr(backend, "_comm_ptr", None)
    if not callable(get):
        raise BackendError(f"{type(backend).__name__} exposes no _comm_ptr(): NCCL windows need ProcessGroupNCCL")
    comm = int(get())
    if comm == 0:  # communicators are created lazily: one collective makes it
        dist.all_reduce(torch.zeros(1, device=device), group=group)
        comm = int(get())
    if comm == 0:
        raise BackendError("ProcessGroupNCCL returned a null communicator")
    return comm


def register_window(group, buffer: torch.Tensor) -> int:
    """Register ``buffer``'s bytes as a symmetric NCCL window of ``group`` (collective: every rank,
    same size); once per (communicator, address). Returns the ncclWindow_t."""
    comm = comm_pointer(group, buffer.device)
    key = (comm, int(buffer.data_ptr()))
    with _LOCK:
        window = _WINDOWS.get(key)
        if window is None:
            lib, handle = _nccl(), ctypes.c_void_p()
            rc = lib.ncclCommWindowRegister(ctypes.c_void_p(comm), ctypes.c_void_p(key[1]),
                                            ctypes.c_size_t(buffer.numel() * buffer.element_size()),
                                            ctypes.byref(handle), ctypes.c_int(NCCL_WIN_COLL_SYMMETRIC))
            if rc != 0 or not handle.value:
                raise BackendError(f"ncclCommWindowRegister of {buffer.numel()} bytes failed: "
                                   f"{lib.ncclGetErrorString(rc).decode()} (rc {rc})")
            window = _WINDOWS[key] = int(handle.value)
        return window


def registered(group, buffer: torch.Tensor) -> bool:
    """True when ``buffer`` is already a window of ``group``'s communicator (no collective)."""
    get = getattr(group._get_backend(buffer.device), "_comm_ptr", None)
    comm = int(get()) if callable(get) else 0
    return (comm, int(buffer.data_ptr())) in _WINDOWS


class _SymmLauncher:
    """``launcher(x) -> x``: x summed in place by NCCL inside the registered workspace."""

    def __init__(self, workspace, group) -> None:
        self.workspace, self.group, self._all_reduce = workspace, group, dist.all_reduce
        region = workspace.regions[ALL_REDUCE_REGION]
        self.capacity = region.nbytes
        self.region = workspace.buffer[region.offset:region.offset + region.nbytes]
        self.region_start = int(self.region.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.workspace.device or not x.is_contiguous():
            raise BackendError(f"nccl_symm cannot reduce tensor {tuple(x.shape)} on {x.device} with strides "
                               f"{tuple(x.stride())}: it needs a contiguous tensor on {self.workspace.device}")
        nbytes = x.numel() * x.element_size()
        addr = x.data_ptr()
        if self.region_start <= addr and addr + nbytes <= self.region_start + self.capacity:
            self._all_reduce(x, group=self.group)  # zero-copy: autosymm.empty's tensor is in the window
            return x
        offset = self.capacity - (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if offset < self.workspace.empty_bytes:
            raise BackendError(f"staging {nbytes} bytes would overwrite the {self.workspace.empty_bytes} bytes handed "
                               f"out by autosymm.empty in a {self.capacity}-byte region; raise AUTOSYMM_WORKSPACE_BYTES")
        stage = self.region[offset:offset + nbytes].view(x.dtype).view(x.shape)
        stage.copy_(x)
        self._all_reduce(stage, group=self.group)
        x.copy_(stage)
        return x


class NcclSymmAllReduce(Backend):
    """NCCL's all-reduce inside autosymm's workspace registered as a symmetric NCCL window."""

    name = "nccl_symm"
    needs = Needs(workspace_region=ALL_REDUCE_REGION, intra_node=True)

    def limits(self, problem: Problem, caps: Capabilities) -> Optional[str]:
        if problem.world_size < 2:
            return "one rank: nothing to exchange"
        reason = version_reason(nccl_version())
        if reason is not None:
            return reason
        need = (problem.nbytes + ALIGN - 1) // ALIGN * ALIGN
        if need > caps.all_reduce_bytes:
            return f"a {need}-byte stage exceeds the {caps.all_reduce_bytes}-byte all-reduce region"
        return None

    def prepare(self, problem: Problem, config: None, ctx: RunContext) -> _SymmLauncher:
        """Register the workspace as a window (collective, once) and return the launcher."""
        ws = ctx.workspace
        if ws is None or ctx.group is None:
            raise BackendError("nccl_symm needs the group's symmetric workspace and its NCCL process group")
        reason = version_reason(nccl_version())
        if reason is not None:
            raise BackendError(f"nccl_symm: {reason}")
        if torch.cuda.is_current_stream_capturing() and not registered(ctx.group, ws.buffer):
            raise BackendError("nccl_symm: the workspace's NCCL window is registered by a first eager call "
                               "(a collective that cannot run inside a CUDA-graph capture); make one eagerly first")
        register_window(ctx.group, ws.buffer)
        return _SymmLauncher(ws, ctx.group)


nccl_symm = NcclSymmAllReduce()
BACKENDS = (nccl_symm,)

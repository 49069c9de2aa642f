"""The hardware fingerprint: what a tuning result is valid for.

``hardware_slug`` (database column ``hardware``: GPU model and link class, e.g.
``nvidia-h200-nvlink``; rows are keyed by it and the world size) and ``node_slug`` (the shipped
file's name: plus the local GPU count, e.g. ``nvidia-h200-nvlink-x2``). The link class comes from
NVML, else from `nvidia-smi topo -m` (bounded by a timeout); where neither answers, a multi-GPU
node is 'unknown' (``<gpu>-unknown``, which matches no tuned row) with one warning. Everything
here reads properties and changes no device state; without CUDA a CPU fingerprint (slug ``cpu``)
lets the CLI show plans from the shipped databases anywhere.

Design notes: docs/DATABASE.md#hardware
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from . import settings
from .version import __version__


def slugify(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (lower case, runs of other characters -> '-')."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def link_class(nvlink_counts: list[int], p2p: list[list[bool]]) -> str:
    """'single' for one GPU; 'none' when some pair has no peer access; else, from the active
    NVLinks per GPU, 'nvlink' when every GPU has some, 'pcie' when some GPU has none, and
    'unknown' when the counts are unknown (``[]``: neither NVML nor ``nvidia-smi topo`` answered;
    the peer-access matrix cannot tell NVLink from PCIe)."""
    n = len(p2p)
    if n <= 1:
        return "single"
    if not all(p2p[i][j] for i in range(n) for j in range(n) if i != j):
        return "none"
    if not nvlink_counts:
        return "unknown"
    return "nvlink" if all(c > 0 for c in nvlink_counts) else "pcie"


def hardware_slug_for(gpu_name: str, links: str) -> str:
    """Database ``hardware`` key of a GPU model and link class, e.g. 'nvidia-h200-nvlink'.

    An unclassified multi-GPU node gets '<gpu>-unknown': it matches no NVLink or PCIe row (a
    PCIe-tuned config on an NVLink node, or the reverse, would be a wrong choice), so every
    call uses NCCL until the links are known (install nvidia-ml-py)."""
    if gpu_name.lower() == "cpu":
        return "cpu"
    return f"{slugify(gpu_name)}-{'nvlink' if links in ('nvlink', 'single') else links}"


@dataclass(frozen=True)
class Fingerprint:
    gpu_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    gpu_count: int
    nvlink_counts: tuple[int, ...] = ()  # active NVLinks per local GPU (empty: unknown)
    p2p: tuple[tuple[bool, ...], ...] = ()  # peer access matrix of the local GPUs
    links: str = "single"
    multicast: bool = False
    driver_version: str = ""
    cuda_version: str = ""
    torch_version: str = torch.__version__
    triton_version: str = ""

    @property
    def hardware_slug(self) -> str:
        return hardware_slug_for(self.gpu_name, self.links)

    @property
    def node_slug(self) -> str:
        if self.hardware_slug == "cpu":
            return "cpu"
        return f"{self.hardware_slug}-x{self.gpu_count}"

    @property
    def topology(self) -> str:
        """Human form, e.g. '2x NVIDIA H200, NVLink NV18' or 'CPU only'."""
        if self.hardware_slug == "cpu":
            return "CPU only"
        if self.links == "nvlink" and self.nvlink_counts:
            return f"{self.gpu_count}x {self.gpu_name}, NVLink NV{min(self.nvlink_counts)}"
        return f"{self.gpu_count}x {self.gpu_name}, {self.links}"

    def as_dict(self) -> dict:
        data = asdict(self)
        data.update(hardware_slug=self.hardware_slug, node_slug=self.node_slug, topology=self.topology)
        return data


@functools.lru_cache(maxsize=1)
def _triton_version() -> str:
    try:
        import triton  # triton stays off the runtime's import path (and may be missing)

        return triton.__version__
    except Exception:  # triton missing or broken: the fingerprint still works
        return ""


def running_versions() -> tuple[str, str]:
    """(torch, triton) versions of this process, as recorded with tuning rows."""
    return torch.__version__, _triton_version()


def _version_text(version) -> str:
    """torch.cuda.nccl.version()'s answer as 'major.minor.patch': a tuple (torch >= 1.13), or
    NCCL's integer code (major * 10000 + minor * 100 + patch since 2.9, major * 1000 + ... before)."""
    if isinstance(version, tuple) and len(version) >= 3:
        return ".".join(str(int(v)) for v in version[:3])
    if isinstance(version, int) and version > 0:
        base = 10000 if version >= 20900 else 1000
        return f"{version // base}.{version % base // 100}.{version % 100}"
    return ""


@functools.lru_cache(maxsize=1)
def nccl_version() -> str:
    """The NCCL this process's torch runs (torch.cuda.nccl.version()), e.g. '2.28.9', recorded
    with every tuned row and compared with the rows' at dispatch; '' when torch has no NCCL (a
    CPU build): then there is no running NCCL and no row is judged against one."""
    try:
        return _version_text(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError, TypeError, ImportError):
        return ""


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9.]+)", f.read())
            if match:
                return match.group(1)
    except OSError:
        pass
    try:
        import pynvml  # NVML is optional: the fingerprint works without it

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return ""


def _nvml_nvlink_counts(gpu_count: int) -> tuple[tuple[int, ...], str]:
    """(active NVLinks per GPU, '') through NVML (nvidia-ml-py), or ((), why NVML gave nothing)."""
    try:
        import pynvml  # NVML is optional: the fingerprint works without it
    except ImportError as exc:
        return (), f"NVML: nvidia-ml-py is not importable ({exc})"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return (), f"NVML: nvmlInit failed ({exc})"
    try:
        counts = []
        for index in range(gpu_count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        active += 1
                except pynvml.NVMLError:  # NotSupported on a GPU without NVLink, or past its last link
                    break
            counts.append(active)
        return tuple(counts), ""
    except Exception as exc:
        return (), f"NVML: {type(exc).__name__}: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


#: Seconds `nvidia-smi topo -m` may take before it is killed (a wedged driver can block it).
TOPO_TIMEOUT_S = 10.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TOPO_CELL = re.compile(r"X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC")


def _topo_text(timeout_s: float = TOPO_TIMEOUT_S) -> tuple[str, str]:
    """(stdout of `nvidia-smi topo -m`, '') or ('', why there is none); returns within about
    ``timeout_s`` + 1 seconds whatever nvidia-smi does (its process group is killed on timeout)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "", "nvidia-smi is not on PATH"
    try:
        proc = subprocess.Popen([exe, "topo", "-m"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as exc:
        return "", f"`nvidia-smi topo -m` could not start ({exc})"
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        return "", f"`nvidia-smi topo -m` gave no answer within {timeout_s:g} s"
    if proc.returncode != 0:
        first = (err or out).strip().splitlines()[:1]
        return "", f"`nvidia-smi topo -m` exited with {proc.returncode}" + (f" ({first[0]})" if first else "")
    return out, ""


def parse_topo_matrix(text: str) -> Optional[list[list[str]]]:
    """The GPU-to-GPU cells of `nvidia-smi topo -m` output ('X' on the diagonal, 'NV18', 'PIX',
    'SYS', ...), row i = GPU i in nvidia-smi's order; None when no well-formed matrix is found."""
    rows = [_ANSI.sub("", line).split() for line in text.splitlines()]
    # the header names the columns (GPU0 GPU1 ... NIC0 CPU Affinity ...); a data row starts
    # with its GPU's name and a cell
    header = next((r for r in rows if r and r[0] == "GPU0" and not (len(r) > 1 and _TOPO_CELL.fullmatch(r[1]))), None)
    if header is None:
        return None
    n = 0
    while n < len(header) and header[n] == f"GPU{n}":
        n += 1
    data = {r[0]: r[1:1 + n] for r in rows if len(r) > n and r[0].startswith("GPU") and _TOPO_CELL.fullmatch(r[1])}
    matrix = [data.get(f"GPU{i}") for i in range(n)]
    if any(row is None or not all(_TOPO_CELL.fullmatch(c) for c in row) for row in matrix):
        return None
    if any(matrix[i][i] != "X" for i in range(n)):
        return None
    return matrix


def _visible_indices(gpu_count: int) -> Optional[list[int]]:
    """nvidia-smi indices of torch's GPUs 0..gpu_count-1 (CUDA_VISIBLE_DEVICES as integers,
    assumed in PCI order like nvidia-smi's), None when they cannot be told (UUIDs, MIG names)."""
    text = settings.raw("CUDA_VISIBLE_DEVICES")
    if text is None:
        return list(range(gpu_count))
    try:
        indices = [int(t) for t in text.split(",") if t.strip()][:gpu_count]
    except ValueError:
        return None
    return indices if len(indices) == gpu_count else None


def nvlink_counts_from_topo(text: str, gpu_count: int, indices: Optional[list[int]] = None) -> tuple[int, ...]:
    """Per visible GPU, the most NVLinks to one of the other visible GPUs (0: only PCIe/SMP
    paths), read from `nvidia-smi topo -m` output; () when the output does not say.

    ``indices``: nvidia-smi indices of the visible GPUs (None: unknown, then only a matrix whose
    pairs are all NVLink or all not, which answers for any subset, is used)."""
    matrix = parse_topo_matrix(text)
    if matrix is None or gpu_count < 1:
        return ()

    def links(cell: str) -> int:
        return int(cell[2:]) if cell.startswith("NV") else 0

    if indices is None:
        cells = {links(matrix[i][j]) for i in range(len(matrix)) for j in range(len(matrix)) if i != j}
        if len(matrix) < gpu_count or len(cells) != 1:
            return ()
        return (cells.pop(),) * gpu_count
    if len(indices) != gpu_count or max(indices) >= len(matrix) or min(indices) < 0:
        return ()
    return tuple(max((links(matrix[i][j]) for j in indices if j != i), default=0) for i in indices)


def nvlink_counts(gpu_count: int) -> tuple[tuple[int, ...], list[str]]:
    """Active NVLinks per local GPU: from NVML, else from `nvidia-smi topo -m`; with ``()`` the
    reasons neither answered (for the warning)."""
    counts, why_nvml = _nvml_nvlink_counts(gpu_count)
    if counts or gpu_count <= 1:  # one GPU needs no link class
        return counts, []
    text, why_topo = _topo_text()
    counts = nvlink_counts_from_topo(text, gpu_count, _visible_indices(gpu_count)) if text else ()
    if counts:
        return counts, []
    return (), [why_nvml, why_topo or "`nvidia-smi topo -m` printed no GPU matrix covering the visible GPUs"]


class UnclassifiedLinksWarning(UserWarning):
    """The local GPUs' link class (NVLink or PCIe) could not be determined."""


_WARNED_UNCLASSIFIED: set[str] = set()


def _warn_unclassified(fp: "Fingerprint", reasons: list[str]) -> None:
    """Warn once per process and slug that ``fp``'s links are unknown, naming what failed."""
    if fp.hardware_slug in _WARNED_UNCLASSIFIED:
        return
    _WARNED_UNCLASSIFIED.add(fp.hardware_slug)
    warnings.warn(
        f"autosymm: cannot tell whether the {fp.gpu_count} local {fp.gpu_name} GPUs are linked by NVLink or PCIe "
        f"({'; '.join(reasons)}). Hardware slug {fp.hardware_slug!r} matches no tuned row, so every call uses "
        f"NCCL. Install nvidia-ml-py (pip install nvidia-ml-py) or put a working nvidia-smi on PATH.",
        UnclassifiedLinksWarning, stacklevel=3)


def cpu_fingerprint() -> Fingerprint:
    return Fingerprint(gpu_name="cpu", compute_capability=(0, 0), sm_count=0, gpu_count=0, links="none",
                       triton_version=_triton_version())


def fingerprint_from_properties(props: list, p2p: list[list[bool]], nvlink_counts: tuple[int, ...], *,
                                multicast: bool = False, driver_version: str = "", cuda_version: str = "") -> Fingerprint:
    """Build a fingerprint from per-GPU property objects (name, major, minor,
    multi_processor_count), the peer-access matrix and NVLink counts: stub-friendly for tests."""
    if not props:
        return cpu_fingerprint()
    names = {p.name for p in props}
    if len(names) > 1:
        raise ValueError(f"mixed GPU models on one node are not supported: {sorted(names)}")
    first = props[0]
    return Fingerprint(
        gpu_name=first.name,
        compute_capability=(int(first.major), int(first.minor)),
        sm_count=int(first.multi_processor_count),
        gpu_count=len(props),
        nvlink_counts=tuple(nvlink_counts),
        p2p=tuple(tuple(row) for row in p2p),
        links=link_class(list(nvlink_counts), p2p),
        multicast=multicast,
        driver_version=driver_version,
        cuda_version=cuda_version,
        triton_version=_triton_version(),
    )


@functools.lru_cache(maxsize=1)
def fingerprint() -> Fingerprint:
    """This node's fingerprint (cached). Multicast is reported as the env allows it; whether a
    group really has it is the workspace's business (autosymm.workspace.symm). Links whose class cannot
    be told (see :func:`nvlink_counts`) give the 'unknown' class and one
    :class:`UnclassifiedLinksWarning`."""
    if not torch.cuda.is_available():
        return cpu_fingerprint()
    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)] for i in range(count)]
    multicast_env_off = settings.multicast_disabled_by_env()
    counts, reasons = nvlink_counts(count)
    fp = fingerprint_from_properties(
        props, p2p, counts,
        multicast=(not multicast_env_off) and props[0].major >= 9,
        driver_version=_driver_version(), cuda_version=torch.version.cuda or "",
    )
    if fp.links == "unknown":
        _warn_unclassified(fp, reasons)
    return fp


def provenance(fp: Optional[Fingerprint] = None) -> dict:
    """Provenance columns recorded with every tuning result: versions (NCCL's too: the baseline
    each row's ``nccl_us`` and ``speedup`` are of), GPU, and ``comm_env``,
    the variables that turn NVLink multicast / NVLS off for torch, NCCL and NVSHMEM as this
    process sees them (``unset`` where absent), e.g. 'TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1': NCCL's baseline depends on them."""
    fp = fp or fingerprint()
    return {
        "comm_env": settings.comm_env(),
        "nccl_version": nccl_version(),
        "autosymm_version": __version__,
        "torch_version": fp.torch_version,
        "triton_version": fp.triton_version,
        "cuda_version": fp.cuda_version,
        "driver_version": fp.driver_version,
        "gpu": fp.gpu_name,
    }

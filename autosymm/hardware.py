"""The hardware fingerprint: what a tuning result is valid for.

Two slugs come out of it:

* ``hardware_slug`` (database column ``hardware``): GPU model and link class, e.g.
  ``nvidia-h200-nvlink``. Results are keyed by it plus the world size, so a 2-rank group on an
  8-GPU NVLink node uses rows tuned with 2 ranks on any NVLink node of that GPU.
* ``node_slug`` (shipped file name): the hardware slug plus the local GPU count, e.g.
  ``nvidia-h200-nvlink-x2`` -> ``tuning_db/nvidia-h200-nvlink-x2.sqlite``.

Everything here reads properties; nothing changes device state. Without CUDA a CPU fingerprint
is returned (slug ``cpu``), so the CLI can show plans from shipped databases anywhere.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import asdict, dataclass
from typing import Optional

import torch


def slugify(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (lower case, runs of other characters -> '-')."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def link_class(nvlink_counts: list[int], p2p: list[list[bool]]) -> str:
    """'nvlink' when every GPU has active NVLinks and all pairs have peer access, 'pcie' when
    pairs have peer access without NVLink, 'none' when some pair has no peer access, 'single'
    for one GPU."""
    n = len(p2p)
    if n <= 1:
        return "single"
    if not all(p2p[i][j] for i in range(n) for j in range(n) if i != j):
        return "none"
    if nvlink_counts and all(c > 0 for c in nvlink_counts):
        return "nvlink"
    return "pcie"


def hardware_slug_for(gpu_name: str, links: str) -> str:
    """Database ``hardware`` key of a GPU model and link class."""
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
        import triton

        return triton.__version__
    except Exception:  # triton missing or broken: the fingerprint still works
        return ""


def running_versions() -> tuple[str, str]:
    """(torch, triton) versions of this process, as recorded with tuning rows."""
    return torch.__version__, _triton_version()


def _driver_version() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9.]+)", f.read())
            if match:
                return match.group(1)
    except OSError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return ""


def _nvlink_counts(gpu_count: int) -> tuple[int, ...]:
    """Active NVLinks per GPU through NVML (nvidia-ml-py); () when NVML is unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
        counts = []
        for index in range(gpu_count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        active += 1
                except pynvml.NVMLError:
                    break
            counts.append(active)
        return tuple(counts)
    except Exception:
        return ()


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
    group really has it is the workspace's business (autosymm.symm)."""
    if not torch.cuda.is_available():
        return cpu_fingerprint()
    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(count)] for i in range(count)]
    multicast_env_off = os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0") not in ("", "0")
    return fingerprint_from_properties(
        props, p2p, _nvlink_counts(count),
        multicast=(not multicast_env_off) and props[0].major >= 9,
        driver_version=_driver_version(), cuda_version=torch.version.cuda or "",
    )


def provenance(fp: Optional[Fingerprint] = None) -> dict:
    """Provenance columns recorded with every tuning result: versions, GPU, and ``comm_env``,
    the variables that turn NVLink multicast / NVLS off for torch, NCCL and NVSHMEM as this
    process sees them (``unset`` where absent), e.g. 'TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1': NCCL's baseline depends on them."""
    from . import __version__

    fp = fp or fingerprint()
    names = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")
    return {
        "comm_env": " ".join(f"{name}={os.environ.get(name, 'unset')}" for name in names),
        "autosymm_version": __version__,
        "torch_version": fp.torch_version,
        "triton_version": fp.triton_version,
        "cuda_version": fp.cuda_version,
        "driver_version": fp.driver_version,
        "gpu": fp.gpu_name,
    }

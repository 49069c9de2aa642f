"""Settings read from the environment that shape the symmetric workspace: its size and whether
torch may use multicast. One place for their parsing, so every reader (runtime, CLI, tuner)
refuses the same bad values with the same message."""

from __future__ import annotations

import os
from typing import Optional

from .geometry import ALIGN, DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES, align


def multicast_disabled_by_env() -> bool:
    """True when TORCH_SYMM_MEM_DISABLE_MULTICAST asks torch not to use multicast."""
    return os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0") not in ("", "0", "false", "False")


#: Largest AUTOSYMM_WORKSPACE_BYTES accepted (bytes): every rank allocates it as symmetric memory
#: on its GPU, and no supported GPU has room for more next to a model.
MAX_WORKSPACE_BYTES = 64 << 30


def env_bytes(name: str, low: int, high: int) -> Optional[int]:
    """The size in ``$name`` (bytes, e.g. 1073741824, 512MiB, 2GiB; autosymm.problem.parse_bytes),
    None when unset or empty; a value that does not read as a size in [low, high] is a
    ValueError naming the variable and the value."""
    from .problem import format_bytes, parse_bytes

    text = os.environ.get(name, "")
    if not text.strip():
        return None
    try:
        nbytes = parse_bytes(text)
    except ValueError:
        nbytes = None
    if nbytes is None or not low <= nbytes <= high:
        raise ValueError(f"{name}={text!r} is not a size from {format_bytes(low)} to {format_bytes(high)} "
                         f"(examples: 1073741824, 512MiB, 2GiB)")
    return nbytes


def default_region_bytes() -> tuple[int, int]:
    """(all-reduce bytes, MoE bytes): AUTOSYMM_WORKSPACE_BYTES split in halves (at most
    MAX_WORKSPACE_BYTES), or the defaults when it is unset."""
    nbytes = env_bytes("AUTOSYMM_WORKSPACE_BYTES", 2 * ALIGN, MAX_WORKSPACE_BYTES)
    if nbytes is None:
        return DEFAULT_ALL_REDUCE_BYTES, DEFAULT_MOE_BYTES
    half = align(nbytes // 2)
    return half, max(ALIGN, nbytes - half)


#: NVLink multicast / NVLS off, as the GPU tests and node scripts set it on shared hosts
#: (scripts/_node_env.sh). autosymm itself never applies it: it inherits the user's environment.
MULTICAST_OFF_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}

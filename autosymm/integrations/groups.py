"""The group autosymm serves a stack's slot on, from the group the stack hands over.

vLLM and SGLang build their custom-all-reduce object with the *CPU* (gloo) group of a
parallel group (vLLM ``cuda_communicator.py``, SGLang ``parallel_state.py``); the kernels and
NCCL fallback need the device group over the same ranks. autosymm.dist_compat.group_over
finds it among the groups this process already has (the stacks create both groups together) or
creates it, collectively over those ranks only.

:func:`serving_backend` is this package's one mapping from a device to the backend its
collectives run on; a group's device is autosymm.dist_compat's ``group_device``.
"""

from __future__ import annotations

import torch


def serving_backend(device: torch.device) -> str:
    """The torch.distributed backend whose group serves tensors on ``device``: NCCL for CUDA,
    gloo for the CPU."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"autosymm serves CUDA (NCCL) and CPU (gloo) groups, not device {device}")

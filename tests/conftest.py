"""Test set-up: without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1).

The variable must be set before any @triton.jit function is created, i.e. before autosymm's
kernels are imported; conftest.py is imported first. NVLink multicast stays off everywhere.
"""

import os

import torch

os.environ.update({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"})
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's warning; same default

#!/usr/bin/env bash
# Run the GPU tests (tests/gpu) on all local GPUs; each test spawns one process per GPU.
# Usage: scripts/run_gpu_tests.sh [pytest args...]
# NVLink multicast stays off: these variables must stay as they are on shared hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; n = torch.cuda.device_count(); print(f'{n} CUDA GPU(s)'); assert n > 0, 'no CUDA GPU'"
exec python3 -m pytest tests/gpu -v -p no:cacheprovider "$@"

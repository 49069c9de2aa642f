#!/usr/bin/env bash
# Run the GPU tests (tests/gpu) on all local GPUs; each test spawns one process per GPU, except
# the emulated-rank tests (tests/gpu/test_emulated_ranks_gpu.py: every rank of world sizes 2, 4
# and 8 on one GPU, one process), which run first in a pytest of their own with the tuner's
# barrier poll limit (AUTOSYMM_BARRIER_MAX_POLLS, read at import): a broken kernel's barrier then
# gives up in seconds instead of spinning for minutes. Works on one GPU (a one-rank group) too.
# Usage: scripts/run_gpu_tests.sh [pytest args...]   (exit status: the worse of the two runs)
# NVLink multicast stays off: these variables must stay as they are on shared hosts.
set -uo pipefail
cd "$(dirname "$0")/.."
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch; n = torch.cuda.device_count(); print(f'{n} CUDA GPU(s)'); assert n > 0, 'no CUDA GPU'" || exit 1
emulated=tests/gpu/test_emulated_ranks_gpu.py
status=0
run() {  # pytest's 5 (nothing collected, e.g. a -k that selects none of a run) is not a failure
  "$@"; local rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && [ "$rc" -gt "$status" ]; then status=$rc; fi
}
run env AUTOSYMM_BARRIER_MAX_POLLS="${AUTOSYMM_BARRIER_MAX_POLLS:-16777216}" python3 -m pytest "$emulated" -v -p no:cacheprovider "$@"
run python3 -m pytest tests/gpu --ignore="$emulated" -v -p no:cacheprovider "$@"
exit "$status"

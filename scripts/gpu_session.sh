#!/usr/bin/env bash
# One device session on a GPU node: GPU tests, the default tune, the benchmark, Optuna against
# the exhaustive grid, and the measurement scripts. Logs and results go to $OUT (default ./out).
# Steps (default: tests tune bench): tests | tune | bench | optuna | faults (scripts/gpu_faults.py)
#   | dispatch (host time per call, scripts/bench_dispatch.py) | moe (MoE fallback vs plain NCCL)
#   | exact (dispatch vs exact-size tunes) | layer (tensor-parallel decoder layer) | fused
#   | nccl (which route to NCCL's symmetric windows works: scripts/nccl_symm_probe.py)
#   scripts/gpu_session.sh [step...]
# Every step runs under `timeout ${STEP_TIMEOUT:-600}`: a hang ends the step, not the session.
# Wheels for packages the node lacks (optuna, sqlite-utils) are taken from ./.whl if present.
set -uo pipefail
source "$(dirname "$0")/_node_env.sh"
steps=${*:-tests tune bench}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvidia-smi topo -m;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python3 -m autosymm info; } 2>&1 | tee "$OUT/env.txt"
t="timeout ${STEP_TIMEOUT:-600}"
for step in $steps; do
  echo "== $step $(date -u +%T)"
  case $step in
    tests) $t scripts/run_gpu_tests.sh -q ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt" ;;
    faults) $t python3 scripts/gpu_faults.py --out "$OUT/gpu_faults.md" 2>&1 | tee "$OUT/gpu_faults.txt" ;;
    dispatch) $t python3 scripts/bench_dispatch.py ${DISPATCH_ARGS:-} 2>&1 | tee "$OUT/bench_dispatch.txt" ;;
    moe) $t python3 scripts/bench_moe_fallback.py ${MOE_ARGS:-} 2>&1 | tee "$OUT/bench_moe_fallback.txt" ;;
    exact) $t python3 scripts/exact_vs_dispatch.py ${EXACT_ARGS:-} 2>&1 | tee "$OUT/exact_vs_dispatch.txt" ;;
    layer) $t python3 scripts/bench_tp_layer.py --out "$OUT/tp_layer.md" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/tp_layer.txt" ;;
    fused) $t python3 scripts/bench_fused.py ${FUSED_ARGS:-} 2>&1 | tee "$OUT/bench_fused.txt" ;;
    nccl) $t python3 scripts/nccl_symm_probe.py --json "$OUT/nccl_probe.json" 2>&1 | tee "$OUT/nccl_probe.txt" ;;
    tune)  export AUTOSYMM_DB="$OUT/tuned.sqlite"
           start=$(date +%s)
           $t python3 -m autosymm tune --json-summary "$OUT/tune_summary.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.txt"
           echo "tune wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/tune.txt" ;;
    bench) export AUTOSYMM_DB="${AUTOSYMM_DB:-$OUT/tuned.sqlite}"
           $t python3 -m autosymm bench --csv "$OUT/bench.csv" --plot "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" ;;
    optuna) $t python3 scripts/optuna_vs_grid.py ${OPTUNA_ARGS:-} 2>&1 | tee "$OUT/optuna_vs_grid.txt" ;;
  esac
done

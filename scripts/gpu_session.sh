#!/usr/bin/env bash
# One device session on a GPU node: GPU tests, the default tune, the benchmark, Optuna against
# the exhaustive grid. Logs and results go to $OUT (default ./out).
# Steps: tests | tune | bench | optuna (default: tests tune bench).
#   scripts/gpu_session.sh [tests] [tune] [bench] [optuna]
# Wheels for packages the node lacks (optuna, sqlite-utils) are taken from ./.whl if present.
set -uo pipefail
source "$(dirname "$0")/_node_env.sh"
steps=${*:-tests tune bench}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; nvidia-smi topo -m;
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)";
  python3 -m autosymm info; } 2>&1 | tee "$OUT/env.txt"
for step in $steps; do
  case $step in
    tests) scripts/run_gpu_tests.sh -x -q 2>&1 | tee "$OUT/gpu_tests.txt" ;;
    tune)  export AUTOSYMM_DB="$OUT/tuned.sqlite"
           start=$(date +%s)
           python3 -m autosymm tune --json-summary "$OUT/tune_summary.json" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.txt"
           echo "tune wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/tune.txt" ;;
    bench) export AUTOSYMM_DB="${AUTOSYMM_DB:-$OUT/tuned.sqlite}"
           python3 -m autosymm bench --csv "$OUT/bench.csv" --plot "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" ;;
    optuna) python3 scripts/optuna_vs_grid.py ${OPTUNA_ARGS:-} 2>&1 | tee "$OUT/optuna_vs_grid.txt" ;;
  esac
done

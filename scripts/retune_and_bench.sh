#!/usr/bin/env bash
# Re-tune some backends on this node, merge the rows into the shipped database of this node,
# then benchmark through the dispatcher with that database alone (what a plain install uses).
# Logs and the merged database go to $OUT (default ./out).
#   TUNE_ARGS="--ops all_reduce --backends triton_one_shot_push" scripts/retune_and_bench.sh
set -uo pipefail
source "$(dirname "$0")/_node_env.sh"
shipped=$(python3 -c "from autosymm.db.store import shipped_db_for; from autosymm.hardware import fingerprint; \
print(shipped_db_for(fingerprint().node_slug) or '')")
[ -n "$shipped" ] || { echo "no shipped database for this node in tuning_db/"; exit 1; }
start=$(date +%s)
timeout -k 10 "${TUNE_TIMEOUT:-300}" python3 -m autosymm tune --db "$OUT/retuned.sqlite" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.txt"
echo "tune wall time: $(( $(date +%s) - start )) s" | tee -a "$OUT/tune.txt"
python3 -m autosymm db merge --into "$shipped" "$OUT/retuned.sqlite" 2>&1 | tee -a "$OUT/tune.txt"
cp "$shipped" "$OUT/merged.sqlite"
AUTOSYMM_DB="$OUT/no-user-db.sqlite" timeout -k 10 "${BENCH_TIMEOUT:-400}" \
  python3 -m autosymm bench --csv "$OUT/bench.csv" --plot "$OUT/bench.png" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"

#!/usr/bin/env bash
# Issue #42 on ONE GPU, in one command of at most ~9 minutes: the small-message kernel floor of a
# base tree and of this one, alternately in one run (scripts/bench_emulated_floor.py --compare), at
# W = 2 over every family and size, then W = 4 and 8 on the small set; Nsight Compute on the key
# kernels (rank 0 alone, waits pre-satisfied) where ncu exists; then the emulated-rank GPU tests
# of the changed kernels with whatever time is left. Logs and tables under $OUT.
#
#   scripts/gpu_floor_session.sh [BASE_DIR]      (default .base: `git archive <base> | tar -x -C .base`)
#
# Budget: BUDGET_S (default 540 s) for the whole run; each step gets a timeout from what is left,
# so a hang ends a step, not the session. AUTOSYMM_BARRIER_MAX_POLLS defaults to the tuner's limit:
# a broken wait gives up in seconds and the bench reports it (the pads are checked after every case).
# A focused run: W2_SIZES / W2_MATCH narrow step 1 (--sizes / --match), W48=0 and NCU=0 skip steps
# 2 and 3, TESTS_K is step 4's pytest -k, W2_MAX_S and TESTS_MAX_S cap steps 1 and 4 (defaults: everything,
# as before).
set -uo pipefail
source "$(dirname "$0")/_node_env.sh"   # repository root, $OUT, NVLink multicast off
BASE=${1:-.base}
BUDGET_S=${BUDGET_S:-540}
export AUTOSYMM_BARRIER_MAX_POLLS=${AUTOSYMM_BARRIER_MAX_POLLS:-16777216}
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
start=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
step() {  # step NAME MAX_S command...: run with timeout min(MAX_S, time left - 10 s)
  local name=$1 max=$2; shift 2
  local t=$(( $(left) - 10 )); [ "$t" -gt "$max" ] && t=$max
  if [ "$t" -lt 20 ]; then echo "== $name: skipped ($(left) s left)" | tee -a "$OUT/steps.txt"; return; fi
  echo "== $name (timeout ${t} s, $(left) s left) $(date -u +%T)" | tee -a "$OUT/steps.txt"
  timeout "$t" "$@" 2>&1 | tee "$OUT/$name.txt"
  echo "== $name: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
}
[ -d "$BASE/autosymm" ] || { echo "no base tree at $BASE (git archive <commit> | tar -x -C $BASE)"; exit 2; }
{ date -u; git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  command -v ncu && ncu --version | tail -1; } 2>&1 | tee "$OUT/env.txt"
B=scripts/bench_emulated_floor.py
# 1. W = 2, every family and size, base and this tree alternately (3 turns each), floor in every case
W2_ARGS=()
[ -n "${W2_SIZES:-}" ] && W2_ARGS+=(--sizes "$W2_SIZES")
[ -n "${W2_MATCH:-}" ] && W2_ARGS+=(--match "$W2_MATCH")
step compare_w2 "${W2_MAX_S:-390}" python3 $B --compare "$BASE" --world-sizes 2 --quick --alternations 3 --out "$OUT/w2" \
  --turn-timeout 120 --compile-timeout 170 ${W2_ARGS[@]+"${W2_ARGS[@]}"}
python3 $B --summarise "$OUT/w2" > /dev/null 2>&1  # the table from what was measured, even after a timeout
# 2. W = 4 and 8 (contended on one GPU: reported, not held to targets), the small set, one turn each
[ "${W48:-1}" = 0 ] || step compare_w48 130 python3 $B --compare "$BASE" --world-sizes 4,8 --quick --alternations 1 --out "$OUT/w48" \
  --sizes 8K,64K --match '^ar:(lamport|one_shot_push\+db|one_shot\+db) |^fused_(lamport|one_shot_push\+db) 1x8192' \
  --turn-timeout 100 --compile-timeout 80
python3 $B --summarise "$OUT/w48" > /dev/null 2>&1
# 3. Nsight Compute: rank 0's kernel alone (no peer to wait for), its own instructions and stalls
if [ "${NCU:-1}" = 0 ]; then
  echo "== ncu: skipped (NCU=0)" | tee -a "$OUT/steps.txt"
elif command -v ncu >/dev/null; then
  for tree in "$BASE" .; do
    name=ncu_$( [ "$tree" = . ] && echo new || echo base )
    # 6 cases x 3 launches of rank 0 alone: Lamport and push + double buffer at 8 KiB (both sized
    # configs), fused 1 x 8192 Lamport and push + double buffer (default epilogue, 16 warps)
    step "$name" 75 ncu --clock-control none --target-processes all \
      -k 'regex:_lamport_all_reduce|_push_one_shot_all_reduce|_one_shot_all_reduce_rmsnorm' \
      --section SpeedOfLight --section WarpStateStats --section InstructionStats --csv --page details \
      python3 $B --tree "$tree" --profile --world-sizes 2 --sizes 8K --quick \
      --match '^(ar:lamport|ar:one_shot_push\+db) 8KiB|^fused_(lamport|one_shot_push\+db) 1x8192'
  done
else
  echo "== ncu: not on this machine" | tee -a "$OUT/steps.txt"
fi
# 4. the emulated-rank GPU tests of the changed kernels (W = 2, 4, 8), with the time left
step emulated_tests "${TESTS_MAX_S:-240}" python3 -m pytest tests/gpu/test_emulated_ranks_gpu.py -q -p no:cacheprovider -x \
  -k "${TESTS_K:-small_all_reduce or lamport or double or barrier or fused_epilogues}"
echo "total $(( $(date +%s) - start )) s; tables: $OUT/w2/floor_compare.md $OUT/w48/floor_compare.md" | tee -a "$OUT/steps.txt"
# the rows the issue's targets name (the whole tables are in $OUT)
grep -hE '^\| W|2KiB|8KiB|64KiB|1x8192|1x4096' "$OUT/w2/floor_compare.md" 2>/dev/null
grep -hE 'ERR' "$OUT/w2/floor_compare.md" "$OUT/w48/floor_compare.md" 2>/dev/null | head -5

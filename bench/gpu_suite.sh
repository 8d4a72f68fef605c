#!/usr/bin/env bash
# Every one-GPU gpu-marked test on one GPU, seven pytest processes at once (test_gpu.py in two
# halves by node id). Logs, per-group wall times and the tree under ${OUT:-/tmp/gpu-suite}.
# Usage: bash bench/gpu_suite.sh [seconds each group may run, default 540]
cd "$(dirname "$0")/.."
R=${OUT:-/tmp/gpu-suite}; mkdir -p "$R"; LIMIT=${1:-540}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
{ git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc --all
  python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } > "$R/machine.txt"
python -m pytest -q --collect-only -m gpu tests/test_gpu.py 2>/dev/null | grep "::" > "$R/gpu-ids.txt"
half=$(( $(wc -l < "$R/gpu-ids.txt") / 2 ))
head -n "$half" "$R/gpu-ids.txt" > "$R/gpu-a.txt"; tail -n +"$((half + 1))" "$R/gpu-ids.txt" > "$R/gpu-b.txt"
t() {
  local name=$1; shift; local s=$SECONDS
  timeout "$LIMIT" python -m pytest -q -rfE -p no:cacheprovider -p no:warnings --durations=5 -m gpu "$@" > "$R/$name.log" 2>&1
  echo "$name rc=$? $(( SECONDS - s ))s $(tail -n 1 "$R/$name.log")" | tee -a "$R/summary.txt"
}
t gpu-a $(cat "$R/gpu-a.txt") tests/test_determinism.py &
t gpu-b $(cat "$R/gpu-b.txt") &
t families tests/test_families_gpu.py tests/test_fuse.py tests/test_moments.py tests/test_placement.py \
  tests/test_policy.py tests/test_decode.py &
t moe-a tests/test_moe_gpu.py -k "not (v2 or gpt_oss)" &
t moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" &
t vision tests/test_vision_gpu.py &
t rl tests/test_rollout_engine.py tests/test_grpo.py tests/test_offpolicy.py tests/test_loss_head.py \
  tests/test_startup.py tests/test_preference_training.py tests/test_disk_tier.py &
wait
echo "all groups done at ${SECONDS}s" | tee -a "$R/summary.txt"
grep -h "^FAILED\|^ERROR" "$R"/*.log | cut -c1-300

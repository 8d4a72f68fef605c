#!/usr/bin/env bash
# Every one-GPU gpu-marked file on one H100 (16 cores): five pytest processes on GPU 0, detached.
cd "$(dirname "$0")/.."
R=/tmp/h/res; mkdir -p $R
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt; nproc >> $R/t-gpus.txt
git rev-parse HEAD > $R/t-tree.txt
cat > /tmp/h/run.sh <<'EOS'
R=/tmp/h/res; export OMP_NUM_THREADS=3
t() { local name=$1; shift; local s=$(date +%s); CUDA_VISIBLE_DEVICES=0 timeout 1200 python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=0 rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; }
( t single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py; t post tests/test_grpo.py tests/test_preference_training.py ) &
t gpu tests/test_gpu.py &
t families tests/test_families_gpu.py &
t moe-a tests/test_moe_gpu.py -k "not (v2 or gpt_oss)" &
t moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" &
wait; echo done >> $R/t-summary.txt
EOS
setsid nohup bash /tmp/h/run.sh > /tmp/h/run.log 2>&1 < /dev/null &
for i in $(seq ${1:-500}); do grep -q done $R/t-summary.txt 2>/dev/null && break; sleep 1; done
cat $R/t-gpus.txt $R/t-summary.txt; grep -h " passed\| failed" $R/t-*.log | grep -v "^PASSED"; grep -h "^FAILED\|^ERROR" $R/t-*.log | head
tar czf $OUT/h100.tgz -C $R . ; ls -la $OUT

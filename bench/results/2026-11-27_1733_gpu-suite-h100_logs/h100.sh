#!/usr/bin/env bash
# Start (detached) every one-GPU gpu-marked file on GPU 0, five pytest processes at once (as on
# 2026-11-27_1611), then bench/compiler.py alone; $1: seconds to wait here. A second call with
# "collect" waits for the queue and packs what it wrote.
cd "$(dirname "$0")/.."
R=/tmp/h/res; mkdir -p $R /tmp/h/bench
export PYTHONUNBUFFERED=1
if [ "$2" != collect ]; then
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt; nproc >> $R/t-gpus.txt
python -c "import torch; print(torch.__version__)" >> $R/t-gpus.txt
git rev-parse HEAD > $R/t-tree.txt; git status --short >> $R/t-tree.txt
cp -r . /tmp/h/tree  # a copy the queue runs in, so that a later call's tree cannot change under it
cat > /tmp/h/run.sh <<'EOS'
cd /tmp/h/tree
R=/tmp/h/res; export OMP_NUM_THREADS=3
t() { local name=$1; shift; local s=$(date +%s); CUDA_VISIBLE_DEVICES=0 timeout 1200 python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=0 rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; }
( t single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py; t post tests/test_grpo.py tests/test_preference_training.py ) &
t gpu tests/test_gpu.py &
t families tests/test_families_gpu.py &
t moe-a tests/test_moe_gpu.py -k "not (v2 or gpt_oss)" &
t moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" &
wait; echo "suite done $(date +%T)" >> $R/t-summary.txt
unset OMP_NUM_THREADS
s=$(date +%s); CUDA_VISIBLE_DEVICES=0 timeout 400 python bench/compiler.py --out /tmp/h/bench > $R/b-compiler.log 2>&1
echo "compiler rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt
echo done >> $R/t-summary.txt
EOS
setsid nohup bash /tmp/h/run.sh > /tmp/h/run.log 2>&1 < /dev/null &
fi
for i in $(seq ${1:-500}); do grep -q "^done" $R/t-summary.txt 2>/dev/null && break; sleep 1; done
cat $R/t-gpus.txt $R/t-summary.txt; grep -h " passed\| failed" $R/t-*.log | grep -v "^PASSED"; grep -h "^FAILED\|^ERROR" $R/t-*.log | head; tail -12 $R/b-compiler.log 2>/dev/null
cp -r /tmp/h/bench $R/ 2>/dev/null; tar czf $OUT/h100.tgz -C $R . ; ls -la $OUT

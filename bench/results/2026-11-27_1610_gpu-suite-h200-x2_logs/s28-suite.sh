#!/usr/bin/env bash
# Every gpu-marked file on a two-GPU host: two pytest processes per GPU, then the two-GPU files.
R=$1
mkdir -p $R
export OMP_NUM_THREADS=6 PYTHONUNBUFFERED=1
t() { local gpus=$1 name=$2; shift 2; local s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpus timeout 1200 python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=$gpus rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt
nproc >> $R/t-gpus.txt; grep MemTotal /proc/meminfo >> $R/t-gpus.txt
git rev-parse HEAD > $R/t-tree.txt 2>/dev/null || true
( t 0 single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py; t 0 gpu tests/test_gpu.py ) & a=$!
( t 0 moe-a tests/test_moe_gpu.py -k "not (v2 or gpt_oss)"; t 0 post tests/test_grpo.py tests/test_preference_training.py ) & b=$!
t 1 families tests/test_families_gpu.py & c=$!
t 1 moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" & d=$!
wait $b $c
t 0,1 twogpu tests/test_distributed.py tests/test_sharded.py
wait
echo done >> $R/t-summary.txt

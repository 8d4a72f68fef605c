#!/usr/bin/env bash
# Two-H200 machine (one GPU), freshly started: 8B all in host memory, 16k tokens a step.
# 1) 24 GPU-stepped units with 4 kept graphs beside DeepSpeed, one invocation (traced);
# 2) `auto` with ADAM_IN_STEP 0.62 (traced). Every result is written under $OUT as it lands.
cd "$(dirname "$0")/.."
R=$OUT; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
git log --oneline -1 > $R/r-machine.txt 2>/dev/null; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> $R/r-machine.txt; nproc >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step s24k4-ds env CUDA_VISIBLE_DEVICES=0 timeout 390 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units 24 --keep-layers 4 --max-host-memory 240GiB --steps 10 --warmup 3 --deadline 380 --systems megatrain-host,deepspeed --trace --out $R/bench --tag x2-B16k-s24-keep4-ds12
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
step auto env CUDA_VISIBLE_DEVICES=0 timeout 170 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 10 --warmup 3 --deadline 165 --systems megatrain-host --trace --out $R/bench --tag x2-B16k-auto-refit
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null

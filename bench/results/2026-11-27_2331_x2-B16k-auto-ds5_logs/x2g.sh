#!/usr/bin/env bash
# 8B all in host memory on a freshly started two-H200 machine: `auto` beside DeepSpeed in one
# invocation (the first process: the plan's second AdamW reading), then `megatrain plan` for the
# same run (the train path's plan against the benchmark's).
cd "$(dirname "$0")/.."
R=/tmp/r/res; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; lscpu | grep -i "numa\|model name\|socket" >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
B="python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3"
step auto-ds env CUDA_VISIBLE_DEVICES=0 timeout 480 $B --deadline 470 --systems megatrain-host,deepspeed --out $R/bench --tag x2-B16k-auto-ds5
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-700
grep -h "host_weight_copy\|GPU-stepped:\|host AdamW\|adam" $R/bench/*/megatrain*.log 2>/dev/null | head -8
step plan env CUDA_VISIBLE_DEVICES=0 timeout $(( 580 - SECONDS )) python -m megatrain plan scratch/b8/plan.yaml
grep -h "GPU-stepped\|host_weight_copy\|estimated step\|total" $R/r-plan.log | head -8
cd $R && tar czf $OUT/res.tgz . && echo packed

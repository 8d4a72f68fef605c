#!/usr/bin/env bash
# 8B all in host memory on a freshly started two-H200 machine (one GPU): `auto` (now keeping the
# graphs that fit under the stepped units' peak) beside DeepSpeed in one invocation, the first process.
cd "$(dirname "$0")/.."
R=/tmp/r/res; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
git log --oneline -1 > $R/r-tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; lscpu | grep -i "numa\|model name\|socket" >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
B="python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 10 --warmup 3"
step auto-ds env CUDA_VISIBLE_DEVICES=0 timeout 540 $B --deadline 530 --systems megatrain-host,deepspeed --out $R/bench --tag x2-B16k-auto-keep-ds7
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-900
grep -h "kept graphs\|GPU-stepped:\|host_weight_copy\|gpu_step_units" $R/bench/*/megatrain*.log 2>/dev/null | head -8
cd $R && tar czf $OUT/res.tgz . && echo packed

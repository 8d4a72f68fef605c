#!/usr/bin/env bash
# Two-H200 machine (one GPU), freshly started: 8B all in host memory with 24 GPU-stepped units and
# 4 kept layer graphs (the configuration that ran 1.865 s in _0558) beside DeepSpeed, one
# invocation, the machine's first process; the profiled step's trace kept.
cd "$(dirname "$0")/.."
R=/tmp/r/t4; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step s24k4-ds env CUDA_VISIBLE_DEVICES=0 timeout 385 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units 24 --keep-layers 4 --max-host-memory 240GiB --steps 10 --warmup 3 --deadline 375 --systems megatrain-host,deepspeed --trace --out $R/bench --tag x2-B16k-s24-keep4-ds11
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-900
cd $R && tar czf $OUT/t4.tgz . && echo packed

#!/usr/bin/env bash
# 8B all in host memory, two-H200 machine (one GPU): `auto`, and `auto` with 4 kept graphs, each
# with its profiled step's trace kept (the compute stream's idle gaps).
cd "$(dirname "$0")/.."
R=/tmp/r/t1; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
B="python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3 --systems megatrain-host --trace"
step auto env CUDA_VISIBLE_DEVICES=0 timeout 260 $B --deadline 250 --out $R/bench --tag x2-B16k-auto-trace
step keep4 env CUDA_VISIBLE_DEVICES=0 timeout 260 $B --keep-layers 4 --deadline 250 --out $R/bench --tag x2-B16k-keep4-trace
grep -h "^| megatrain" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-2500
cd $R && tar czf $OUT/t1.tgz . && echo packed

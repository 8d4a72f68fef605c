#!/usr/bin/env bash
# One H100 (16 cores): the host AdamW beside what a step runs beside it (launching thread, link),
# clipadam's shared blocks against a share a thread; then 8B all in host memory with `auto`
# (the host AdamW's rate in the step, each thread's CPU and run-queue seconds a step).
cd "$(dirname "$0")/.."
R=/tmp/r/b1; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
git log --oneline -1 > $R/r-tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; lscpu | grep -i "numa\|model name\|socket" >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step beside timeout 200 python bench/adamw.py --engine --engine-params 3.8e9 --beside none,launch,link,launch+link --blocks 65536,0 --repeats 2 --out $R
grep "^|" $R/r-beside.log
step auto timeout 330 python bench/bench.py --model B --tokens-per-step 16k --systems megatrain-host --gpu-step-units auto --steps 8 --warmup 3 --deadline 320 --out $R/bench --tag h100-B16k-auto-blocks
grep -h "^| megatrain" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-1400
cd $R && tar czf $OUT/b1.tgz . && echo packed

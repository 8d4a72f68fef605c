#!/usr/bin/env bash
# One H100 (16 cores, 128 GiB host): 8B all in host memory with `auto` (the host AdamW's rate inside
# the step), then the kernel beside the engine's pass at the state size the step's host AdamW stepped.
cd "$(dirname "$0")/.."
R=/tmp/r/h1; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
git log --oneline -1 > $R/r-tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; lscpu | grep -i "numa\|model name\|socket" >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step auto timeout 330 python bench/bench.py --model B --tokens-per-step 16k --systems megatrain-host --gpu-step-units auto --steps 8 --warmup 3 --deadline 320 --out $R/bench --tag h100-B16k-auto-keep
grep -h "^| megatrain" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-900
step adamw timeout 220 python bench/adamw.py --engine --engine-params 3.8e9 --clip-fused --copy --out $R
tail -12 $R/r-adamw.log
cd $R && tar czf $OUT/h1.tgz . && echo packed

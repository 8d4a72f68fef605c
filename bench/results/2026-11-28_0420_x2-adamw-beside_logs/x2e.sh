#!/usr/bin/env bash
# The same warm machine: the host AdamW with the bf16 copy beside a launching thread and the link,
# at the state size the step's host AdamW stepped.
cd "$(dirname "$0")/.."
R=/tmp/r/x2e; mkdir -p $R
export PYTHONUNBUFFERED=1
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step beside env CUDA_VISIBLE_DEVICES=0 timeout 300 python bench/adamw.py --engine --engine-params 2.3e9 --copy --beside none,launch,link,launch+link --blocks 65536,0 --repeats 2 --out $R
grep "^|" $R/r-beside.log
cd $R && tar czf $OUT/x2e.tgz . && echo packed

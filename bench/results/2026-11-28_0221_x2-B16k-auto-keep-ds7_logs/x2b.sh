#!/usr/bin/env bash
# The same warm machine: the host AdamW kernel beside the engine's pass at the state size the step's host AdamW stepped.
cd "$(dirname "$0")/.."
R=/tmp/r/aw; mkdir -p $R
export PYTHONUNBUFFERED=1
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step adamw timeout 400 python bench/adamw.py --engine --engine-params 4e9 --clip-fused --copy --out $R
tail -14 $R/r-adamw.log
cd $R && tar czf $OUT/aw.tgz . && echo packed

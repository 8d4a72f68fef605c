#!/usr/bin/env bash
# Two-H200 machine (one GPU), warm after t5: 8B `auto` (ADAM_IN_STEP 0.62) beside DeepSpeed in one
# invocation, DeepSpeed given the time to finish; results packed into $OUT after each run.
cd "$(dirname "$0")/.."
R=/tmp/r/t6; mkdir -p $R/bench
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
pack() { (cd $R && tar czf $OUT/t6.tgz .); }
( while sleep 20; do pack; done ) & P=$!
env CUDA_VISIBLE_DEVICES=0 timeout 470 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 10 --warmup 3 --deadline 465 --timeout 260 --systems megatrain-host,deepspeed --trace --out $R/bench --tag x2-B16k-auto-refit-ds13 > $R/r-auto-ds.log 2>&1; echo rc=$?
kill $P; pack
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md
grep -h "tokens/step: step" $R/bench/*.md | cut -c1-700

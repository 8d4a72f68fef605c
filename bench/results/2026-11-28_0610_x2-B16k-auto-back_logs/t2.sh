#!/usr/bin/env bash
# Two-H200 machine (one GPU): the write-backs on a stream of their own, each behind its unit's
# kernel. GPU tests of the stepper (test_gpu.py), then 8B `auto` with the change beside the tree
# before it (scratch/old, HEAD e5ece7f) in the same call, each with its profiled step's trace.
cd "$(dirname "$0")/.."
R=/tmp/r/t2; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step gputests env CUDA_VISIBLE_DEVICES=0 timeout 150 python -m pytest -q -m gpu tests/test_gpu.py -x -p no:cacheprovider
tail -3 $R/r-gputests.log
B="--model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3 --systems megatrain-host --trace"
step new env CUDA_VISIBLE_DEVICES=0 timeout 200 python bench/bench.py $B --deadline 190 --out $R/bench --tag x2-B16k-auto-back
step old env CUDA_VISIBLE_DEVICES=0 timeout 200 python scratch/old/bench/bench.py ${B% --trace} --deadline 190 --out $R/bench --tag x2-B16k-auto-e5ece7f
grep -h "^| megatrain" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-1200
cd $R && tar czf $OUT/t2.tgz . && echo packed

#!/usr/bin/env bash
# Two-H200 machine (one GPU): the GPU-stepped units' kernels queued as the next forward sweep's
# fetches reach them. Its GPU tests (test_gpu.py's schedule and stepping tests), then 8B `auto`
# beside DeepSpeed in one invocation, the profiled step's trace kept.
cd "$(dirname "$0")/.."
R=/tmp/r/t3; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step gputests env CUDA_VISIBLE_DEVICES=0 timeout 130 python -m pytest -q -rA -m gpu tests/test_gpu.py -p no:cacheprovider -k "stepped or serial or eval_after or freed or step_stream or immediate or every_placement or host_weight_copy or page_locking"
grep -h "passed\|failed\|PASSED\|FAILED" $R/r-gputests.log | tail -25
step auto-ds env CUDA_VISIBLE_DEVICES=0 timeout 420 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 10 --warmup 3 --deadline 410 --systems megatrain-host,deepspeed --trace --out $R/bench --tag x2-B16k-auto-deferred-ds10
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-1500
cd $R && tar czf $OUT/t3.tgz . && echo packed

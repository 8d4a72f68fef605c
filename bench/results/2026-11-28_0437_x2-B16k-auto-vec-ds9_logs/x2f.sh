#!/usr/bin/env bash
# 8B all in host memory on a freshly started two-H200 machine (one GPU): `auto` beside DeepSpeed in
# one invocation, the first process; clipadam vectorised at weight decay 0 (bench.py's).
cd "$(dirname "$0")/.."
R=/tmp/r/x2f; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; lscpu | grep -i "numa\|model name\|socket" >> $R/r-machine.txt; free -g >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
B="python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3"
step auto-ds env CUDA_VISIBLE_DEVICES=0 timeout 375 $B --deadline 365 --systems megatrain-host,deepspeed --out $R/bench --tag x2-B16k-auto-vec-ds9
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-1500
cd $R && tar czf $OUT/x2f.tgz . && echo packed

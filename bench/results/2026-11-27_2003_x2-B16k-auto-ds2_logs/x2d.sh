#!/usr/bin/env bash
cd "$(dirname "$0")/.."
R=$OUT/res; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; lscpu | grep -i "numa\|model name\|socket" >> $R/r-machine.txt; cat $R/r-machine.txt
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" | tee -a $R/r-summary.txt; }
step probe env PYTHONPATH=. python scratch/probecheck.py; cat $R/r-probe.log
B="python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3"
step auto-ds env CUDA_VISIBLE_DEVICES=0 timeout 400 $B --deadline 390 --systems megatrain-host,deepspeed --out $R/bench --tag x2-B16k-auto-ds2
step keep8 env CUDA_VISIBLE_DEVICES=0 timeout $(( 555 - SECONDS )) $B --deadline $(( 545 - SECONDS )) --systems megatrain-host --keep-layers 8 --out $R/bench --tag x2-B16k-keep8-2
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-560
grep -h "host_weight_copy\|GPU-stepped:" $R/bench/*/megatrain*.log 2>/dev/null | head -4

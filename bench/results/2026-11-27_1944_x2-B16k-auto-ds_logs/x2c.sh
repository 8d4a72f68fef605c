#!/usr/bin/env bash
# The two-GPU machine (one GPU used): 8B all in host memory at 16k tokens: the default plan beside
# DeepSpeed in one invocation, then kept layer graphs (8), then kept graphs with fewer GPU-stepped
# units (22). $1: seconds to wait; $2 = collect.
cd "$(dirname "$0")/.."
R=/tmp/r/res; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
if [ "$2" != collect ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt; git log -1 --format=%H >> $R/r-machine.txt
rm -rf /tmp/r/tree; cp -r . /tmp/r/tree
cat > /tmp/r/run.sh <<'EOS'
cd /tmp/r/tree; R=/tmp/r/res; export PYTHONPATH=/tmp/site
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" >> $R/r-summary.txt; }
B="python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3 --deadline 540"
step auto-ds env CUDA_VISIBLE_DEVICES=0 timeout 570 $B --systems megatrain-host,deepspeed --out $R/bench --tag x2-B16k-auto-ds
step keep8 env CUDA_VISIBLE_DEVICES=0 timeout 300 $B --systems megatrain-host --keep-layers 8 --out $R/bench --tag x2-B16k-keep8
step keep8-g22 env CUDA_VISIBLE_DEVICES=0 timeout 300 $B --systems megatrain-host --keep-layers 8 --gpu-step-units 22 --out $R/bench --tag x2-B16k-keep8-g22
echo done >> $R/r-summary.txt
EOS
setsid nohup bash /tmp/r/run.sh > /tmp/r/run.log 2>&1 < /dev/null &
fi
for i in $(seq ${1:-500}); do grep -q "^done" $R/r-summary.txt 2>/dev/null && break; sleep 1; done
cat $R/r-machine.txt $R/r-summary.txt 2>/dev/null
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
grep -h "tokens/step: step" $R/bench/*.md 2>/dev/null | cut -c1-700
tar czf $OUT/x2c.tgz -C $R . ; ls -la $OUT

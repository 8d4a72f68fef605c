#!/usr/bin/env bash
# The two-GPU machine: the compiler-timings GPU test, then 8B all in host memory with
# host_weight_copy beside DeepSpeed in one invocation. $1: seconds to wait; $2 = collect.
cd "$(dirname "$0")/.."
R=/tmp/r/res; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
if [ "$2" != collect ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/r-machine.txt; nproc >> $R/r-machine.txt
rm -rf /tmp/r/tree; cp -r . /tmp/r/tree
cat > /tmp/r/run.sh <<'EOS'
cd /tmp/r/tree; R=/tmp/r/res; export PYTHONPATH=/tmp/site
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/r-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" >> $R/r-summary.txt; }
step test env CUDA_VISIBLE_DEVICES=0 PYTHONPATH= timeout 200 python -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_gpu.py -k compiled_layers_compute
step B16k-copy-ds env CUDA_VISIBLE_DEVICES=0 timeout 560 python bench/bench.py --model B --tokens-per-step 16k --systems megatrain-host,deepspeed --gpu-step-units auto --host-weight-copy --max-host-memory 240GiB --steps 8 --warmup 3 --deadline 520 --out $R/bench --tag x2-B16k-hostcopy-ds
echo done >> $R/r-summary.txt
EOS
setsid nohup bash /tmp/r/run.sh > /tmp/r/run.log 2>&1 < /dev/null &
fi
for i in $(seq ${1:-500}); do grep -q "^done" $R/r-summary.txt 2>/dev/null && break; sleep 1; done
cat $R/r-machine.txt $R/r-summary.txt 2>/dev/null; grep -h " passed\| failed" $R/r-test.log 2>/dev/null | grep -v "^PASSED"
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
tar czf $OUT/x2b.tgz -C $R . ; ls -la $OUT

#!/usr/bin/env bash
# The two-GPU machine, detached: [H100s only: the two-GPU test files], bench/compiler.py on GPU 0,
# then 8B all in host memory beside DeepSpeed, then the same with host_weight_copy.
# $1: seconds to wait here; $2 = collect: only wait and pack.
cd "$(dirname "$0")/.."
R=/tmp/q/res; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
if [ "$2" != collect ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $R/pip.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/q-machine.txt; nproc >> $R/q-machine.txt; free -g >> $R/q-machine.txt
python -c "import torch; print(torch.__version__)" >> $R/q-machine.txt
rm -rf /tmp/q/tree; cp -r . /tmp/q/tree
cat > /tmp/q/run.sh <<'EOS'
cd /tmp/q/tree; R=/tmp/q/res; export PYTHONPATH=/tmp/site
step() { local name=$1; shift; local s=$(date +%s); "$@" > $R/q-$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s $(date +%T)" >> $R/q-summary.txt; }
if grep -q H100 $R/q-machine.txt; then
  step twogpu env CUDA_VISIBLE_DEVICES=0,1 timeout 600 python -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_distributed.py tests/test_sharded.py
fi
step compiler env CUDA_VISIBLE_DEVICES=0 timeout 400 python bench/compiler.py --out $R/bench
step B16k env CUDA_VISIBLE_DEVICES=0 timeout 560 python bench/bench.py --model B --tokens-per-step 16k --systems megatrain-host,deepspeed --gpu-step-units auto --max-host-memory 240GiB --steps 8 --warmup 3 --deadline 500 --out $R/bench --tag x2-B16k
step B16k-copy env CUDA_VISIBLE_DEVICES=0 timeout 400 python bench/bench.py --model B --tokens-per-step 16k --systems megatrain-host --gpu-step-units auto --host-weight-copy --max-host-memory 240GiB --steps 8 --warmup 3 --deadline 380 --out $R/bench --tag x2-B16k-hostcopy
echo done >> $R/q-summary.txt
EOS
setsid nohup bash /tmp/q/run.sh > /tmp/q/run.log 2>&1 < /dev/null &
fi
for i in $(seq ${1:-500}); do grep -q "^done" $R/q-summary.txt 2>/dev/null && break; sleep 1; done
cat $R/q-machine.txt $R/q-summary.txt 2>/dev/null; grep -h " passed\| failed" $R/q-twogpu.log 2>/dev/null | grep -v "^PASSED"
grep -h "^|" $R/bench/*compiler*.md 2>/dev/null; grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md 2>/dev/null
tar czf $OUT/x2.tgz -C $R . ; ls -la $OUT

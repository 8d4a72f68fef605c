#!/usr/bin/env bash
# Two-H200 machine, each GPU held to an H100's memory (another process holds all but 81,000 MiB of it):
# every one-GPU gpu-marked test, six pytest processes over the two GPUs; packed into $OUT/s3.tgz.
cd "$(dirname "$0")/.."
R=/tmp/s/s3; mkdir -p $R
git status --short > $R/t-tree.txt 2>/dev/null
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt; nproc >> $R/t-gpus.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $R/t-gpus.txt
for g in 0 1; do
CUDA_VISIBLE_DEVICES=$g python - > $R/ballast-$g.txt 2>&1 <<'PY' &
import time, torch
free, total = torch.cuda.mem_get_info()
held = torch.empty(free - 81000 * 2**20, dtype=torch.uint8, device="cuda")
print(f"before {free / 2**20:.0f} MiB free of {total / 2**20:.0f}; held {held.numel() / 2**20:.0f}; after {torch.cuda.mem_get_info()[0] / 2**20:.0f} MiB free", flush=True)
time.sleep(3600)
PY
B="$B $!"
done
sleep 20; cat $R/ballast-*.txt; nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $R/t-gpus.txt
pack() { (cd $R && tar czf $OUT/s3.tgz .); }
t() { local gpu=$1 name=$2; shift 2; local s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpu timeout $(( 560 - SECONDS )) python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=$gpu rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; pack; }
( t 0 gpu tests/test_gpu.py tests/test_loss_head.py tests/test_determinism.py; t 0 single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py ) &
t 0 post tests/test_grpo.py tests/test_preference_training.py &
t 0 moe-a1 tests/test_moe_gpu.py -k "not (v2 or gpt_oss) and (olmoe or mixtral or qwen)" &
t 1 families tests/test_families_gpu.py &
t 1 moe-a2 tests/test_moe_gpu.py -k "not (v2 or gpt_oss) and not (olmoe or mixtral or qwen)" &
t 1 moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" &
wait; echo "one-GPU files done at ${SECONDS}s" >> $R/t-summary.txt
cat $R/t-gpus.txt $R/t-summary.txt; tail -n 2 $R/t-*.log | grep -v "^$"; grep -h "^FAILED\|^ERROR" $R/t-*.log | head
kill $B; pack; echo packed

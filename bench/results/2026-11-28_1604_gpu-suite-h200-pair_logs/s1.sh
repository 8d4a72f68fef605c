#!/usr/bin/env bash
# Two-H200 machine: every one-GPU gpu-marked test over its two GPUs (the loss head's one-pass cross-entropy, the
# projection's fp32 accumulation, the layers' gradient buffers copied into), then bench/losshead.py alone; packed
# into $OUT/suite.tgz.
cd "$(dirname "$0")/.."
R=/tmp/s/res; mkdir -p $R/bench
git log --oneline -1 > $R/t-tree.txt 2>/dev/null; git status --short >> $R/t-tree.txt 2>/dev/null
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt; nproc >> $R/t-gpus.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $R/t-gpus.txt
pack() { (cd $R && tar czf $OUT/suite.tgz .); }
t() { local gpu=$1 name=$2; shift 2; local s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpu timeout $(( 470 - SECONDS )) python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=$gpu rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; pack; }
( t 0 gpu tests/test_gpu.py tests/test_loss_head.py; t 0 single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py ) &
( t 0 post tests/test_grpo.py tests/test_preference_training.py ) &
t 1 families tests/test_families_gpu.py &
t 1 moe-a tests/test_moe_gpu.py -k "not (v2 or gpt_oss)" &
t 1 moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" &
wait; echo "one-GPU files done at ${SECONDS}s" >> $R/t-summary.txt
CUDA_VISIBLE_DEVICES=0 timeout $(( 585 - SECONDS )) python bench/losshead.py --shape B --tokens 16384 --chunk 2790 --out $R/bench > $R/losshead.log 2>&1; echo "losshead rc=$? at ${SECONDS}s" >> $R/t-summary.txt
cat $R/t-gpus.txt $R/t-summary.txt; tail -n 3 $R/t-*.log | grep -v "^$"; grep -h "^FAILED\|^ERROR" $R/t-*.log | head; tail -6 $R/losshead.log
pack; echo packed

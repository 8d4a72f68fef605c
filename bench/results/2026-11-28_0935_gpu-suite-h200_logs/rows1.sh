#!/usr/bin/env bash
# Every one-GPU gpu-marked test on one H200 (the embedding's rows), five pytest processes at once; foreground, packed
# into $OUT/suite.tgz.
cd "$(dirname "$0")/.."
R=/tmp/s/res; mkdir -p $R
git log --oneline -1 > $R/t-tree.txt 2>/dev/null
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt; nproc >> $R/t-gpus.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $R/t-gpus.txt
t() { local name=$1; shift; local s=$(date +%s); CUDA_VISIBLE_DEVICES=0 timeout $(( 470 - SECONDS )) python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=0 rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; }
( t single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py; t post tests/test_grpo.py tests/test_preference_training.py ) &
t gpu tests/test_gpu.py &
t families tests/test_families_gpu.py &
t moe-a tests/test_moe_gpu.py -k "not (v2 or gpt_oss)" &
t moe-b tests/test_moe_gpu.py -k "v2 or gpt_oss" &
wait; echo "one-GPU files done at ${SECONDS}s" >> $R/t-summary.txt
cat $R/t-gpus.txt $R/t-summary.txt; tail -n 3 $R/t-*.log | grep -v "^$"; grep -h "^FAILED\|^ERROR" $R/t-*.log | head
cd $R && tar czf $OUT/suite.tgz . && echo packed

#!/usr/bin/env bash
# Every gpu-marked test, one-GPU files spread over the machine's two GPUs (several pytest
# processes a GPU), then the two-GPU file; foreground, packed into $OUT/suite.tgz.
cd "$(dirname "$0")/.."
R=/tmp/s/res3; mkdir -p $R
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/t-gpus.txt; nproc >> $R/t-gpus.txt
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $R/t-gpus.txt
t() { local name=$1 gpu=$2; shift 2; local s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpu timeout $(( 560 - SECONDS )) python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=$gpu rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; }
( t single 0 tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py; t post 0 tests/test_grpo.py tests/test_preference_training.py tests/test_sharded.py ) &
t gpu 1 tests/test_gpu.py &
t families 0 tests/test_families_gpu.py &
t moe-a 1 tests/test_moe_gpu.py -k "not (v2 or gpt_oss)" &
t moe-b 0 tests/test_moe_gpu.py -k "v2 or gpt_oss" &
wait; echo "one-GPU files done at ${SECONDS}s" >> $R/t-summary.txt
unset OMP_NUM_THREADS
[ $SECONDS -lt 420 ] && t two 0,1 tests/test_distributed.py tests/test_sharded.py
cat $R/t-gpus.txt $R/t-summary.txt; tail -n 3 $R/t-*.log | grep -v "^$"
cd $R && tar czf $OUT/suite.tgz . && echo packed

#!/usr/bin/env bash
# Two-H200 machine, warm after s1.sh: the one-GPU gpu-marked tests s1.sh's call cut (the MoE files but v2 and
# gpt-oss, the disk tier, placement, policy, decode), over both GPUs; packed into $OUT/suite2.tgz.
cd "$(dirname "$0")/.."
R=/tmp/s/res2; mkdir -p $R
git log --oneline -1 > $R/t-tree.txt 2>/dev/null
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
t() { local gpu=$1 name=$2; shift 2; local s=$(date +%s); CUDA_VISIBLE_DEVICES=$gpu timeout $(( 265 - SECONDS )) python -m pytest -q -rA -p no:cacheprovider --durations=12 -m gpu "$@" > $R/t-$name.log 2>&1; echo "$name gpus=$gpu rc=$? $(( $(date +%s)-s ))s" >> $R/t-summary.txt; }
t 0 single tests/test_disk_tier.py tests/test_placement.py tests/test_policy.py tests/test_decode.py &
t 0 moe-a1 tests/test_moe_gpu.py -k "not (v2 or gpt_oss) and (olmoe or mixtral or qwen)" &
t 1 moe-a2 tests/test_moe_gpu.py -k "not (v2 or gpt_oss) and not (olmoe or mixtral or qwen)" &
wait
cat $R/t-summary.txt; tail -n 2 $R/t-*.log | grep -v "^$"; grep -h "^FAILED\|^ERROR" $R/t-*.log | head
cd $R && tar czf $OUT/suite2.tgz . && echo packed

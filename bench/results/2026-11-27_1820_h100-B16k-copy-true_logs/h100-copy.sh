#!/usr/bin/env bash
# One H100 (128 GiB host): 8B all in host memory at 16k with host_weight_copy: auto (the default),
# then with the other choice forced, one invocation each, back to back.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
B="python bench/bench.py --model B --tokens-per-step 16k --systems megatrain-host --gpu-step-units auto --steps 7 --warmup 3 --out $OUT"
s=$(date +%s); timeout 300 $B --deadline 280 --tag h100-B16k-copy-auto > $OUT/auto.log 2>&1; echo "auto rc=$? $(( $(date +%s)-s ))s"
other=$(python - <<'PY'
import glob, json, os
d = json.load(open(glob.glob(os.environ["OUT"] + "/*copy-auto.json")[0]))
r = next(x for x in d if x["system"] == "megatrain-host")
print("false" if r["plan"]["host_weight_copy"] else "true")
PY
)
echo "auto took the copy: $([ "$other" = false ] && echo yes || echo no); now --host-weight-copy $other"
s=$(date +%s); timeout 280 $B --host-weight-copy $other --deadline 260 --tag h100-B16k-copy-$other > $OUT/other.log 2>&1; echo "other rc=$? $(( $(date +%s)-s ))s"
grep -h "^| megatrain" $OUT/*.md; grep -h "step times\|serial step" $OUT/*.md | cut -c1-300

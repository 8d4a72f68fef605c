#!/usr/bin/env bash
# One H200: full_determinism under the expert families and GRPO on CUDA (strict mode raises on an op
# without a deterministic form), two runs each bitwise.
cd "$(dirname "$0")/.."
R=/tmp/r/d3; mkdir -p $R
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt
pack() { (cd $R && tar czf $OUT/d3.tgz .); }
( while sleep 20; do pack; done ) & P=$!
timeout 420 python -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_determinism.py tests/test_grpo.py -k "expert_families or full_determinism" --durations=8 > $R/det2.log 2>&1; echo "rc=$? $(date -u +%T)"
kill $P; pack
tail -14 $R/det2.log; grep -h "Error\|error" $R/det2.log | sort | uniq -c | head -10

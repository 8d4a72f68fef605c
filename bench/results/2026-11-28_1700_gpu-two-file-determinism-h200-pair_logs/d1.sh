#!/usr/bin/env bash
# Two-GPU machine: the two-GPU test files; then, side by side, the determinism GPU tests (GPU 0) and
# bench/determinism.py (GPU 1). Results packed into $OUT as they come.
cd "$(dirname "$0")/.."
R=/tmp/r/d1; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
pack() { (cd $R && tar czf $OUT/d1.tgz .); }
( while sleep 20; do pack; done ) & P=$!
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpus.txt; git log -1 --format=%H > $R/tree.txt 2>/dev/null
echo "== two-GPU files $(date -u +%T)"
CUDA_VISIBLE_DEVICES=0,1 timeout 250 python -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_distributed.py tests/test_sharded.py --durations=8 > $R/two.log 2>&1; echo "two rc=$? $(date -u +%T)"
tail -12 $R/two.log
echo "== determinism tests (GPU 0) and bench (GPU 1) $(date -u +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 300 python -m pytest -q -rA -p no:cacheprovider -m gpu tests/test_determinism.py tests/test_preference_training.py -k "repeat or switch" --durations=8 > $R/det-tests.log 2>&1 &
T=$!
CUDA_VISIBLE_DEVICES=1 timeout 300 python bench/determinism.py --shape S --seq 4096 --accum 4 --steps 6 --out $R/bench > $R/det-bench.log 2>&1; echo "bench rc=$? $(date -u +%T)"
wait $T; echo "tests rc=$? $(date -u +%T)"
kill $P; pack
tail -15 $R/det-tests.log
grep -v Warning $R/det-bench.log | tail -8

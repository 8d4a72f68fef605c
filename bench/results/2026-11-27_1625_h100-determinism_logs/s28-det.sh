#!/usr/bin/env bash
# Inductor's deterministic mode on the GPU: the new test with it (must pass) and without (should fail),
# and the compile-heavy gpu tests with it, in parallel on one GPU.
export OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1; R=/tmp/det; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
q() { local name=$1; shift; local s=$(date +%s); timeout 420 "$@" > $R/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s)-s ))s"; }
q on python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k round_alike &
q off python -c "import sys, pytest; sys.path.insert(0, 'tests'); import megatrain.models.compiling as c; c.DETERMINISTIC = False; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'gpu', 'tests/test_gpu.py', '-k', 'round_alike']))" &
q tier python -m pytest -q -p no:cacheprovider -m gpu tests/test_disk_tier.py tests/test_placement.py tests/test_decode.py tests/test_policy.py &
q gpu python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -k "flex or tiled or fp32 or bf16 or probe or packed or every_placement or clip" &
wait
for f in $R/*.log; do echo "== $f"; grep -h " passed\| failed\|^FAILED\|round apart" $f | cut -c1-400; done

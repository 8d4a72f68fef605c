#!/usr/bin/env bash
# One H200, freshly started, the last of the session's device time: the rows' and the stepped units' GPU tests, then 8B `auto` alone (no DeepSpeed: no ratio) with the pass's ids on the device before the step and each stepped unit's write-back right after its kernels
# results packed into $OUT every 20 s.
cd "$(dirname "$0")/.."
R=/tmp/r/r10; mkdir -p $R/bench
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
env CUDA_VISIBLE_DEVICES=0 timeout 65 python -m pytest -q -m gpu tests/test_gpu.py -k "rows or gpu_stepped_units_equal" > $R/tests.log 2>&1; echo tests rc=$?; tail -8 $R/tests.log
pack() { (cd $R && tar czf $OUT/r10.tgz .); }
( while sleep 20; do pack; done ) & P=$!
env CUDA_VISIBLE_DEVICES=0 timeout 175 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 10 --warmup 3 --deadline 170 --timeout 250 --systems megatrain-host --trace --out $R/bench --tag x2-B16k-auto-wayback-ids > $R/r-auto-ds.log 2>&1; echo rc=$?
kill $P; pack
grep -h "^| megatrain\|^| deepspeed" $R/bench/*.md
grep -h "tokens/step: step" $R/bench/*.md | cut -c1-700
python - <<'PY'
import json, glob
for f in glob.glob("/tmp/r/r10/bench/*.json"):
    d = json.load(open(f))
    for r in (d if isinstance(d, list) else d.get("runs", [])):
        p = r.get("plan") or {}
        print(r.get("system"), "rows", p.get("embed_rows"), "units", p.get("gpu_stepped_units"), "keep", p.get("keep_layers"), "plan s", p.get("step_time_s"), "step", r.get("step_s"), "adam", r.get("host_adam_params_s"), "rows s", r.get("rows_ahead_s"), "rows wait", r.get("rows_wait_s"), r.get("rows_copy_wait_s"), "wait", r.get("update_wait_s"), "times", [round(t, 3) for t in r.get("step_times", [])])
PY

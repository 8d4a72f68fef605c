#!/usr/bin/env bash
# One GPU of the two-GPU machine: 8B all in host memory (`auto`), 16k tokens a step, without and
# then with full_determinism, back to back in one call.
cd "$(dirname "$0")/.."
R=/tmp/r/d2; mkdir -p $R/bench
export PYTHONUNBUFFERED=1
pack() { (cd $R && tar czf $OUT/d2.tgz .); }
( while sleep 20; do pack; done ) & P=$!
for det in "" "--full-determinism"; do
  tag=x2-B16k-auto${det:+-fulldet}
  env CUDA_VISIBLE_DEVICES=0 timeout 270 python bench/bench.py --model B --tokens-per-step 16k --gpu-step-units auto --max-host-memory 240GiB --steps 9 --warmup 3 --deadline 265 --timeout 250 --systems megatrain-host $det --out $R/bench --tag $tag > $R/$tag.log 2>&1; echo "$tag rc=$? $(date -u +%T)"
done
kill $P; pack
grep -h "^| megatrain" $R/bench/*.md
python - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/r/d2/bench/*.json")):
    d = json.load(open(f))
    for r in (d if isinstance(d, list) else d.get("runs", [])):
        p = r.get("plan") or {}
        print(f.split("/")[-1], r.get("system"), "units", p.get("gpu_stepped_units"), "plan s", p.get("step_time_s"), "step", r.get("step_s"), "busy", r.get("gpu_busy"), "adam", r.get("host_adam_params_s"), "err", r.get("error"), "times", [round(t, 3) for t in r.get("step_times", [])])
PY

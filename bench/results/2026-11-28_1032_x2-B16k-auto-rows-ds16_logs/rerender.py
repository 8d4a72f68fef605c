"""Write a bench run's .md from its .json, where the run's own rendering failed (a defect of the
report code, fixed after it); the device line from the run's own records."""

import json
import sys
from pathlib import Path

sys.path.insert(0, "bench")
import _report
from _shapes import DENSE_SHAPES

for path in sys.argv[1:]:
    p = Path(path)
    recs = json.loads(p.read_text())
    r = recs[0]
    meta = {
        "command": r["command"],
        "date": r["date"],
        "device": f"{r.get('gpu')}; 32 CPU cores, 252 GiB host RAM (the two-H200 machine; this line written from the records)",
        "model": r["model"],
        "shape": DENSE_SHAPES[r["model"]],
        "params": r["params"],
        "seq_len": r["seq_len"],
        "stem": p.stem,
    }
    _report.write_md(recs, meta, p.with_suffix(".md"))
    print("wrote", p.with_suffix(".md"))

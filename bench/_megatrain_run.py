"""One `megatrain train` of a bench script in a subprocess: its settings written as a YAML file,
its metrics.jsonl step records and plan.json read back (bench/grpo.py, dpo.py, vision.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(
    d: Path, name: str, config: dict, extra: list[str], cwd: Path | None = None, **fields
) -> tuple[dict, list[dict], dict, str]:
    """`megatrain train d/{name}.yaml *extra` (`config` written there, the repository on
    PYTHONPATH, `cwd` its working directory): the run's record (system, command, wall_s, rc,
    `fields`; error, the output's tail, where it failed), its step records (those with a loss), its
    plan.json and its stdout; no steps and no plan where it failed."""
    yaml = d / f"{name}.yaml"
    yaml.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
    cmd = [sys.executable, "-m", "megatrain", "train", str(yaml), *extra]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    rec: dict = {"system": "megatrain", "command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t0,
                 "rc": proc.returncode, **fields}  # fmt: skip
    if proc.returncode != 0:
        rec["error"] = (proc.stdout + proc.stderr)[-4000:]
        return rec, [], {}, proc.stdout
    out = Path(config["output_dir"])
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((out / "plan.json").read_text())
    return rec, [r for r in steps if "loss" in r], plan, proc.stdout

"""What a run's memory plan predicted beside what the run measured: `output_dir/plan.json`.

The plan (placement.py) predicts the peak of allocated GPU memory and the growth of the host
resident set before anything is allocated; the run measures both as it goes (the CUDA caching
allocator's peak, the process's VmHWM) and records them next to each other, so a user sees how
far the prediction was off. Beside them the host AdamW's rate: the one the plan's step time
assumed, and the one the run's host optimizer kept inside its steps (the transport's counters).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .costmodel import adam_params_s
from .placement import Machine, Plan, fmt_bytes

PLAN_FILE = "plan.json"


def status_bytes(field: str) -> int | None:
    """A size from /proc/self/status (VmRSS, VmHWM) in bytes, None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryRecord:
    """The plan of a run, the resident set before it allocated anything, and the peaks measured."""

    def __init__(self, plan: Plan, machine: Machine, model: dict | None = None, rollout_gpu: int = 0):
        self.plan, self.machine, self.model = plan, machine, model or {}
        self.rollout_gpu = rollout_gpu
        """stage grpo: the GPU memory the plan keeps for a rollout beside the update's."""
        self.baseline = status_bytes("VmRSS") or 0
        self.measured: dict[str, int | None] = {}
        self.state_bytes: list[int] = []
        """The host state each machine of the run holds (the whole on one machine)."""
        self.tier = None
        """The disk tier (host/disk.py), whose I/O so far each measurement records."""
        self.counters = None
        """The transport's host AdamW counters (engine/transport.py), read at each measurement."""

    def measure(self, step: int, **more: int) -> None:
        """Read the peaks so far (cheap: no device synchronisation); `more`: other measured
        values (a rollout's `rollout_gpu_added`). The GPU's are the largest read: a rollout
        starts the allocator's counter again after itself."""
        m = {"step": step, "host_peak_rss": status_bytes("VmHWM"), **more}
        if self.tier is not None:
            m.update(self.tier.counters)
        c = self.counters
        if c is not None and c.params:
            m.update(host_adam_s=c.adam_s, host_adam_params=c.params, update_wait_s=c.wait_s)
            m["host_adam_params_s"] = c.params / c.adam_s if c.adam_s > 0 else None
        if self.plan.device == "cuda":
            import torch

            for key, now in (("gpu_peak_allocated", torch.cuda.max_memory_allocated()),
                             ("gpu_peak_reserved", torch.cuda.max_memory_reserved())):  # fmt: skip
                m[key] = max(now, self.measured.get(key) or 0)
        self.measured = m

    @property
    def predicted(self) -> dict[str, float]:
        out: dict[str, float] = {"host_peak_rss": self.baseline + self.plan.host_total}
        if self.machine.world.ranks_per_machine == 1:  # the plan's rate is all its ranks' together
            out["host_adam_params_s"] = adam_params_s(self.plan, self.machine)
        if self.plan.device == "cuda":
            out["gpu_peak_allocated"] = self.plan.gpu_peak
            if self.rollout_gpu:
                out["rollout_gpu_added"] = self.rollout_gpu
        return out

    def record(self) -> dict:
        """What plan.json holds: the plan, the machine, the predicted and measured peaks."""
        return {
            "model": self.model,
            "plan": self.plan.to_json(),
            "machine": asdict(self.machine),
            "host_rss_before": self.baseline,
            "predicted": self.predicted,
            "measured": self.measured,
            "host_state_bytes_per_machine": self.state_bytes,
        }

    def write(self, output_dir: Path) -> None:
        """plan.json, written atomically."""
        path = Path(output_dir) / PLAN_FILE
        tmp = path.with_name(f".{PLAN_FILE}.tmp-{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.record(), indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            e.filename = e.filename or str(path)  # a failed write() names no file
            raise

    def summary(self) -> str:
        parts = []
        names = (
            ("gpu_peak_allocated", "GPU peak"),
            ("rollout_gpu_added", "rollout"),
            ("host_peak_rss", "host peak"),
        )
        for key, name in names:
            got, want = self.measured.get(key), self.predicted.get(key)
            if got is not None and want:
                parts.append(
                    f"{name} {fmt_bytes(got)} (plan {fmt_bytes(want)}, {100 * (got / want - 1):+.1f}%)"
                )
        rate, planned = self.measured.get("host_adam_params_s"), self.predicted.get("host_adam_params_s")
        if rate and planned:
            parts.append(f"host AdamW {rate / 1e9:.2f} G params/s in its steps (plan {planned / 1e9:.2f})")
        return "megatrain: memory: " + ("; ".join(parts) or "not measured")

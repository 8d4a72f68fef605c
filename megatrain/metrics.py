"""Where training progress goes: `metrics.jsonl` always, a tqdm bar on a terminal (plain log
lines otherwise), TensorBoard when asked."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm


class MetricsLogger:
    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        logging_steps: int = 1,
        report_to: str = "none",
        disable_tqdm: bool | None = None,
    ):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.logging_steps = logging_steps
        self.total = total_steps
        self._keep_until(start_step)
        self._f = open(self.path, "a")  # noqa: SIM115 (closed in close())
        interactive = sys.stderr.isatty() if disable_tqdm is None else not disable_tqdm
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not interactive)
        self.interactive = interactive
        self.tb = None
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(output_dir) / "runs"))
        self._t0 = time.time()

    def _keep_until(self, step: int) -> None:
        """On resume, drop records of steps after the checkpoint (they will be redone)."""
        if not self.path.exists():
            return
        if step == 0:
            self.path.unlink()
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", math.inf) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue
        self.path.write_text("".join(x + "\n" for x in kept))

    def log(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        step = record["step"]
        self.bar.update(1)
        if self.interactive:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                 refresh=False)
        elif step % self.logging_steps == 0 or step == self.total:
            eta = (time.time() - self._t0) / max(1, step) * (self.total - step)
            print(
                f"step {step}/{self.total} loss {record['loss']:.4f} grad_norm {record['grad_norm']:.3f} "
                f"lr {record['lr']:.3g} tokens/s {record['tokens_per_s']:.0f} eta {eta:.0f}s",
                flush=True,
            )
        if self.tb is not None:
            for k in ("loss", "grad_norm", "lr", "tokens_per_s"):
                if isinstance(record.get(k), (int, float)):
                    self.tb.add_scalar(f"train/{k}", record[k], step)

    def message(self, text: str) -> None:
        (self.bar.write if self.interactive else print)(text)

    def close(self) -> None:
        self.bar.close()
        self._f.close()
        if self.tb is not None:
            self.tb.close()

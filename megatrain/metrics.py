"""Where training progress goes: `metrics.jsonl` always, a tqdm bar on a terminal (plain log
lines otherwise), the experiment trackers `report_to` names (trackers.py); and byte progress
bars for long saves and reads.

metrics.jsonl holds two kinds of records, both with a `step`: one per optimizer step (`loss`,
`grad_norm`, `lr`, ...) and one per evaluation (`eval_loss`, `eval_perplexity`, ...; Hugging
Face's names; grpo's `eval_reward`, ..., TRL's), written after the step it evaluates;
`trackers.is_eval` tells them apart. Every such JSON-lines file of records by step (also grpo's
completions) is a `RecordFile`: whole records appended, trimmed to a resume's step."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
from pathlib import Path

from tqdm.auto import tqdm

from .errors import first_line
from .trackers import RunInfo, Tracker, open_trackers, scalars


def show_progress(disable_tqdm: bool | None) -> bool:
    """Whether progress bars are drawn: on a terminal unless `disable_tqdm` says otherwise. A bar
    redrawn with carriage returns is noise in a log file, so without a terminal there is none."""
    return sys.stderr.isatty() if disable_tqdm is None else not disable_tqdm


# A post-training stage's figures beside the loss (TRL's metrics): name in the line -> record key.
STAGE_SHOWN = {"accuracy": "rewards/accuracies", "margin": "rewards/margins", "reward": "reward"}


class RecordFile:
    """A JSON-lines file of a run's records, each with a `step` (metrics.jsonl, grpo's
    completions.jsonl and eval_completions.jsonl), appended one whole record at a time. A run
    resumed after step `start_step` first drops the records of later steps (they will be redone)
    and any line a kill cut short, so the resumed run appends after whole records only. (Whether
    the file is this run's is outputs.py's decision, made before.)"""

    def __init__(self, path: Path, start_step: int = 0):
        self.path = Path(path)
        self._f = None
        self._keep_until(start_step)

    def open(self) -> None:
        # Unbuffered: a record reaches the file in one write, or is cut off by `append`.
        self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed in close())

    def _keep_until(self, step: int) -> None:
        """Drop records of steps after `step` and lines that are not whole records. The trimmed
        file replaces the old one by rename, so a kill at any moment leaves one of the two
        complete."""
        if not self.path.exists() or step == 0:
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", math.inf) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                continue
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with self._naming_errors():
            try:
                with open(tmp, "w") as f:
                    f.write("".join(x + "\n" for x in kept))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise

    def append(self, record: dict) -> None:
        """One record, whole: a write that fails part way (a full disk) is cut off again, so
        the file holds whole records only, and the error names the file. Opens the file first if
        need be."""
        if self._f is None:
            self.open()
        data = memoryview((json.dumps(record) + "\n").encode())
        with self._naming_errors():
            end = self._f.seek(0, os.SEEK_END)
            try:
                while data:
                    data = data[self._f.write(data) :]
            except OSError:
                with contextlib.suppress(OSError):
                    self._f.truncate(end)
                raise

    def close(self) -> None:
        if self._f is not None:
            self._f.close()  # unbuffered: nothing left to write
            self._f = None

    @contextlib.contextmanager
    def _naming_errors(self):
        """A failed write() (a full disk) names no file; name this one, for cli.py's one line."""
        try:
            yield
        except OSError as e:
            e.filename = e.filename or str(self.path)
            raise


class MetricsLogger:
    """Appends one JSON record per optimizer step to `output_dir/metrics.jsonl` (records of
    skipped steps carry `"skipped": true` and null loss/grad_norm) and one per evaluation, and
    reports progress."""

    def __init__(
        self,
        output_dir: Path,
        total_steps: int,
        start_step: int = 0,
        logging_steps: int = 1,
        report_to: list[str] | tuple[str, ...] = (),
        disable_tqdm: bool | None = None,
        run: RunInfo | None = None,
    ):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.logging_steps = logging_steps
        self.total = total_steps
        self.start = start_step
        self._records = RecordFile(self.path, start_step)
        # Before the file and the bar: a tracker that cannot start leaves nothing open.
        self.trackers: list[Tracker] = open_trackers(
            list(report_to), Path(output_dir), start_step, run or RunInfo()
        )
        self._records.open()
        interactive = show_progress(disable_tqdm)
        # tqdm shows step/total, elapsed and ETA itself; loss and tokens/s go in the postfix.
        self.bar = tqdm(
            total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, disable=not interactive
        )
        self.interactive = interactive
        self._step_seconds, self._steps = 0.0, 0  # the training steps' own time: the ETA's rate
        self._eval_shown: dict[str, str] = {}  # the latest evaluation's figure, in the bar's postfix

    def log(self, record: dict) -> None:
        self._records.append(record)
        step = record["step"]
        loss = "skipped" if record.get("skipped") else f"{record['loss']:.4f}"
        self._step_seconds += record.get("step_time_s", 0.0)
        self._steps += 1
        self.bar.update(1)
        shown = {k: f"{record[n]:.3g}" for k, n in STAGE_SHOWN.items() if record.get(n) is not None}
        if self.interactive:
            extra = self._eval_shown
            self.bar.set_postfix(
                loss=loss, **shown, tok_s=f"{record['tokens_per_s']:.0f}", **extra, refresh=False
            )
        elif step % self.logging_steps == 0 or step == self.total:
            eta = self._step_seconds / self._steps * (self.total - step)
            gn = record.get("grad_norm")
            more = "".join(f" {k} {v}" for k, v in shown.items())
            print(
                f"step {step}/{self.total} loss {loss}{more} grad_norm {'-' if gn is None else f'{gn:.3f}'} "
                f"lr {record['lr']:.3g} tokens/s {record['tokens_per_s']:.0f} eta {_duration(eta)}",
                flush=True,
            )
        self._report(record)

    def log_eval(self, record: dict) -> None:
        """An evaluation record: to metrics.jsonl, as a line for the user, to the trackers."""
        self._records.append(record)
        if "eval_reward" in record:  # grpo's: sampled and scored
            shown = f"{record['eval_reward']:.4f}"
            self._eval_shown = {"eval_reward": shown}
            self.message(
                f"eval step {record['step']}/{self.total} eval_reward {shown} (std {record['eval_reward_std']:.3f}, "
                f"completions of {record['eval_completions/mean_length']:.1f} tokens; {record['eval_runtime']:.1f}s)"
            )
        else:
            loss, ppl = record["eval_loss"], record["eval_perplexity"]
            shown = "nan" if loss is None else f"{loss:.4f}"
            self._eval_shown = {"eval_loss": shown}
            self.message(
                f"eval step {record['step']}/{self.total} eval_loss {shown} "
                f"perplexity {'-' if ppl is None else f'{ppl:.3f}'} ({record['eval_runtime']:.1f}s, "
                f"{record['eval_tokens_per_s']:.0f} tokens/s)"
            )
        self._report(record)

    def _report(self, record: dict) -> None:
        """A record (already in metrics.jsonl) to every tracker. One that fails is dropped with a
        warning: a tracker's outage must not stop a run whose metrics.jsonl has every record."""
        values = scalars(record)
        for t in list(self.trackers):
            try:
                t.log(values, record["step"])
            except Exception as e:
                self.trackers.remove(t)
                self.message(
                    f"megatrain: warning: report_to {t.name} failed at step {record['step']} ({first_line(e)}); "
                    f"training goes on without it, and {self.path} has every step"
                )
                self._close(t, failed=True)

    def exclude_pause(self) -> None:
        """Leave the time since the last step (an evaluation, a save) out of the progress bar's
        rate and ETA, as the log lines' ETA leaves it out: an evaluation before the first step
        made a 20-minute run's first ETA hours."""
        self.bar.unpause()

    def progress(self, total: int, desc: str = "eval"):
        """A transient bar (under the training bar) for long work such as an evaluation."""
        return tqdm(
            total=total,
            desc=desc,
            unit="batch",
            leave=False,
            dynamic_ncols=True,
            disable=not self.interactive,
        )

    def message(self, text: str) -> None:
        """A line for the user that does not break the progress bar."""
        if self.interactive:
            self.bar.write(text)
        else:  # a pipe or a file is block-buffered: a log read as the run goes shows the line now
            print(text, flush=True)

    def close(self, failed: bool = False) -> None:
        """Close the bar, the trackers (their runs marked failed when `failed`: the training
        raised) and metrics.jsonl."""
        self.bar.close()
        try:
            for t in self.trackers:
                self._close(t, failed)
        finally:
            self._records.close()

    def _close(self, tracker: Tracker, failed: bool) -> None:
        """Close a tracker; a failure to is a warning (the run's outputs are already written)."""
        try:
            tracker.close(failed)
        except Exception as e:
            self.message(
                f"megatrain: warning: report_to {tracker.name} did not close cleanly ({first_line(e)})"
            )


class ByteProgress:
    """A progress bar in bytes (on a terminal, when `enabled`) that threads may advance."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            leave=False,
            disable=not enabled,
        )
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class SilentLogger:
    """MetricsLogger's interface for the ranks of a data-parallel world other than the first:
    one rank writes metrics and shows progress, the others stay quiet."""

    interactive = False

    def log(self, record: dict) -> None:
        pass

    def log_eval(self, record: dict) -> None:
        pass

    def exclude_pause(self) -> None:
        pass

    def progress(self, total: int, desc: str = "eval"):
        return tqdm(total=total, disable=True)

    def message(self, text: str) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass


def mean_metrics(metrics: dict[str, tuple[str, list[float]]], world, prefix: str = "") -> dict[str, float]:
    """An objective's metrics (name -> (how, each micro-batch's values): Objective.take_metrics)
    averaged over every rank's micro-batches. A "min" or "max" metric is first taken over the
    ranks' m-th micro-batches, as TRL gathers every process's batch at each forward, then
    averaged over m. `world`: the ranks (parallel/distributed.py's Collective)."""
    parts = world.each(metrics) if world.world_size > 1 else [metrics]
    out = {}
    for k in dict.fromkeys(k for p in parts for k in p):
        how = next(p[k][0] for p in parts if k in p)
        ranks = [p[k][1] for p in parts if k in p]
        if how == "mean":
            out[prefix + k] = sum(map(sum, ranks)) / sum(map(len, ranks))
            continue
        extreme = min if how == "min" else max
        each = [extreme(v[m] for v in ranks if m < len(v)) for m in range(max(map(len, ranks)))]
        out[prefix + k] = sum(each) / len(each)
    return out

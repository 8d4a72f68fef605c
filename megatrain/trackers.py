"""The experiment trackers `report_to` names: TensorBoard, Weights & Biases, MLflow and Trackio.

Each is an optional package, imported only when a run names it. Every one gets the same
scalars, Hugging Face's names (`train/loss`, `train/grad_norm`, `train/lr`, ...; `eval/loss`,
`eval/perplexity`, ...) at the optimizer step they belong to, and, once, when the tracker's
run starts, the run's configuration and its memory plan (plan.json's record). Where they go:

* **tensorboard**: event files in `output_dir/runs` (`tensorboard --logdir output_dir/runs`).
* **wandb**: a W&B run whose id is megatrain's run id, so a resumed run continues it; its files
  in `output_dir/wandb` (`WANDB_MODE=offline` keeps it there for `wandb sync`). Project:
  `project`, else WANDB_PROJECT, else megatrain.
* **mlflow**: the server of MLFLOW_TRACKING_URI, else a local store `output_dir/mlflow.db` with
  the artifacts in `output_dir/mlartifacts` (`mlflow ui --backend-store-uri
  sqlite:///output_dir/mlflow.db`). The configuration becomes the run's parameters (and
  train_config.json), the plan an artifact plan.json. Experiment: `project`, else
  MLFLOW_EXPERIMENT_NAME, else megatrain. A resumed run continues the MLflow run tagged with
  its run id.
* **trackio**: Trackio's local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio;
  `trackio show`), or the Space of TRACKIO_SPACE_ID. Project: `project`, else megatrain.

A tracker run is named `run_name`, else megatrain's run id. metrics.jsonl is written before any
tracker sees a record: a tracker that fails during training is dropped with a warning, and
training and metrics.jsonl go on without it (`MetricsLogger`). One that cannot start stops the
run before its first step, with a one-line error.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, MegatrainError, first_line

_MODULE = {"tensorboard": "torch.utils.tensorboard"}  # what a tracker imports, where not its name
DEFAULT_PROJECT = "megatrain"
RUN_TAG = "megatrain.run_id"  # the MLflow tag that finds a resumed run's MLflow run
# The record keys each tracker gets, under train/ (an optimizer step's) or eval/ (an evaluation's).
TRAIN_SCALARS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "epoch",
    "aux_loss",
    "expert_load_max",
    "expert_load_min",
    "reward",  # grpo's
)
EVAL_SCALARS = ("loss", "perplexity", "runtime", "tokens_per_s", "reward", "reward_std")  # reward: grpo's


def reporters(value: str | list[str]) -> list[str]:
    """report_to as transformers reads it: "none" or [] (nothing), "all" (every integration
    installed), one name or a list of names; ConfigError for a name megatrain does not have."""
    names = [value] if isinstance(value, str) else list(value)
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return [r for r in REPORTERS if importlib.util.find_spec(r) is not None]
    for name in names:
        if name not in REPORTERS:
            raise ConfigError(
                f"report_to: {name!r} is not an integration megatrain has (none, all, {', '.join(REPORTERS)})"
            )
    return list(dict.fromkeys(names))


def check_installed(names: list[str]) -> None:
    """ConfigError naming the pip package when a tracker of `names` cannot be imported, or when
    MLflow's local store (no MLFLOW_TRACKING_URI) lacks the database packages it needs."""
    for name in names:
        try:
            importlib.import_module(_MODULE.get(name, name))
        except ImportError:
            raise ConfigError(
                f"report_to: {name} is not installed (pip install {name}, or report_to: none)"
            ) from None
    if "mlflow" in names and not os.environ.get("MLFLOW_TRACKING_URI"):
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"report_to: mlflow's local store (output_dir/mlflow.db) needs {' and '.join(missing)} "
                "(pip install mlflow, or set MLFLOW_TRACKING_URI to a tracking server)"
            )


@dataclass
class RunInfo:
    """What the trackers are told about a run, once, when it starts."""

    run_id: str | None = None
    """megatrain's run id (checkpoints carry it): the tracker runs' identity across resumes."""
    name: str | None = None
    """The `run_name` key."""
    project: str | None = None
    """The `project` key."""
    config: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)

    @property
    def display_name(self) -> str | None:
        return self.name or self.run_id

    def project_or(self, env: str | None) -> str:
        """The project: the `project` key, else the tracker's own variable `env`, else megatrain."""
        return self.project or (os.environ.get(env) if env else None) or DEFAULT_PROJECT


def is_eval(record: dict) -> bool:
    """Whether a metrics.jsonl record is an evaluation's (its keys start with eval_: eval_loss, or
    grpo's eval_reward, ...), else an optimizer step's."""
    return any(k.startswith("eval_") for k in record)


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as the trackers' scalars (absent and null values left out)."""
    prefix, keys = ("eval", EVAL_SCALARS) if is_eval(record) else ("train", TRAIN_SCALARS)
    source = "eval_" if prefix == "eval" else ""
    out = {}
    for k in keys:
        v = record.get(source + k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}/{k}"] = float(v)
    return out


class Tracker:
    """One tracker of a run: `log` scalars at an optimizer step, `close` at the end."""

    name = ""

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError


def open_trackers(names: list[str], output_dir: Path, start_step: int, run: RunInfo) -> list[Tracker]:
    """Start the trackers of `names` for a run writing `output_dir`, resumed at `start_step`
    (0: a new run). MegatrainError naming the tracker when one cannot start; those already
    started are closed."""
    opened: list[Tracker] = []
    for name in names:
        try:
            opened.append(_KINDS[name](Path(output_dir), start_step, run))
        except Exception as e:
            for t in opened:
                t.close(failed=True)
            raise MegatrainError(f"report_to: {name} could not start: {first_line(e)}") from e
    return opened


class _TensorBoard(Tracker):
    name = "tensorboard"

    def __init__(self, output_dir: Path, start_step: int, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events of steps after a resumed checkpoint: they are redone.
        self.writer = SummaryWriter(
            log_dir=str(output_dir / "runs"), purge_step=start_step + 1 if start_step else None
        )
        if not start_step:
            self.writer.add_text("config", json.dumps(run.config, indent=2, default=str))
            self.writer.add_text("plan", json.dumps(run.plan, indent=2, default=str))

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _Wandb(Tracker):
    name = "wandb"

    def __init__(self, output_dir: Path, start_step: int, run: RunInfo):
        import wandb

        self.run = wandb.init(
            project=run.project_or("WANDB_PROJECT"),
            name=run.display_name,
            id=run.run_id,
            resume="allow",
            dir=str(output_dir),
            config=None if start_step else {**run.config, "plan": run.plan},
        )
        # The step is a metric of its own, as transformers logs it: W&B's internal step only
        # grows, and would drop the steps that a resumed run redoes.
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "train/global_step": step})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow(Tracker):
    name = "mlflow"

    def __init__(self, output_dir: Path, start_step: int, run: RunInfo):
        from mlflow import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        # MLflow's own default is a mlflow.db in the working directory; the run's is in output_dir.
        local = output_dir.resolve()
        self.client = client = MlflowClient(uri or f"sqlite:///{local / 'mlflow.db'}")
        name = run.project_or("MLFLOW_EXPERIMENT_NAME")
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None if uri else (local / "mlartifacts").as_uri()
            experiment_id = client.create_experiment(name, artifact_location=artifacts)
        found = (
            client.search_runs([experiment_id], f"tags.`{RUN_TAG}` = '{run.run_id}'", max_results=1)
            if start_step and run.run_id
            else []
        )
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        tags = {RUN_TAG: run.run_id} if run.run_id else {}
        self.run_id = client.create_run(experiment_id, run_name=run.display_name, tags=tags).info.run_id
        self._log_params(run.config)
        client.log_dict(self.run_id, run.config, "train_config.json")
        client.log_dict(self.run_id, run.plan, "plan.json")

    def _log_params(self, config: dict[str, Any]) -> None:
        """The configuration as MLflow parameters: strings of a bounded length, in batches of
        a bounded size (MLflow's limits); train_config.json has the full values."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [
            Param(k, (v if isinstance(v, str) else json.dumps(v, default=str))[:MAX_PARAM_VAL_LENGTH])
            for k, v in config.items()
        ]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class _Trackio(Tracker):
    name = "trackio"

    def __init__(self, output_dir: Path, start_step: int, run: RunInfo):
        import trackio

        self._trackio = trackio
        # A resumed run continues the Trackio run of its name; a new one starts another. Trackio
        # replaces a resumed run's configuration with the one given: it is given every time.
        self.run = trackio.init(
            project=run.project_or(None),
            name=run.display_name,
            resume="allow" if start_step else "never",
            config={**run.config, "plan": run.plan},
            embed=False,
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        self._trackio.finish()


_KINDS: dict[str, type[Tracker]] = {t.name: t for t in (_TensorBoard, _Wandb, _MLflow, _Trackio)}
REPORTERS = tuple(_KINDS)
"""The report_to integrations megatrain has; each is also the name of its pip package."""

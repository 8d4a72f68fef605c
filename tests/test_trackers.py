"""Experiment trackers (`report_to`): TensorBoard, W&B, MLflow and Trackio, each offline on the
CPU (conftest keeps them local), read back from what each one stored: the scalars of every
step and evaluation, the run's configuration and plan once, a resume that continues the same
tracker run, a tracker failing mid-run, and the errors for a missing or broken one."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest
from test_checkpoint import make_run, metrics, one_thread, write_yaml  # noqa: F401 (fixture)
from test_cli import run_cli

from megatrain import trackers
from megatrain.config import TrainConfig
from megatrain.errors import ConfigError, MegatrainError
from megatrain.metrics import MetricsLogger
from megatrain.trackers import RunInfo, reporters
from megatrain.trainer import train

RUN_ID = "20260101-000000-abc123"
ABOUT = RunInfo(
    run_id=RUN_ID,
    project="megatrain-tests",
    config={"learning_rate": 0.001, "dataset": ["a.jsonl", "b.jsonl"], "report_to": ["wandb"]},
    plan={"plan": {"gpu_peak": 123}, "predicted": {"host_peak_rss": 456}},
)
STEPS = [
    {
        "step": s,
        "loss": 3.0 / s,
        "grad_norm": 1.5,
        "lr": 1e-3 * s,
        "tokens_per_s": 100.0 + s,
        "epoch": 0.25 * s,
    }
    for s in (1, 2, 3)
]
EVAL = {
    "step": 3,
    "eval_loss": 2.5,
    "eval_perplexity": 12.18,
    "eval_runtime": 0.5,
    "eval_tokens_per_s": 900.0,
}


# ---------------------------------------------------------------------------- what each stored
def _wandb_records(out: Path) -> list:
    """The records of the offline W&B runs under out/wandb, oldest run first. W&B's service
    writes a run's file on its own time after `finish()`: wait until each one ends with its
    run's exit record."""
    for _ in range(300):
        runs = [_wandb_file(p) for p in sorted(out.glob("wandb/offline-run-*/run-*.wandb"))]
        if runs and all(r and r[-1].WhichOneof("record_type") == "exit" for r in runs):
            return [record for r in runs for record in r]
        time.sleep(0.1)
    raise AssertionError(f"no complete W&B run files in {out / 'wandb'}")


def _wandb_file(path: Path) -> list:
    """The records of a .wandb file (as far as it is written): a LevelDB log (32 KiB blocks of
    chunks: CRC, length, type) after a 7-byte W&B header."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = chunk + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            try:
                record.ParseFromString(chunk)
            except DecodeError:  # cut off mid-write
                break
            records.append(record)
            chunk = b""
    return records


def wandb_stored(out: Path) -> tuple[dict, dict[str, list]]:
    """The W&B run's id, project, name and config, and each scalar's (step, value) points."""
    run, points = {}, {}
    for r in _wandb_records(out):
        kind = r.WhichOneof("record_type")
        if kind == "run" and not run:
            config = {c.key: json.loads(c.value_json) for c in r.run.config.update if c.key != "_wandb"}
            run = dict(id=r.run.run_id, project=r.run.project, name=r.run.display_name, config=config)
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for k, v in row.items():
                if not k.startswith("_") and k != "train/global_step":
                    points.setdefault(k, []).append((row["train/global_step"], v))
    return run, points


def mlflow_stored(out: Path) -> tuple[dict, dict[str, list]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(ABOUT.project)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(out.resolve() / "mlartifacts")
    points = {
        k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
        for k in run.data.metrics
    }
    about = dict(
        status=run.info.status,
        name=run.info.run_name,
        tag=run.data.tags[trackers.RUN_TAG],
        params=run.data.params,
        config=json.loads((artifacts / "train_config.json").read_text()),
        plan=json.loads((artifacts / "plan.json").read_text()),
    )
    return about, points


def trackio_stored(name: str) -> tuple[dict, dict[str, list]]:
    from trackio.sqlite_storage import SQLiteStorage

    config = SQLiteStorage.get_run_config(ABOUT.project, name)
    points = {}
    for row in SQLiteStorage.get_logs(ABOUT.project, name):
        for k, v in row.items():
            if k not in ("step", "timestamp"):
                points.setdefault(k, []).append((row["step"], v))
    return {k: v for k, v in config.items() if not k.startswith("_")}, points


def tensorboard_stored(out: Path) -> tuple[dict, dict[str, list]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs"))
    acc.Reload()
    texts = {
        tag.removesuffix("/text_summary"): json.loads(acc.Tensors(tag)[0].tensor_proto.string_val[0])
        for tag in acc.Tags()["tensors"]
    }
    return texts, {k: [(e.step, e.value) for e in acc.Scalars(k)] for k in acc.Tags()["scalars"]}


def expected_points(records: list[dict], float32: bool = False) -> dict[str, list]:
    """Each scalar's (step, value) points as the records give them (TensorBoard keeps float32)."""
    points = {}
    for r in records:
        for k, v in trackers.scalars(r).items():
            points.setdefault(k, []).append((r["step"], pytest.approx(v, rel=1e-7) if float32 else v))
    return points


# ---------------------------------------------------------------------------- report_to
def test_report_to_names():
    assert reporters("none") == [] and reporters([]) == []
    assert reporters("wandb") == ["wandb"]
    assert reporters(["mlflow", "trackio", "mlflow"]) == ["mlflow", "trackio"]
    assert set(reporters("all")) == set(trackers.REPORTERS)  # every one is installed here
    assert TrainConfig(model_config="m", report_to=["tensorboard", "wandb"]).report_to == [
        "tensorboard",
        "wandb",
    ]
    with pytest.raises(
        ConfigError,
        match=r"^report_to: 'comet_ml' is not an integration megatrain has \(none, all, tensorboard, wandb, mlflow, trackio\)$",
    ):
        TrainConfig(model_config="m", report_to=["wandb", "comet_ml"])


def test_scalars_use_hugging_face_names():
    assert trackers.scalars({**STEPS[0], "aux_loss": 0.1, "skipped": True, "grad_norm": None}) == {
        "train/loss": 3.0,
        "train/lr": 1e-3,
        "train/tokens_per_s": 101.0,
        "train/epoch": 0.25,
        "train/aux_loss": 0.1,
    }
    assert trackers.scalars(EVAL) == {
        "eval/loss": 2.5,
        "eval/perplexity": 12.18,
        "eval/runtime": 0.5,
        "eval/tokens_per_s": 900.0,
    }
    # grpo's: rewards, in training and in evaluation (which has no eval_loss).
    grpo_eval = {"step": 2, "eval_reward": 0.5, "eval_reward_std": 0.25, "eval_runtime": 1.5}
    assert trackers.scalars(grpo_eval) == {"eval/reward": 0.5, "eval/reward_std": 0.25, "eval/runtime": 1.5}
    assert trackers.scalars({**STEPS[0], "reward": 0.75})["train/reward"] == 0.75


# ---------------------------------------------------------------------------- each tracker
def _log_run(out: Path, name: str, failed: bool = False) -> None:
    log = MetricsLogger(out, total_steps=3, report_to=[name], disable_tqdm=True, run=ABOUT)
    for r in STEPS:
        log.log(r)
    log.log_eval(EVAL)
    log.close(failed=failed)


def test_wandb_offline_run(tmp_path):
    _log_run(tmp_path, "wandb")
    run, points = wandb_stored(tmp_path)
    assert run == dict(
        id=RUN_ID, project=ABOUT.project, name=RUN_ID, config={**ABOUT.config, "plan": ABOUT.plan}
    )
    assert points == expected_points([*STEPS, EVAL])


def test_mlflow_local_store(tmp_path):
    _log_run(tmp_path, "mlflow", failed=True)
    about, points = mlflow_stored(tmp_path)
    assert about["status"] == "FAILED" and about["name"] == RUN_ID and about["tag"] == RUN_ID
    assert about["params"] == {
        "learning_rate": "0.001",
        "dataset": '["a.jsonl", "b.jsonl"]',
        "report_to": '["wandb"]',
    }
    assert about["config"] == ABOUT.config and about["plan"] == ABOUT.plan
    assert points == expected_points([*STEPS, EVAL])


def test_trackio_local_store(tmp_path):
    _log_run(tmp_path, "trackio")
    config, points = trackio_stored(RUN_ID)
    assert config == {**ABOUT.config, "plan": ABOUT.plan}
    assert points == expected_points([*STEPS, EVAL])


def test_tensorboard_config_plan_and_scalars(tmp_path):
    _log_run(tmp_path, "tensorboard")
    texts, points = tensorboard_stored(tmp_path)
    assert texts == {"config": ABOUT.config, "plan": ABOUT.plan}
    assert points == expected_points([*STEPS, EVAL], float32=True)


# ---------------------------------------------------------------------------- a run, resumed
@pytest.mark.slow
def test_training_reports_to_every_tracker_and_a_resume_continues_them(tmp_path, monkeypatch):
    """A 4-step run saving at step 2, and its resume from checkpoint-2 (steps 3, 4 redone): each
    tracker holds one run whose scalars are metrics.jsonl's, its configuration and plan those
    the run wrote (train_config.json, plan.json's plan); the resume adds to the same run."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    names = list(trackers.REPORTERS)
    cfg = dict(base, output_dir=str(out), max_steps=4, save_steps=2, report_to=names, project=ABOUT.project)
    train(TrainConfig(**cfg, run_name="first"))
    first = metrics(out)
    train(TrainConfig(**cfg, run_name="first", resume_from_checkpoint=str(out / "checkpoint-2")))
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == [r["loss"] for r in first]  # the resume is exact

    run_id = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["run_id"]
    written = json.loads((out / "train_config.json").read_text())
    plan = json.loads((out / "plan.json").read_text())["plan"]
    # What a tracker's first run saw, then the steps of both runs in the order they were logged.
    both = [*first, *records[2:]]

    run, points = wandb_stored(out)
    assert (run["id"], run["name"], run["project"]) == (run_id, "first", ABOUT.project)
    assert (
        run["config"]["learning_rate"] == written["learning_rate"] and run["config"]["plan"]["plan"] == plan
    )
    assert points == expected_points(both)
    assert (
        len(list(out.glob("wandb/offline-run-*"))) == 2
    )  # one per start, of one id: `wandb sync` joins them

    about, points = mlflow_stored(out)  # one MLflow run
    assert (about["status"], about["name"], about["tag"]) == ("FINISHED", "first", run_id)
    assert about["config"]["learning_rate"] == written["learning_rate"] and about["plan"]["plan"] == plan
    assert {k: sorted(v) for k, v in points.items()} == {
        k: sorted(v) for k, v in expected_points(both).items()
    }

    config, points = trackio_stored("first")
    assert config["learning_rate"] == written["learning_rate"] and config["plan"]["plan"] == plan
    assert points == expected_points(both)

    texts, points = tensorboard_stored(out)
    assert texts["config"]["learning_rate"] == written["learning_rate"] and texts["plan"]["plan"] == plan
    assert points == expected_points(records, float32=True)  # the redone steps replace the first run's


# ---------------------------------------------------------------------------- failures
def test_a_tracker_failing_mid_run_is_dropped_and_training_goes_on(tmp_path, capsys, monkeypatch):
    def fail_at_step_2(self, values, step):
        if step == 2:
            raise ConnectionError("server unreachable\nretrying...")
        original(self, values, step)

    original = trackers._TensorBoard.log
    monkeypatch.setattr(trackers._TensorBoard, "log", fail_at_step_2)
    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(
        TrainConfig(
            **base,
            output_dir=str(out),
            max_steps=4,
            report_to=["tensorboard", "trackio"],
            project=ABOUT.project,
            run_name="survivor",
        )
    )
    stdout = capsys.readouterr().out
    assert (
        "megatrain: warning: report_to tensorboard failed at step 2 (ConnectionError: server unreachable); "
        f"training goes on without it, and {out / 'metrics.jsonl'} has every step"
    ) in stdout.splitlines()
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and (out / "final" / "model.safetensors").is_file()
    assert tensorboard_stored(out)[1]["train/loss"] == [(1, pytest.approx(records[0]["loss"]))]
    _, points = trackio_stored("survivor")  # the other tracker has every step
    assert points["train/loss"] == [(r["step"], r["loss"]) for r in records]


def test_a_tracker_that_cannot_start_is_one_line_and_closes_the_others(tmp_path, monkeypatch):
    import wandb

    def no_login(**kwargs):
        raise wandb.errors.UsageError(
            "api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore"
        )

    monkeypatch.setattr(wandb, "init", no_login)
    closed = []
    monkeypatch.setattr(trackers._TensorBoard, "close", lambda self, failed=False: closed.append(failed))
    with pytest.raises(MegatrainError) as e:
        MetricsLogger(
            tmp_path, total_steps=3, report_to=["tensorboard", "wandb"], disable_tqdm=True, run=ABOUT
        )
    assert str(e.value) == (
        "report_to: wandb could not start: UsageError: api_key not configured (no-tty). "
        "call wandb.login(key=[your_api_key])"
    )
    assert closed == [True] and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("name", trackers.REPORTERS)
def test_missing_tracker_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, name):
    # `import x` raises ImportError while sys.modules["x"] is None: as if it were not installed.
    monkeypatch.setitem(sys.modules, trackers._MODULE.get(name, name), None)
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=1, report_to=[name]))
    rc, _, err = run_cli(capsys, "train", cfg)
    assert rc == 2 and err.splitlines() == [
        f"megatrain: error: report_to: {name} is not installed (pip install {name}, or report_to: none)"
    ]
    assert not out.exists()


def test_mlflow_local_store_needs_its_database_packages(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "alembic", None)
    cfg = TrainConfig(**make_run(tmp_path), output_dir=str(tmp_path / "out"), report_to="mlflow")
    with pytest.raises(
        ConfigError,
        match=r"^report_to: mlflow's local store \(output_dir/mlflow.db\) needs alembic \(pip install mlflow, or set MLFLOW_TRACKING_URI",
    ):
        trackers.check_installed(cfg.report_to)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://localhost:5000")
    trackers.check_installed(cfg.report_to)  # a server needs no local database


def test_a_run_that_raises_marks_its_tracker_run_failed(tmp_path, monkeypatch):
    from megatrain.engine.engine import Engine

    def broken(self, lr, coef):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(Engine, "step", broken)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        train(TrainConfig(**make_run(tmp_path), output_dir=str(out), max_steps=2, report_to="wandb"))
    exits = [r.exit.exit_code for r in _wandb_records(out) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]

"""Checkpoints: exact resume, pruning, atomicity under kill -9, SIGTERM, validation, and
skipping non-finite steps. CPU, tiny random models, pre-tokenised data."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.config import TrainConfig
from megatrain.engine.engine import Engine
from megatrain.errors import CheckpointError, ConfigError
from megatrain.guard import Aborted, DivergedError, SignalGuard, TrainingInterrupted
from megatrain.host.state import HostState, build_units
from megatrain.io.checkpoint import list_checkpoints, open_checkpoint, resume_path
from megatrain.io.weights import load_hf_weights
from megatrain.models.config import ModelConfig
from megatrain.trainer import train

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP threads spinning against a busy
    machine make them 100x slower; subprocesses get the same count (bitwise comparisons)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def signal_after_step(monkeypatch, n: int, signum: int = signal.SIGTERM):
    """Make `Engine.step` send this process `signum` once the optimizer has taken step `n`;
    returns the original method."""
    orig = Engine.step

    def step_then_signal(self, lr, coef):
        out = orig(self, lr, coef)
        if self.state.step == n:
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(Engine, "step", step_then_signal)
    return orig


def make_run(tmp_path: Path, vocab: int = 97, n: int = 48, config=None, **model_kw) -> dict:
    """A random-init model config (a tiny Llama, or `config`: a transformers config or a
    config.json dict) and a tokens JSONL in tmp_path; returns base TrainConfig kwargs."""
    if config is None:
        config = tiny_config("llama", vocab_size=vocab, **model_kw)
    if isinstance(config, dict):
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    else:
        config.save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    ids = min(vocab, 500)  # below any tokenizer's size a test adds
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(ids) for _ in range(rng.randint(6, 30))]}) + "\n")
    return dict(
        model_config=str(tmp_path / "model"),
        dataset=str(tmp_path / "data.jsonl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_length=32,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=1.0,  # clipping active: grad norms of these models are ~5-10
        weight_decay=0.01,
        save_dtype="float32",
        disable_tqdm=True,
    )


def write_yaml(path: Path, cfg: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same tensors, bit for bit; a failure names each tensor that differs, with how many of
    its elements do and by how much at most."""
    assert a.keys() == b.keys()
    differ = {k: (a[k], b[k]) for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))}
    assert not differ, "; ".join(f"{k}: {_difference(x, y)}" for k, (x, y) in differ.items())


def _difference(x: torch.Tensor, y: torch.Tensor) -> str:
    if x.dtype != y.dtype or x.shape != y.shape:
        return f"{x.dtype}{list(x.shape)} against {y.dtype}{list(y.shape)}"
    ne = x != y
    return f"{int(ne.sum())} of {x.numel()} elements differ, by up to {float((x - y).abs()[ne].max()):.3g}"


def load_fully(path: Path, model_cfg: ModelConfig) -> int:
    """Validate a checkpoint and read every tensor of it; returns its step."""
    ckpt = open_checkpoint(path, model_cfg)
    state = HostState(build_units(model_cfg))
    load_hf_weights(state, path, model_cfg, progress=False)
    for unit in state.units:
        for p in unit.params:
            for which in ("exp_avg", "exp_avg_sq"):
                assert ckpt.optimizer.get(f"{which}.{p.key}").shape == p.shape
    return ckpt.trainer_state.global_step


def subprocess_env() -> dict:
    # Same thread count as the tests (one_thread), so subprocess runs are bitwise comparable.
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


# ---------------------------------------------------------------------------- exact resume
def test_exact_resume_after_sigterm_matches_uninterrupted_run(tmp_path, monkeypatch):
    base = make_run(tmp_path)
    ref = train(TrainConfig(**base, output_dir=str(tmp_path / "a"), max_steps=7))

    # Run B: SIGTERM arrives during step 3; the step finishes, checkpoint-3 is saved, and
    # the run stops with exit code 143.
    orig_step = signal_after_step(monkeypatch, 3)
    b = tmp_path / "b"
    with pytest.raises(TrainingInterrupted, match="received SIGTERM, saved checkpoint-3; resume with") as e:
        train(TrainConfig(**base, output_dir=str(b), max_steps=7, save_steps=2))
    assert e.value.exit_code == 143
    assert [s for s, _ in list_checkpoints(b)] == [2, 3]
    assert [r["step"] for r in metrics(b)] == [1, 2, 3]
    assert not (b / "final").exists()
    monkeypatch.setattr(Engine, "step", orig_step)

    # Resume from the older checkpoint by path: the record of step 3 is dropped and redone.
    final = train(
        TrainConfig(
            **base,
            output_dir=str(b),
            max_steps=7,
            save_steps=2,
            resume_from_checkpoint=str(b / "checkpoint-2"),
        )
    )
    got, want = metrics(b), metrics(tmp_path / "a")
    assert [r["step"] for r in got] == list(range(1, 8))
    for key in ("loss", "grad_norm", "lr", "tokens", "label_tokens", "epoch"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert_bitwise(tensors(final), tensors(ref))
    # The final checkpoints agree bit for bit too: master weights and both AdamW moments.
    assert_bitwise(tensors(b / "checkpoint-7"), tensors(tmp_path / "a" / "checkpoint-7"))
    st = json.loads((b / "checkpoint-7" / "trainer_state.json").read_text())
    assert st["global_step"] == st["optimizer_step"] == 7
    assert st["lr_scheduler"] == {
        "type": "cosine",
        "learning_rate": 3e-3,
        "warmup_steps": 2,
        "total_steps": 7,
        "last_step": 7,
    }
    assert [r["step"] for r in st["log_history"]] == list(range(1, 8))
    assert "learning_rate" in st["log_history"][0]


def test_resume_latest_and_missing(tmp_path):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint: no checkpoint-\* directory in"):
        train(TrainConfig(**base, output_dir=str(out), max_steps=2, resume_from_checkpoint=True))
    assert not out.exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .*nope is not a directory"):
        train(
            TrainConfig(
                **base, output_dir=str(out), max_steps=2, resume_from_checkpoint=str(tmp_path / "nope")
            )
        )

    train(TrainConfig(**base, output_dir=str(out), max_steps=3, save_steps=1))
    # Temporaries and look-alikes are never taken for checkpoints; the newest is by step number.
    (out / ".checkpoint-9.tmp-abc").mkdir()
    (out / "checkpoint-10.bak").mkdir()
    (out / "checkpoint-11").write_text("a file, not a checkpoint")
    assert [s for s, _ in list_checkpoints(out)] == [1, 2, 3]
    cfg = TrainConfig(**base, output_dir=str(out), max_steps=5, resume_from_checkpoint=True)
    assert resume_path(cfg) == out / "checkpoint-3"
    train(cfg)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5]
    assert not (out / ".checkpoint-9.tmp-abc").exists()  # leftovers of a killed save are cleaned up


def test_a_resume_on_other_data_is_refused_unless_said_and_changes_are_named(tmp_path, capsys):
    """Another dataset (model, stage) is refused in one line naming it, before anything is written;
    resume_with_changes continues anyway, and the one warning line names every key changed; the
    same file written another way is the same dataset."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=2, save_steps=1))
    other = tmp_path / "other.jsonl"
    shutil.copy(base["dataset"], other)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cfg = dict(base, output_dir=str(out), max_steps=3, resume_from_checkpoint=True, dataset=str(other))
    with pytest.raises(ConfigError) as e:
        train(TrainConfig(**cfg))
    assert str(e.value) == (
        f"resume_from_checkpoint: {out / 'checkpoint-2'} is another run's model, data or stage "
        f"(dataset: {base['dataset']!r} -> {str(other)!r}); resume_with_changes: true continues from it anyway"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    capsys.readouterr()
    train(TrainConfig(**dict(cfg, resume_with_changes=True, learning_rate=1e-3)))
    warned = [x for x in capsys.readouterr().out.splitlines() if "settings changed since the checkpoint" in x]
    assert warned == [
        "megatrain: warning: settings changed since the checkpoint: "
        f"dataset: {base['dataset']!r} -> {str(other)!r}; learning_rate: 0.003 -> 0.001; max_steps: 2 -> 3"
    ]
    same = os.path.relpath(other)  # checkpoint-3's file, by another path
    train(TrainConfig(**dict(cfg, dataset=same, max_steps=4, output_dir=str(out))))
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


def test_resume_names_a_corrupt_trainer_state(tmp_path):
    """A broken trainer_state.json is named as corrupt, not read as "no checkpoint" nor passed
    over for an older checkpoint."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=2, save_steps=1))
    cfg = TrainConfig(**base, output_dir=str(out), max_steps=4, resume_from_checkpoint=True)
    for broken in ("checkpoint-2", "checkpoint-1"):  # the newest, then every one
        (out / broken / "trainer_state.json").write_text('{"format": 1, "global_st')
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        state = out / "checkpoint-2" / "trainer_state.json"
        with pytest.raises(CheckpointError) as e:
            train(cfg)
        assert str(e.value).startswith(f"resume_from_checkpoint: {state}: unreadable, the file is corrupt (")
        assert "move checkpoint-2 away" in str(e.value)
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_save_total_limit_keeps_newest(tmp_path):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=5, save_steps=2, save_total_limit=2))
    # Saves at 2, 4 and the final step 5; the oldest is deleted.
    assert [s for s, _ in list_checkpoints(out)] == [4, 5]
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint-4",
        "checkpoint-5",
        "final",
        "metrics.jsonl",
        "plan.json",
        "train_config.json",
    ]


def test_sharded_checkpoint_and_layout(tmp_path):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=2, max_shard_size="100KB"))
    ck = out / "checkpoint-2"
    names = sorted(p.name for p in ck.iterdir())
    assert "model.safetensors.index.json" in names and "optimizer.safetensors.index.json" in names
    assert any(n.startswith("model-00001-of-") for n in names)
    assert {"config.json", "trainer_state.json", "rng_state.pt", "train_config.json"} <= set(names)
    assert all(p.stat().st_size <= 100_000 for p in ck.glob("*.safetensors"))
    model_cfg = ModelConfig.from_json(tmp_path / "model")
    keys = [p.key for u in build_units(model_cfg) for p in u.params]
    t = tensors(ck)
    assert set(t) == set(keys) | {f"exp_avg.{k}" for k in keys} | {f"exp_avg_sq.{k}" for k in keys}
    assert all(v.dtype == torch.float32 for v in t.values())
    assert load_fully(ck, model_cfg) == 2
    # The checkpoint is itself a Hugging Face model directory.
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(ck)
    assert torch.equal(hf.model.embed_tokens.weight, t["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------- validation
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("saved")
    base = make_run(tmp)
    train(TrainConfig(**base, output_dir=str(tmp / "out"), max_steps=2))
    return tmp, base, ModelConfig.from_json(tmp / "model")


def _corrupt_copy(saved, tmp_path, edit) -> Path:
    src = saved[0] / "out" / "checkpoint-2"
    dst = tmp_path / "checkpoint-2"
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _reshape_one(p: Path) -> None:
    with safe_open(p, "pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
    t["model.norm.weight"] = torch.zeros(3)
    save_file(t, p)


@pytest.mark.parametrize(
    "edit,where,what",
    [
        (
            lambda d: _truncate(d / "optimizer.safetensors"),
            "optimizer.safetensors",
            "not a readable safetensors",
        ),
        (lambda d: _truncate(d / "model.safetensors"), "model.safetensors", "not a readable safetensors"),
        (lambda d: (d / "optimizer.safetensors").unlink(), "checkpoint-2", "no optimizer.safetensors"),
        (lambda d: (d / "trainer_state.json").unlink(), "trainer_state.json", "missing"),
        (lambda d: (d / "trainer_state.json").write_text("{"), "trainer_state.json", "unreadable"),
        (
            lambda d: (d / "trainer_state.json").write_text('{"format": 1, "global_step": 2}'),
            "trainer_state.json",
            "'epoch' is missing",
        ),
        (lambda d: (d / "rng_state.pt").write_bytes(b"garbage"), "rng_state.pt", "unreadable"),
        (
            lambda d: _reshape_one(d / "model.safetensors"),
            "model.safetensors",
            "model.norm.weight has shape (3,)",
        ),
        (
            lambda d: (d / "config.json").write_text(
                (d / "config.json").read_text().replace('"num_hidden_layers": 3', '"num_hidden_layers": 4')
            ),
            "config.json",
            "num_hidden_layers is 4",
        ),
    ],
)
def test_open_checkpoint_names_the_broken_piece(saved, tmp_path, edit, where, what):
    path = _corrupt_copy(saved, tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(path, saved[2])
    msg = str(e.value)
    assert where in msg and what in msg, msg
    assert "\n" not in msg


def test_resume_from_broken_checkpoint_writes_nothing(saved, tmp_path):
    path = _corrupt_copy(saved, tmp_path, lambda d: _truncate(d / "optimizer.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        train(TrainConfig(**saved[1], output_dir=str(out), max_steps=4, resume_from_checkpoint=str(path)))
    assert not out.exists()


# ---------------------------------------------------------------------------- processes
def _wait_for(predicate, proc, timeout=120.0):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"training exited early with {proc.returncode}"
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_leaves_a_broken_checkpoint(tmp_path):
    steps = 60  # four kills reach step ~16 on 2 cores; the rest is the last resume's
    base = make_run(tmp_path, n=200)
    base.update(max_steps=steps, save_steps=1, save_total_limit=3)
    cfg_path = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(tmp_path / "out")))
    out = tmp_path / "out"
    model_cfg = ModelConfig.from_json(tmp_path / "model")
    rng = random.Random(1234)
    cmd = [sys.executable, "-m", "megatrain.cli", "train", str(cfg_path)]
    done = 0
    for i in range(4):
        log = open(tmp_path / f"log{i}.txt", "w")  # noqa: SIM115
        resume = [f"resume_from_checkpoint={'true' if i else 'false'}"]
        proc = subprocess.Popen(cmd + resume, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        # Wait for this run's first new checkpoint, then kill at a random moment of what follows
        # (mostly saves: a save takes longer than a step of this model).
        _wait_for(lambda d=done: any(s > d for s, _ in list_checkpoints(out)), proc)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.wait()
        log.close()
        found = list_checkpoints(out)
        assert found and len(found) <= 3 + 1  # a kill between commit and prune leaves one extra
        for step, path in found:
            assert load_fully(path, model_cfg) == step
        done = found[-1][0]
        assert done < steps, "the run finished before it was killed; make it longer"
    # A last resume runs to the end and matches an uninterrupted run exactly.
    subprocess.run(
        cmd + ["resume_from_checkpoint=true"],
        env=subprocess_env(),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    ref = train(
        TrainConfig(**dict(base, save_steps=0, save_total_limit=None), output_dir=str(tmp_path / "ref"))
    )
    got, want = metrics(out), metrics(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert_bitwise(tensors(out / "final"), tensors(ref))


@pytest.mark.slow
def test_sigterm_in_subprocess_saves_and_exits_143(tmp_path):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg_path = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=100_000))
    stdout, stderr = open(tmp_path / "stdout", "w"), open(tmp_path / "stderr", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatrain.cli", "train", str(cfg_path)],
        env=subprocess_env(),
        stdout=stdout,
        stderr=stderr,
    )
    _wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text()) > 0, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    stdout.close()
    stderr.close()
    last = metrics(out)[-1]["step"]
    err = (tmp_path / "stderr").read_text()
    assert (
        f"megatrain: received SIGTERM, saved checkpoint-{last}; resume with resume_from_checkpoint=true"
        in err
    )
    assert "Traceback" not in err
    assert [s for s, _ in list_checkpoints(out)] == [last]
    assert load_fully(out / f"checkpoint-{last}", ModelConfig.from_json(tmp_path / "model")) == last
    assert not (out / "final").exists()
    assert not (out / ".megatrain.lock").exists()  # released on the signal


def test_second_signal_aborts_at_once():
    before = signal.getsignal(signal.SIGINT)
    notes = []
    with pytest.raises(Aborted) as e, SignalGuard(notes.append) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        assert guard.requested and guard.name == "SIGINT"
        assert "finishing the current step" in notes[0]
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("the second signal did not abort")
    assert e.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is before  # handlers are restored


# ---------------------------------------------------------------------------- non-finite steps
def _inject(monkeypatch, bad_steps: set[int], where: str):
    """Make the loss (or the grad norm) of the given 1-based steps NaN/inf."""
    calls = {"n": 0}
    fb, clip = Engine.forward_backward, Engine.clip_grad_norm

    def forward_backward(self, mbs):
        calls["n"] += 1
        loss, n = fb(self, mbs)
        return (loss * float("nan") if where == "loss" and calls["n"] in bad_steps else loss), n

    def clip_grad_norm(self, max_norm):
        total, coef = clip(self, max_norm)
        return (total * float("inf") if where == "grad" and calls["n"] in bad_steps else total), coef

    monkeypatch.setattr(Engine, "forward_backward", forward_backward)
    monkeypatch.setattr(Engine, "clip_grad_norm", clip_grad_norm)
    steps = []
    orig_step = Engine.step
    monkeypatch.setattr(
        Engine, "step", lambda self, lr, coef: (steps.append(calls["n"]), orig_step(self, lr, coef))
    )
    return steps


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_step_is_skipped(tmp_path, monkeypatch, where):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    stepped = _inject(monkeypatch, {2, 4}, where)
    train(TrainConfig(**base, output_dir=str(out), max_steps=5))
    assert stepped == [1, 3, 5]  # the optimizer never saw the bad steps
    recs = metrics(out)
    assert [r.get("skipped", False) for r in recs] == [False, True, False, True, False]
    assert recs[1]["loss"] is None and recs[1]["grad_norm"] is None
    st = json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())
    assert (st["global_step"], st["optimizer_step"]) == (5, 3)
    assert all(torch.isfinite(t).all() for t in tensors(out / "checkpoint-5").values())


def test_consecutive_nonfinite_steps_stop_the_run(tmp_path, monkeypatch):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    stepped = _inject(monkeypatch, set(range(3, 100)), "loss")
    with pytest.raises(
        DivergedError, match="step 5: loss or grad_norm not finite for 3 consecutive steps"
    ) as e:
        train(TrainConfig(**base, output_dir=str(out), max_steps=10, save_steps=2))
    assert e.value.exit_code == 1
    assert stepped == [1, 2]
    assert [r.get("skipped", False) for r in metrics(out)] == [False, False, True, True, True]
    # checkpoint-4 holds the weights of step 2 (skipped steps change nothing but the data position).
    assert_bitwise(tensors(out / "checkpoint-4"), tensors(out / "checkpoint-2"))
    assert not (out / "final").exists()

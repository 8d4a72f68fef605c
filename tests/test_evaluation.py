"""Evaluation during training: the engine's forward-only loss against transformers, the eval
batches, the settings, a run with evaluation training bit for bit as one without, the best
checkpoint (pruning, final/, resume) and the readers of metrics.jsonl. CPU, tiny models."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_hf_model
from test_checkpoint import assert_bitwise, make_run, metrics, one_thread, signal_after_step, tensors  # noqa: F401 (fixture)

from megatrain.config import TrainConfig
from megatrain.data import Batcher, Sample
from megatrain.data.batch import IGNORE_INDEX, MicroBatch
from megatrain.engine.engine import Engine
from megatrain.errors import CheckpointError, ConfigError
from megatrain.evaluation import Evaluator
from megatrain.guard import TrainingInterrupted
from megatrain.io.checkpoint import TRAINER_STATE, TrainerState, list_checkpoints, prune_checkpoints
from megatrain.metrics import MetricsLogger
from megatrain.models.config import ModelConfig
from megatrain.planning.placement import Choices
from megatrain.plot import draw, read_metrics
from megatrain.runtime import build_model, make_plan
from megatrain.trackers import is_eval
from megatrain.trainer import train


# ---------------------------------------------------------------------------- the engine
def _batch(vocab: int, B: int, S: int, seed: int) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = IGNORE_INDEX  # a prompt
    labels[-1, S // 2 : S // 2 + 2] = IGNORE_INDEX
    if B > 1:
        labels[0, S - 4 :] = (
            IGNORE_INDEX  # right padding (the last row's end is labelled: the last chunk counts)
        )
    return MicroBatch(ids, labels)


def _host_state(state) -> list[torch.Tensor]:
    return [state.master(), state.exp_avg.clone(), state.exp_avg_sq.clone()]


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_eval_loss_is_transformers_loss_and_touches_nothing(family, tied, tmp_path):
    hf = tiny_hf_model(family, tied)
    hf.save_pretrained(tmp_path / "hf")
    # Loss chunks of 7 tokens divide none of the micro-batches.
    cfg = ModelConfig.from_json(tmp_path / "hf")
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", choices=Choices(loss_chunk_tokens=7))
    assert mt.plan.loss_chunk_tokens == 7 and mt.plan.grad_mode == "stored"
    vocab = hf.config.vocab_size
    mbs = [_batch(vocab, 2, 20, 1), _batch(vocab, 3, 13, 2), _batch(vocab, 1, 9, 3)]

    # transformers' own causal-LM loss (mean over a batch's label tokens) back to a sum.
    n_ref = sum(mb.num_label_tokens for mb in mbs)
    with torch.no_grad():
        ref = sum(
            hf(input_ids=mb.input_ids, labels=mb.labels).loss.double() * mb.num_label_tokens for mb in mbs
        )

    before = _host_state(mt.state)
    rng_torch, rng_py = torch.get_rng_state(), random.getstate()
    loss_sum, n = mt.engine.eval_loss(mbs)
    assert n == n_ref
    assert loss_sum.dtype == torch.float32 and loss_sum.dim() == 0
    assert loss_sum.item() / n == pytest.approx(ref.item() / n_ref, rel=1e-6)
    # Forward only: weights, moments, gradients and the random generators are untouched.
    for a, b in zip(before, _host_state(mt.state)):
        assert torch.equal(a, b)
    assert mt.transport.held == {}
    assert torch.equal(rng_torch, torch.get_rng_state()) and rng_py == random.getstate()

    # The training loss of the same micro-batches is the same number, bit for bit.
    loss, n_train = mt.engine.forward_backward(mbs)
    assert n_train == n and loss.item() == (loss_sum / n).item()
    mt.close()


@pytest.mark.parametrize("mode", ["stored", "two_pass", "immediate"])
def test_evaluating_between_steps_trains_bitwise_as_without(mode):
    """Every gradient mode: an evaluation after each optimizer step leaves losses, gradient norms,
    weights and moments exactly as without it. The held gradients of a stored step survive an
    evaluation before `step`; a step whose backward sweep runs inside `step` (two_pass,
    immediate) refuses one and then steps as if nothing had been asked."""
    cfg = ModelConfig.from_hf(tiny_config("llama", False))
    clip = mode != "immediate"
    choices = Choices(gradient_placement="two_pass" if mode == "two_pass" else "auto", loss_chunk_tokens=9)
    plan, _ = make_plan(cfg, "cpu", torch.float32, clip=clip, choices=choices)
    assert plan.grad_mode == mode
    held = _batch(cfg.vocab_size, 2, 12, 99)
    runs = []
    for evaluate in (False, True):
        mt = build_model(cfg, seed=5, device="cpu", plan=plan)
        trace, evals = [], []
        for step in range(3):
            mbs = [_batch(cfg.vocab_size, 2, 10 + 3 * m, 10 * step + m) for m in range(2)]
            loss, _ = mt.engine.forward_backward(mbs)
            norm, coef = mt.engine.clip_grad_norm(0.5 if clip else 0.0)
            if evaluate and mode == "stored":
                before = {i: g.clone() for i, g in mt.transport.held.items()}
                evals.append(mt.engine.eval_loss([held])[0].item())
                assert mt.transport.held.keys() == before.keys()
                assert all(torch.equal(mt.transport.held[i], g) for i, g in before.items())
            elif evaluate:
                with pytest.raises(RuntimeError, match="inside an optimizer step"):
                    mt.engine.eval_loss([held])
            measured = mt.engine.step(1e-2, coef)
            if evaluate:
                evals.append(mt.engine.eval_loss([held])[0].item())
            trace.append((loss.item(), (norm if clip else measured).item()))
        runs.append((trace, evals, _host_state(mt.state)))
        mt.close()
    (t0, _, s0), (t1, e1, s1) = runs
    assert t0 == t1 and all(torch.equal(a, b) for a, b in zip(s0, s1))
    assert len(e1) == (6 if mode == "stored" else 3) and len(set(e1)) > 1  # the weights moved


# ---------------------------------------------------------------------------- eval batches
def _samples(lengths: list[int]) -> list[Sample]:
    """Sample k starts with token k + 3; its first two labels are prompt."""
    out = []
    for k, n in enumerate(lengths):
        ids = [k + 3] + [(7 * k + j) % 90 + 3 for j in range(n - 1)]
        out.append(Sample(ids, [IGNORE_INDEX] * 2 + ids[2:], f"mem:{k + 1}"))
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_eval_batches_cover_every_sample_once_in_file_order(packing):
    lengths = [5, 9, 3, 12, 7, 4, 8, 6, 10, 11, 2, 13, 6]
    samples = _samples(lengths)
    b = Batcher(
        samples, batch_size=3, grad_accum=2, max_length=16, packing=packing, shuffle=False, drop_last=False
    )
    steps = list(b.epoch_steps())
    mbs = [mb for step in steps for mb in step]
    assert all(1 <= len(step) <= 2 for step in steps) and len(steps) == b.steps_per_epoch
    if not packing:  # 13 samples: micro-batches of 3, 3, 3, 3, 1 in two-micro-batch steps
        assert [[mb.input_ids.shape[0] for mb in step] for step in steps] == [[3, 3], [3, 3], [1]]
        assert [row[0] - 3 for mb in mbs for row in mb.input_ids.tolist()] == list(range(13))
    else:  # documents in file order, each exactly once
        firsts = [
            row[i] - 3
            for mb in mbs
            for row, pos in zip(mb.input_ids.tolist(), mb.position_ids.tolist())
            for i, p in enumerate(pos)
            if p == 0 and row[i] != 0
        ]
        assert firsts == list(range(13))
    # Every label token counts exactly once (the first two of each sample are prompt).
    assert sum(mb.num_label_tokens for mb in mbs) == sum(n - 2 for n in lengths)
    assert sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs) == sum(n - 2 for n in lengths)
    # Deterministic, and the training position is untouched.
    again = [mb for step in b.epoch_steps() for mb in step]
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(mbs, again))
    assert b.state_dict()["position"] == 0


def test_an_eval_set_smaller_than_one_batch_is_fine():
    b = Batcher(_samples([5]), batch_size=4, grad_accum=3, max_length=8, shuffle=False, drop_last=False)
    (step,) = list(b.epoch_steps())
    assert len(step) == 1 and step[0].input_ids.shape == (1, 5)


# ---------------------------------------------------------------------------- settings


def test_eval_defaults_follow_transformers():
    off = TrainConfig(model_config="m", dataset="d")
    assert off.eval_strategy == "no" and off.eval_steps is None and off.metric_for_best_model is None
    on = TrainConfig(model_config="m", dataset="d", eval_dataset="e", per_device_train_batch_size=3)
    assert on.eval_strategy == "steps" and on.eval_steps == 0.1 and on.per_device_eval_batch_size == 3
    best = TrainConfig(
        model_config="m", dataset="d", eval_dataset="e", save_steps=50, load_best_model_at_end=True
    )
    assert best.eval_steps == 50 and best.metric_for_best_model == "eval_loss"
    assert best.greater_is_better is False
    assert TrainConfig(model_config="m", dataset="d", eval_dataset="e", eval_steps=5.0).eval_steps == 5
    kept = TrainConfig(model_config="m", dataset="d", eval_dataset="e", eval_strategy="no")
    assert kept.eval_strategy == "no"
    # YAML reads `eval_strategy: no` (and the override eval_strategy=no) as false.
    assert TrainConfig.load(None, ["model_config=m", "dataset=d", "eval_strategy=no"]).eval_strategy == "no"


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(eval_dataset="e", eval_strategy="sometimes"), "eval_strategy: must be one of no, steps, epoch"),
        (dict(eval_dataset="e", eval_strategy=True), "eval_strategy: must be one of no, steps, epoch"),
        (dict(eval_strategy="steps"), "eval_strategy: needs an eval_dataset"),
        (
            dict(eval_dataset="e", eval_steps=0),
            "eval_steps: must be a whole number of steps >= 1, or a fraction",
        ),
        (dict(eval_dataset="e", eval_steps=2.5), "eval_steps: must be a whole number"),
        (dict(eval_dataset="e", eval_steps=float("inf")), "eval_steps: must be a finite number"),
        (dict(eval_dataset="e", per_device_eval_batch_size=0), "per_device_eval_batch_size: must be >= 1"),
        (
            dict(eval_dataset="e", metric_for_best_model="accuracy"),
            "metric_for_best_model: must be eval_loss",
        ),
        (dict(metric_for_best_model="eval_loss"), "metric_for_best_model: needs evaluation"),
        (dict(load_best_model_at_end=True, save_steps=2), "load_best_model_at_end: needs evaluation"),
        (dict(eval_dataset="e", load_best_model_at_end=True), "load_best_model_at_end: needs save_steps"),
        (
            dict(eval_dataset="e", load_best_model_at_end=True, save_steps=30, eval_steps=20),
            "load_best_model_at_end: save_steps 30 must be a round multiple of eval_steps 20",
        ),
        (
            dict(eval_dataset="e", load_best_model_at_end=True, save_steps=30, eval_steps=0.1),
            "load_best_model_at_end: needs save_steps and eval_steps in steps, not fractions (30, 0.1)",
        ),
        (
            dict(eval_dataset="e", load_best_model_at_end=True, save_steps=30, eval_strategy="epoch"),
            "load_best_model_at_end: needs save_strategy and eval_strategy to be the same (got steps and epoch)",
        ),
        (
            dict(eval_dataset="e", load_best_model_at_end=True, save_strategy="no"),
            "load_best_model_at_end: needs save_strategy and eval_strategy to be the same (got no and steps)",
        ),
        (
            dict(eval_dataset="e", load_best_model_at_end=True, save_steps=0.5, eval_steps=0.25),
            "load_best_model_at_end: needs save_steps and eval_steps in steps, not fractions (0.5, 0.25)",
        ),
    ],
)
def test_bad_eval_settings_are_one_line_naming_the_key(kw, message):
    with pytest.raises(ConfigError) as e:
        TrainConfig(model_config="m", dataset="d", **kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------------------- training runs
def _eval_data(tmp_path: Path, n: int = 7) -> str:
    rng = random.Random(7)
    path = tmp_path / "eval.jsonl"
    path.write_text(
        "".join(
            json.dumps({"input_ids": [rng.randrange(97) for _ in range(rng.randint(6, 30))]}) + "\n"
            for _ in range(n)
        )
    )
    return str(path)


def test_the_memory_plan_counts_the_eval_data_it_holds(tmp_path):
    from megatrain.plan import data_bytes

    data = _eval_data(tmp_path)
    train_only = data_bytes(TrainConfig(model_config="m", dataset=data))
    kw = dict(model_config="m", dataset=data, eval_dataset=data)
    assert train_only > 0 and data_bytes(TrainConfig(**kw)) == 2 * train_only
    assert data_bytes(TrainConfig(**kw, eval_strategy="no")) == train_only  # never loaded
    assert (
        data_bytes(TrainConfig(model_config="m", eval_dataset=data)) == train_only
    )  # `plan` needs no dataset


def test_when_evaluations_happen(tmp_path):
    data = _eval_data(tmp_path)

    def due(total, steps_per_epoch=10, **kw):
        cfg = TrainConfig(model_config="m", dataset=data, eval_dataset=data, **kw)
        evaluator = Evaluator(cfg, None, total, steps_per_epoch)
        return [s for s in range(total + 1) if evaluator.due(s)]

    assert due(100, eval_steps=0.07) == [*range(7, 100, 7), 100]  # 0.07 x 100 is 7.000000000000001
    assert due(10, eval_steps=0.25) == [3, 6, 9, 10]  # a fraction rounds up, as in transformers
    assert due(25, eval_strategy="epoch") == [10, 20, 25]
    assert due(5, eval_steps=2, eval_on_start=True) == [0, 2, 4, 5]
    assert due(5, eval_strategy="no") == []

    # Checkpoints are evaluated ones per epoch (which load_best_model_at_end accepts), and for
    # the same fraction of the run (eval_steps defaults to save_steps): both round it alike.
    from megatrain.io.outputs import SaveSchedule

    epochs = dict(save_strategy="epoch", eval_strategy="epoch", load_best_model_at_end=True)
    for total, kw in ((25, epochs), (100, dict(save_steps=0.07))):
        cfg = TrainConfig(model_config="m", dataset=data, eval_dataset=data, **kw)
        saves = SaveSchedule.of(cfg, total, 10)
        assert [s for s in range(1, total + 1) if saves.due(s)] == due(total, **kw)


def test_evaluation_leaves_training_bitwise_unchanged_and_is_transformers_loss(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    base = make_run(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    train(TrainConfig(**base, output_dir=str(a), max_steps=5, save_steps=2))
    evaluation = dict(eval_dataset=_eval_data(tmp_path), eval_steps=2, eval_on_start=True)
    train(
        TrainConfig(
            **base, output_dir=str(b), max_steps=5, save_steps=2, report_to="tensorboard", **evaluation
        )
    )

    # Training is bit for bit what it is without evaluation: losses, weights, both AdamW moments,
    # and the random generators (evaluation draws nothing from them).
    steps_a, records_b = metrics(a), metrics(b)
    steps_b = [r for r in records_b if not is_eval(r)]
    for key in ("step", "loss", "grad_norm", "lr", "tokens", "label_tokens"):
        assert [r[key] for r in steps_b] == [r[key] for r in steps_a], key
    assert_bitwise(tensors(b / "final"), tensors(a / "final"))
    for step in (2, 4, 5):
        assert_bitwise(tensors(b / f"checkpoint-{step}"), tensors(a / f"checkpoint-{step}"))
        ra, rb = (torch.load(d / f"checkpoint-{step}" / "rng_state.pt", weights_only=True) for d in (a, b))
        assert ra["python"] == rb["python"] and torch.equal(ra["torch"], rb["torch"])

    # Evaluations after the steps of eval_steps, after the last step, and before the first.
    evals = [r for r in records_b if is_eval(r)]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]
    assert records_b.index(evals[1]) == 3  # after the eval at 0 and steps 1, 2: after the step it evaluates
    # eval_loss is transformers' loss over the whole eval set with the checkpoint's weights.
    hf = AutoModelForCausalLM.from_pretrained(b / "checkpoint-4").float().eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for line in Path(evaluation["eval_dataset"]).read_text().splitlines():
            ids = torch.tensor([json.loads(line)["input_ids"]])
            total += hf(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            n += ids.shape[1] - 1
    rec = evals[2]
    assert rec["eval_label_tokens"] == n
    assert rec["eval_loss"] == pytest.approx(total / n, rel=1e-5)
    assert rec["eval_perplexity"] == pytest.approx(torch.tensor(total / n).exp().item(), rel=1e-5)
    assert rec["eval_runtime"] > 0 and rec["eval_tokens_per_s"] > 0 and rec["eval_samples_per_second"] > 0
    # The log history (Hugging Face names) and TensorBoard have them too.
    history = json.loads((b / "checkpoint-5" / "trainer_state.json").read_text())["log_history"]
    assert [r for r in history if "eval_loss" in r] == evals
    acc = EventAccumulator(str(b / "runs"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [
        (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in evals
    ]


SCRIPTED = {2: 3.0, 4: 1.0, 6: 2.0, 8: 4.0}  # eval_loss by step: the best is step 4


@pytest.fixture
def scripted_eval(monkeypatch):
    """Evaluations report SCRIPTED[step] as eval_loss (a real evaluation still runs)."""
    real = Evaluator.evaluate

    def evaluate(self, engine, step, epoch, progress, rollout=None):
        record = real(self, engine, step, epoch, progress, rollout)
        record["eval_loss"] = SCRIPTED[step]
        return record

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)


def test_load_best_model_at_end_keeps_and_exports_the_best(tmp_path, scripted_eval, monkeypatch, capsys):
    base = make_run(tmp_path)
    run = dict(
        base,
        max_steps=8,
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        eval_dataset=_eval_data(tmp_path),
    )
    a = tmp_path / "a"
    train(TrainConfig(**run, output_dir=str(a)))
    assert [s for s, _ in list_checkpoints(a)] == [4, 8]  # the best survives save_total_limit 1
    state = json.loads((a / "checkpoint-8" / "trainer_state.json").read_text())
    assert (state["best_metric"], state["best_global_step"]) == (1.0, 4)
    assert state["best_model_checkpoint"] == str(a / "checkpoint-4")
    best = {k: v for k, v in tensors(a / "checkpoint-4").items() if not k.startswith("exp_avg")}
    assert_bitwise(tensors(a / "final"), best)
    assert (
        "megatrain: final/ is the best checkpoint, checkpoint-4 (eval_loss 1.0000)" in capsys.readouterr().out
    )

    # Interrupted after step 5 and resumed: the best (step 4) is remembered across the resume,
    # so step 6's better-than-nothing 2.0 does not displace it.
    b = tmp_path / "b"
    real_step = signal_after_step(monkeypatch, 5)
    with pytest.raises(TrainingInterrupted):
        train(TrainConfig(**run, output_dir=str(b)))
    monkeypatch.setattr(Engine, "step", real_step)
    assert [s for s, _ in list_checkpoints(b)] == [4, 5]
    train(TrainConfig(**run, output_dir=str(b), resume_from_checkpoint=True))
    assert [s for s, _ in list_checkpoints(b)] == [4, 8]
    resumed = json.loads((b / "checkpoint-8" / "trainer_state.json").read_text())
    assert (resumed["best_metric"], resumed["best_global_step"]) == (1.0, 4)
    assert resumed["best_model_checkpoint"] == str(b / "checkpoint-4")
    assert_bitwise(tensors(b / "final"), tensors(a / "final"))
    keys = ("step", "loss", "eval_loss")
    assert [[r.get(k) for k in keys] for r in metrics(b)] == [[r.get(k) for k in keys] for r in metrics(a)]


def test_a_corrupt_best_checkpoint_is_refused_by_name(tmp_path, scripted_eval, monkeypatch):
    """final/ from the best checkpoint reads it as an export does: its checksums first."""
    base = make_run(tmp_path)
    run = dict(
        base, max_steps=8, save_steps=2, load_best_model_at_end=True, eval_dataset=_eval_data(tmp_path)
    )
    out = tmp_path / "out"
    scripted = Evaluator.evaluate

    def evaluate(self, engine, step, epoch, progress, rollout=None):
        if step == 8:  # checkpoint-4 (the best) goes bad on disk before final/ is written
            data = bytearray((out / "checkpoint-4" / "model.safetensors").read_bytes())
            data[-1] ^= 0x10
            (out / "checkpoint-4" / "model.safetensors").write_bytes(bytes(data))
        return scripted(self, engine, step, epoch, progress, rollout)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    with pytest.raises(CheckpointError, match="checkpoint-4/model.safetensors: checksum mismatch"):
        train(TrainConfig(**run, output_dir=str(out)))
    assert not (out / "final").exists()


def test_a_resumed_run_ignores_a_best_checkpoint_another_run_replaced(tmp_path):
    data = _eval_data(tmp_path)
    out = tmp_path / "out"
    cfg = TrainConfig(model_config="m", dataset=data, eval_dataset=data, output_dir=str(out), save_steps=2)
    best = out / "checkpoint-4"
    best.mkdir(parents=True)
    resumed = TrainerState(
        6, 0.0, 8, 6, {}, {}, run_id="a", best_metric=1.0, best_global_step=4, best_model_checkpoint=str(best)
    )
    for owner, kept in (("b", None), ("a", best)):  # overwrite_output_dir's run b saved a step 4 too
        (best / TRAINER_STATE).write_text(
            json.dumps(TrainerState(4, 0.0, 8, 4, {}, {}, run_id=owner).to_json())
        )
        warnings = []
        evaluator = Evaluator(cfg, None, 8, 4)
        evaluator.restore(resumed, warnings.append)
        assert evaluator.best_checkpoint == kept and evaluator.state()["best_global_step"] == (kept and 4)
        assert (owner == "b") == any("replaced by another run's" in w for w in warnings)


def test_resume_tells_its_metrics_from_another_runs_with_evaluations(tmp_path):
    """Deciding whether metrics.jsonl is the resumed run's compares optimizer-step records: an
    evaluation record of the same step says nothing about which run wrote it."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    evaluation = dict(eval_dataset=_eval_data(tmp_path), eval_steps=2)
    train(TrainConfig(**base, **evaluation, output_dir=str(out), max_steps=4, save_steps=4))
    # Another run in the same output_dir, evaluated at the same steps, saving no checkpoint.
    other = dict(overwrite_output_dir=True, save_strategy="no")
    train(TrainConfig(**base, **evaluation, **other, output_dir=str(out), max_steps=4, seed=7))
    b_metrics = (out / "metrics.jsonl").read_bytes()
    ckpt = out / "checkpoint-4"  # the first run's
    train(
        TrainConfig(**base, **evaluation, output_dir=str(out), max_steps=6, resume_from_checkpoint=str(ckpt))
    )
    assert [r["step"] for r in metrics(out) if not is_eval(r)] == [5, 6]
    assert b_metrics in [p.read_bytes() for p in out.glob("metrics-*.jsonl")]


def test_prune_never_deletes_the_protected_checkpoint(tmp_path):
    def left(keep, protect):
        out = tmp_path / f"k{keep}p{protect}"
        for s in range(1, 6):
            (out / f"checkpoint-{s}").mkdir(parents=True)
            ts = TrainerState(s, 0.0, 5, s, {}, {}, run_id="run")  # one lineage: pruning's scope
            (out / f"checkpoint-{s}" / TRAINER_STATE).write_text(json.dumps(ts.to_json()))
        protected = None if protect is None else out / f"checkpoint-{protect}"
        prune_checkpoints(out, keep, "run", protect=protected)
        return [s for s, _ in list_checkpoints(out)]

    # As in transformers: the best counts toward the limit; the newest always stays.
    assert left(3, None) == [3, 4, 5]
    assert left(3, 1) == [1, 4, 5]
    assert left(3, 4) == [3, 4, 5]
    assert left(1, 2) == [2, 5]
    assert left(1, 5) == [5]


# ---------------------------------------------------------------------------- metrics.jsonl readers
MIXED = [
    {"step": 1, "loss": 5.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0},
    {"step": 2, "loss": 4.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0},
    {"step": 2, "epoch": 0.5, "eval_loss": 4.5, "eval_perplexity": 90.0, "eval_runtime": 0.1},
    {"step": 3, "loss": 3.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0},
    {"step": 4, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0},
    {"step": 4, "epoch": 1.0, "eval_loss": 2.5, "eval_perplexity": 12.0, "eval_runtime": 0.1},
]


def test_plot_draws_eval_loss_on_the_loss_panel(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    steps, evals = read_metrics(tmp_path)
    assert [r["loss"] for r in steps] == [5.0, 4.0, 3.0, 2.0]  # eval records do not replace steps
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(2, 4.5), (4, 2.5)]
    lines = {ln.get_label(): ln for ln in draw(steps, evals, "run").axes[0].get_lines()}
    assert list(lines["eval"].get_xdata()) == [2, 4] and list(lines["eval"].get_ydata()) == [4.5, 2.5]
    assert list(lines["training"].get_ydata()) == [5.0, 4.0, 3.0, 2.0]


def test_resume_keeps_eval_records_up_to_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MIXED))
    MetricsLogger(tmp_path, total_steps=8, start_step=2, disable_tqdm=True).close()
    assert [(r["step"], is_eval(r)) for r in metrics(tmp_path)] == [(1, False), (2, False), (2, True)]

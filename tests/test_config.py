"""Reading the YAML config: YAML's own traps (booleans, duplicate keys) and errors that name
the file, line and column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_checkpoint import make_run, one_thread, write_yaml  # noqa: F401 (fixture)
from test_cli import run_cli

from megatrain.config import TrainConfig, warmup_of
from megatrain.errors import ConfigError
from megatrain.io.outputs import interval_steps

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _config_file(tmp_path, body: str):
    """run.yaml: the tiny model and data of make_run, then `body` verbatim."""
    base = make_run(tmp_path)
    head = f"model_config: {base['model_config']}\ndataset: {base['dataset']}\nmax_length: 32\n"
    p = tmp_path / "run.yaml"
    p.write_text(head + body)
    return p


def test_yaml_booleans_for_choice_keys(tmp_path, capsys):
    """`gpu_state: off` as the README writes it is YAML's false; "auto" is what the README calls
    the default of the true/false keys."""
    p = _config_file(
        tmp_path,
        "gpu_state: off\nreport_to: no\ntorch_compile: auto\noffload_activations: auto\ndisable_tqdm: auto\n",
    )
    rc, stdout, err = run_cli(capsys, "plan", p)
    assert rc == 0, err
    cfg = TrainConfig.load(p)
    assert (cfg.gpu_state, cfg.report_to) == ("off", [])
    assert cfg.torch_compile is None and cfg.offload_activations is None and cfg.disable_tqdm is None
    assert TrainConfig.load(p, ["gpu_state=on"]).gpu_state == "auto"
    assert TrainConfig.load(p, ["gpu_state=false"]).gpu_state == "off"
    assert TrainConfig.load(p, ["save_strategy=no"]).save_strategy == "no"  # as the README writes it
    with pytest.raises(ConfigError, match=r"^gpu_state: expected str, got 0$"):
        TrainConfig.load(p, ["gpu_state=0"])  # 0 == False in Python, but it is not a boolean
    with pytest.raises(
        ConfigError,
        match=r"^report_to: expected str or list, got True \(YAML reads unquoted yes/no/on/off/true/false as booleans",
    ):
        TrainConfig.load(p, ["report_to=yes"])


@pytest.mark.parametrize(
    "body,where,what",
    [
        (
            "learning_rate: 1.0e-3\nseed: 3\nlearning_rate: 2.0e-3\n",
            "6:1",
            "duplicate key 'learning_rate' (first on line 4)",
        ),
        ("extra_nested:\n  a: 1\n  a: 2\n", "6:3", "duplicate key 'a' (first on line 5)"),
        (
            "seed: [1,\nmax_steps: 3\n",
            "6:1",
            "expected ',' or ']', but got '<stream end>', while parsing a flow sequence from line 4",
        ),
        ("seed: 1\n  max_steps: 3\n", "5:12", "mapping values are not allowed here"),
        ("seed: 'one\n", "5:1", "found unexpected end of stream, while scanning a quoted scalar from line 4"),
    ],
)
def test_yaml_errors_name_line_and_column(tmp_path, capsys, body, where, what):
    p = _config_file(tmp_path, body)
    rc, _, err = run_cli(capsys, "train", p, f"output_dir={tmp_path / 'out'}")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0] == f"megatrain: error: {p}:{where}: not valid YAML: {what}"
    assert not (tmp_path / "out").exists()


def test_yaml_merge_keys_may_override(tmp_path):
    """A merge (`<<:`) provides defaults that the mapping's own keys override: not a duplicate."""
    p = _config_file(tmp_path, "<<: {seed: 5, max_steps: 3}\nseed: 7\n")
    cfg = TrainConfig.load(p)
    assert (cfg.seed, cfg.max_steps) == (7, 3)


def test_truncation_true_false_or_split():
    """truncation keeps its booleans and takes `split`; anything else is one line naming it."""

    def load(*overrides):
        return TrainConfig.load(None, ["model_config=unused", *overrides])

    assert load().truncation is True
    assert load("truncation=false").truncation is False
    assert load("truncation=split").truncation == "split"
    with pytest.raises(
        ConfigError,
        match=r"^truncation: must be true \(cut\), false \(refuse\) or split \(windows\) \(got 'windows'\)$",
    ):
        load("truncation=windows")
    with pytest.raises(ConfigError, match=r"^truncation: expected bool or str, got 3$"):
        load("truncation=3")
    with pytest.raises(ConfigError, match=r"^max_length: must be >= 2 with truncation: split .*\(got 1\)$"):
        load("truncation=split", "max_length=1")


def test_an_override_given_twice_is_refused(tmp_path, capsys):
    """As a key given twice in the YAML file is; overriding the file's key once is what overrides do."""
    p = _config_file(tmp_path, "seed: 3\n")
    assert TrainConfig.load(p, ["seed=5"]).seed == 5
    with pytest.raises(
        ConfigError, match=r"^override seed: given twice \('seed=5' and ' seed =6'\); give it once$"
    ):
        TrainConfig.load(p, ["seed=5", "max_steps=2", " seed =6"])
    rc, _, err = run_cli(capsys, "train", p, "max_steps=2", "max_steps=2", f"output_dir={tmp_path / 'out'}")
    twice = "override max_steps: given twice ('max_steps=2' and 'max_steps=2'); give it once"
    assert rc == 2 and err == f"megatrain: error: {twice}\n"
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- where paths lead
def test_paths_in_a_config_file_are_relative_to_it(tmp_path, monkeypatch):
    """A file of the same name in the working directory never replaces one beside the config;
    what is only in the working directory is found there; key=value paths and output_dir lead
    from the working directory."""
    conf, work = tmp_path / "conf", tmp_path / "work"
    for d in (conf, work):
        (d / "data").mkdir(parents=True)
        (d / "data" / "d.jsonl").write_text('{"input_ids": [1, 2]}\n')
        (d / "data" / "e.jsonl").write_text('{"input_ids": [1, 2]}\n')
        (d / "model").mkdir()
        (d / "model" / "config.json").write_text("{}")
    (work / "ckpt").mkdir()  # another run's output, in the working directory only
    (conf / "run.yaml").write_text(
        "model_config: model/config.json\ndataset: data/d.jsonl\n"
        "eval_dataset: data/d.jsonl, data/e.jsonl\nresume_from_checkpoint: ckpt\noutput_dir: out\n"
    )
    monkeypatch.chdir(work)
    cfg = TrainConfig.load(conf / "run.yaml")
    assert cfg.model_config == str(conf / "model" / "config.json")
    assert cfg.dataset == str(conf / "data" / "d.jsonl")
    assert cfg.eval_dataset == [str(conf / "data" / "d.jsonl"), str(conf / "data" / "e.jsonl")]
    assert cfg.resume_from_checkpoint == "ckpt"  # nothing beside the config: the working directory's
    assert cfg.output_dir == "out"
    cfg = TrainConfig.load(conf / "run.yaml", ["dataset=data/d.jsonl", "model_config=model"])
    assert (cfg.dataset, cfg.model_config) == ("data/d.jsonl", "model")


def test_the_examples_read_their_own_files_from_any_directory(tmp_path, monkeypatch):
    """The quickstart trained on a `data/stories.jsonl` of the working directory when there was
    one; the chat example still finds the quickstart's model where the quickstart wrote it."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stories.jsonl").write_text('{"text": "not the quickstart"}\n')
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "output" / "quickstart" / "final").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    quick = TrainConfig.load(EXAMPLES / "quickstart.yaml")
    assert quick.dataset == str(EXAMPLES / "data" / "stories.jsonl")
    assert quick.eval_dataset == str(EXAMPLES / "data" / "stories_eval.jsonl")
    assert quick.tokenizer_name_or_path == str(EXAMPLES / "tokenizer")
    assert quick.model_config == str(EXAMPLES / "tiny-llama" / "config.json")
    assert quick.output_dir == "output/quickstart"  # under the working directory, as the README says
    chat = TrainConfig.load(EXAMPLES / "chat.yaml")
    assert chat.model_name_or_path == "output/quickstart/final"
    assert chat.tokenizer_name_or_path == str(EXAMPLES / "tokenizer")
    assert chat.dataset == str(EXAMPLES / "chat" / "data.jsonl")


# ---------------------------------------------------------------------------- transformers 5's forms
def _load(*overrides):
    return TrainConfig.load(None, ["model_config=unused", *overrides])


def test_transformers_5_warmup_and_logging_steps():
    """transformers 5 reads warmup_steps and logging_steps below 1 as fractions of the run and
    dropped warmup_ratio (still read here)."""
    assert warmup_of(_load("warmup_steps=0.1"), 200) == 20
    assert warmup_of(_load("warmup_steps=0.07"), 100) == 7  # as save_steps and eval_steps round
    assert warmup_of(_load("warmup_steps=10"), 200) == 10
    whole = _load("warmup_steps=10.0").warmup_steps
    assert whole == 10 and isinstance(whole, int)
    assert warmup_of(_load("warmup_ratio=0.05"), 200) == 10
    assert warmup_of(_load("warmup_ratio=0.05", "warmup_steps=3"), 200) == 3
    assert warmup_of(_load(), 200) == 0
    cfg = _load("logging_steps=0.1")
    assert interval_steps(cfg.logging_steps, 50) == 5
    for overrides, message in [
        (
            ["warmup_steps=2.5"],
            r"^warmup_steps: must be a whole number of steps >= 0, or a fraction .*\(got 2.5\)$",
        ),
        (["warmup_steps=-1"], r"^warmup_steps: must be a whole number of steps >= 0"),
        (
            ["logging_steps=0"],
            r"^logging_steps: must be a whole number of steps >= 1, or a fraction of the run in \(0, 1\)",
        ),
        (["logging_steps=1.5"], r"^logging_steps: must be a whole number"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _load(*overrides)


def test_report_to_takes_lists_none_and_all():
    assert _load("report_to=none").report_to == []
    assert _load("report_to=[none]").report_to == []
    assert _load("report_to=[]").report_to == []
    assert _load("report_to=tensorboard").report_to == ["tensorboard"]
    assert _load("report_to=[tensorboard]").report_to == ["tensorboard"]
    # all: the integrations installed (the tests install every one megatrain has)
    assert _load("report_to=all").report_to == ["tensorboard", "wandb", "mlflow", "trackio"]
    assert _load("report_to=[tensorboard, wandb, tensorboard]").report_to == ["tensorboard", "wandb"]
    with pytest.raises(
        ConfigError,
        match=r"^report_to: 'comet' is not an integration megatrain has \(none, all, tensorboard, wandb, mlflow, trackio\)$",
    ):
        _load("report_to=[tensorboard, comet]")


def test_fractional_logging_and_warmup_steps_in_a_run(tmp_path, capsys):
    """logging_steps 0.5 of a 4-step run logs every 2 steps; warmup_steps 0.5 warms up over 2."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=4))
    rc, stdout, err = run_cli(
        capsys,
        "train",
        cfg,
        "logging_steps=0.5",
        "warmup_steps=0.5",
        "lr_scheduler_type=constant_with_warmup",
    )
    assert rc == 0, err
    logged = [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")]
    assert logged == ["2/4", "4/4"]
    lrs = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.0, 1.5e-3, 3e-3, 3e-3])


def test_lists_of_numbers_load_from_yaml_and_a_bad_item_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model_config: m\ndataset: d\nstage: grpo\nreward_funcs: [length, format]\nper_device_train_batch_size: 8\n"
                    "reward_weights: [-0.05, 1]\n")  # fmt: skip
    assert TrainConfig.load(path).reward_weights == [-0.05, 1.0]
    dpo = TrainConfig.load(path, ["stage=dpo", "reward_funcs=null", "reward_weights=null",
                                  "loss_type=[sigmoid, sft]", "loss_weights=[1, 0.5]"])  # fmt: skip
    assert dpo.loss_weights == [1.0, 0.5] and dpo.loss_type == ["sigmoid", "sft"]
    with pytest.raises(ConfigError, match=r"^reward_weights\[1\]: expected float, got 'a'$"):
        TrainConfig.load(path, ["reward_weights=[1, a]"])


def test_a_trl_recipes_keys_megatrain_does_not_take_are_named_together_in_one_line(tmp_path, capsys):
    """A TRL SFT recipe brings several Hugging Face keys megatrain does not take: one run of the
    command names them all, each with why, so the config is fixed in one pass; nothing is written."""
    from megatrain.config import NOT_TAKEN

    recipe = make_run(tmp_path) | dict(
        output_dir=str(tmp_path / "out"), gradient_checkpointing=True, optim="adamw_torch_fused",
        max_seq_length=1024, bf16=True, push_to_hub=False, learning_rate=2e-5,
    )  # fmt: skip
    rc, _, err = run_cli(capsys, "train", write_yaml(tmp_path / "sft.yaml", recipe))
    [line] = err.splitlines()
    assert rc == 2 and line.startswith("megatrain: error: ") and "config keys of Hugging Face's" in line
    for k in ("gradient_checkpointing", "max_seq_length", "bf16", "push_to_hub"):
        assert f"{k!r}: {NOT_TAKEN[k]}" in line
    assert "optim" not in NOT_TAKEN and "'optim'" not in line  # Hugging Face's optim names are taken
    assert "'max_seq_length': TRL's name before 0.20; it is max_length" in line
    assert not (tmp_path / "out").exists()


def test_the_retired_keys_are_refused_in_one_line_saying_why(tmp_path, capsys):
    """`host_weight_copy` (and `rollout_host_copy`) from a config before the master's halves: one
    line, naming the key and what replaced it; nothing is written."""
    from megatrain.config import RETIRED

    run = make_run(tmp_path) | dict(output_dir=str(tmp_path / "out"), host_weight_copy=True)
    rc, _, err = run_cli(capsys, "train", write_yaml(tmp_path / "run.yaml", run))
    [line] = err.splitlines()
    assert (
        rc == 2
        and line
        == f"megatrain: error: config key 'host_weight_copy' is retired: {RETIRED['host_weight_copy']}"
    )
    assert "bf16 half is the copy now" in line and not (tmp_path / "out").exists()
    with pytest.raises(
        ConfigError, match=r"^config key 'host_weight_copy' is retired: .*; config key 'rollout_host_copy'"
    ):
        TrainConfig.from_dict({"model_config": "m", "host_weight_copy": False, "rollout_host_copy": "auto"})

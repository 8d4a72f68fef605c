"""Reading the YAML config: YAML's own traps (booleans, duplicate keys) and errors that name
the file, line and column."""

from __future__ import annotations

import pytest
from test_checkpoint import make_run, one_thread  # noqa: F401 (fixture)
from test_cli import run_cli

from megatrain.config import TrainConfig
from megatrain.errors import ConfigError


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

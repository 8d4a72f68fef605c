"""`profile_steps`: the named steps traced to output_dir/profile/, the training unchanged."""

from __future__ import annotations

import gzip
import json

import pytest
from test_checkpoint import assert_bitwise, make_run, metrics, tensors

from megatrain.config import TrainConfig
from megatrain.errors import ConfigError
from megatrain.trainer import train


def test_profiled_steps_write_a_trace_and_a_table_and_train_as_unprofiled(tmp_path):
    base = make_run(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    train(TrainConfig(**base, output_dir=str(a), max_steps=3, profile_steps=2))
    train(TrainConfig(**base, output_dir=str(b), max_steps=3))
    assert sorted(p.name for p in (a / "profile").iterdir()) == ["step-2.json.gz", "step-2.txt"]
    assert not (b / "profile").exists()
    events = json.loads(gzip.decompress((a / "profile" / "step-2.json.gz").read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    table = (a / "profile" / "step-2.txt").read_text()
    assert "aten::mm" in names and "aten::mm" in table  # the layers' matmuls ran under it
    assert_bitwise(tensors(a / "final"), tensors(b / "final"))
    assert [r["loss"] for r in metrics(a)] == [r["loss"] for r in metrics(b)]


def test_a_profile_file_there_already_is_kept(tmp_path):
    base = make_run(tmp_path)
    a = tmp_path / "a"
    (a / "profile").mkdir(parents=True)
    (a / "profile" / "step-1.txt").write_text("mine")
    train(TrainConfig(**base, output_dir=str(a), max_steps=1, profile_steps=1))
    assert (a / "profile" / "step-1.txt").read_text() == "mine"
    assert "aten::mm" in (a / "profile" / "step-1.1.txt").read_text()
    assert (a / "profile" / "step-1.1.json.gz").is_file()


@pytest.mark.parametrize("value", [0, -1, [2, "x"], True, 1.5])
def test_bad_profile_steps_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="profile_steps"):
        TrainConfig(model_config="m", profile_steps=value)


def test_profile_steps_read_one_step_or_several():
    assert TrainConfig(model_config="m", profile_steps=4).profile_steps == [4]
    assert TrainConfig(model_config="m", profile_steps=[5, 2, 5]).profile_steps == [2, 5]
    assert TrainConfig(model_config="m").profile_steps == []

"""grpo's reward functions: a module that cannot load, and a built-in whose columns the data
lacks, are one line each before step one, with nothing written."""

from __future__ import annotations

import json
import re

import pytest
from test_grpo import run, setup  # noqa: F401, F811 (fixture)

from megatrain.errors import ConfigError, DataError
from megatrain.rl import rewards


@pytest.mark.parametrize(
    "source,line,what",
    [
        ("def score(completions, **_):\n    return [1.0 for c in completions\n", 2, "'[' was never closed"),
        ("import math\n\ndef score(completions, **_):\n  return []\n   x = 1\n", 5, "unexpected indent"),
        ("import math\n\nVALUE = 1 / 0\n", 3, "ZeroDivisionError: division by zero"),
    ],
)
def test_a_reward_module_that_cannot_load_is_one_line_naming_its_line(
    tmp_path, monkeypatch, source, line, what
):
    (tmp_path / "broken_rewards.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        rewards.load(["broken_rewards:score"])
    message = str(e.value)
    assert message.startswith(
        f"reward_funcs: cannot load 'broken_rewards:score': {tmp_path / 'broken_rewards.py'}:{line}: "
    )
    assert what in message and "\n" not in message


def test_a_builtin_without_its_column_is_refused_before_anything_is_written(setup):  # noqa: F811
    """exact_match on prompts without an answer or solution column: one line naming the first such
    record, from the training data or the eval data, before step one and before output_dir."""
    tmp_path, _ = setup
    bare = tmp_path / "bare.jsonl"
    bare.write_text(
        json.dumps({"prompt": "Say 1 once:", "answer": "1"})
        + "\n"
        + json.dumps({"prompt": "Hi", "id": 3})
        + "\n"
    )
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(bare))}:2: reward_funcs exact_match needs an 'answer' or 'solution' column \(its columns: id\)$",
    ):
        run(tmp_path, dataset=str(bare))
    with pytest.raises(DataError, match=rf"^{re.escape(str(bare))}:2: reward_funcs exact_match needs"):
        run(tmp_path, eval_dataset=str(bare))
    assert not (tmp_path / "out").exists()
    records, _, _ = run(
        tmp_path, dataset=str(bare), reward_funcs=["length"], reward_weights=None, max_steps=1
    )
    assert [r["step"] for r in records] == [1]  # the other built-ins read no column

"""grpo's reward functions: a module that cannot load, and a built-in whose columns the data
lacks, are one line each before step one, with nothing written."""

from __future__ import annotations

import pytest

from megatrain.errors import ConfigError
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

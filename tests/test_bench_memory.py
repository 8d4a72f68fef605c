"""bench/memory.py's runs that ask the plan for a limit: `layers=max` (the deepest model of a
shape the host holds) resolves to a depth the plan accepts, and one layer more is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatrain.placement import Machine, PlanError, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import memory  # noqa: E402

GiB = 2**30


@pytest.mark.parametrize("host_gib", [120, 240])
def test_largest_model_is_the_deepest_the_plan_accepts(host_gib):
    machine = Machine("cuda", 139 * GiB, host_gib * GiB)
    run = memory.parse(f"B18:16384:layers=max,max_host_memory={host_gib}GiB")
    largest = memory.at_largest(run, machine, None)
    depth = int(largest["layers"])
    assert depth == largest["largest_layers"] > 1
    accepted = plan(
        memory.shape_of(largest)[0], memory.batch_of(largest), machine, memory.choices_of(largest)
    )
    assert accepted.host_total <= host_gib * GiB
    more = memory.at_largest({**run, "layers_extra": "1"}, machine, None)
    assert int(more["layers"]) == depth + 1
    with pytest.raises(PlanError, match="host memory"):
        plan(memory.shape_of(more)[0], memory.batch_of(more), machine, memory.choices_of(more))

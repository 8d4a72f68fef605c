"""The embedding's rows (`Plan.embed_rows`, engine/rows.py): the table stepped in host memory and
fetched as the rows a step looks up. On the CPU: the rows computed ahead equal the table's own
update bit for bit (either host kernel, a clip or none, rows with no gradient among them); the
engine's forward on the remapped rows trains as the whole table does; the plan takes them where
the cost model puts them faster, counts their buffers and refuses them where they cannot be. The
overlapped CUDA schedule is tested in test_gpu.py."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from test_placement import B8, STEP16K, cuda, llama

from megatrain.config import TrainConfig
from megatrain.data.batch import MicroBatch
from megatrain.engine import clipadam
from megatrain.engine.optim import AdamWConfig, HostAdamW
from megatrain.errors import ConfigError
from megatrain.host.state import HostState, build_units
from megatrain.io.weights import init_random
from megatrain.models.config import ModelConfig
from megatrain.parallel.layout import Layout
from megatrain.planning import placement, planspec
from megatrain.planning.placement import Choices
from megatrain.planning.probe import formula_layer_memory
from megatrain.runtime import build_model

ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TIED = ModelConfig.from_hf(tiny_config("llama", True, hidden_size=4096, num_hidden_layers=4,
                                         num_attention_heads=32, num_key_value_heads=8,
                                         intermediate_size=14336, vocab_size=128256))  # fmt: skip


def _cfg(tied=False, **kw) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    return ModelConfig.from_hf(tiny_config("llama", tied, **{**base, **kw}))


# ---------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("fused", [False, True])  # torch's kernel; clipadam's (a clip that fires)
def test_rows_computed_ahead_equal_the_tables_update_bitwise(fused, monkeypatch):
    """`step_rows` on a sorted subset of rows, some with no gradient this step, gives the weights
    the whole table's `step_held` writes for them, and leaves the state as it was."""
    monkeypatch.setattr(clipadam, "MIN_PER_THREAD", 64)
    monkeypatch.setattr(clipadam, "BLOCK", 64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = _cfg()
        state = HostState(build_units(cfg))
        init_random(state, cfg, seed=0)
        unit = state.units[0]
        opt = HostAdamW(state, ADAMW)
        opt.fused_clip = fused
        assert not fused or clipadam.load()[0] is not None, clipadam.load()[1]  # its rows checked there
        V, H = unit.params[0].shape
        g = torch.Generator().manual_seed(1)
        for step, coef in enumerate((0.37, 1.0, None, 0.6), start=1):
            grad = torch.zeros(unit.numel)
            touched = torch.randperm(V, generator=g)[: V // 2].sort().values  # this step's tokens
            grad.view(V, H)[touched] = torch.randn(len(touched), H, generator=g)
            rows = torch.randperm(V, generator=g)[: V // 3].sort().values  # the next pass's
            assert (~torch.isin(rows, touched)).any() and torch.isin(rows, touched).any()
            c = None if coef is None else torch.tensor(coef)
            before_state = [state.flat(unit, w).clone() for w in state.buffers]
            # from the table's gradient, and from the step's rows alone (the others zero)
            pos = torch.searchsorted(touched, rows).clamp(max=len(touched) - 1)
            index = torch.where(touched[pos] == rows, pos, -1)
            outs = [torch.empty(len(rows), H, dtype=torch.bfloat16) for _ in range(2)]
            opt.step_rows(unit, rows, grad.view(V, H), c, 1e-2, step, outs[0])
            opt.step_rows(unit, rows, grad.view(V, H)[touched].contiguous(), c, 1e-2, step, outs[1], index)
            for w, was in zip(state.buffers, before_state):
                assert torch.equal(state.flat(unit, w), was)  # nothing written yet
            opt.step_held(unit, grad, c, 1e-2, step, 1024)
            table = state.flat(unit, "hi").view(V, H)  # the table's bf16 halves, as a fetch reads them
            assert not torch.equal(table.index_select(0, rows), before_state[0].view(V, H)[rows])
            for out in outs:
                assert torch.equal(out, table.index_select(0, rows)), (fused, step)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------- the engine
def _train(plan_rows: bool, steps: int = 3):
    cfg = _cfg()
    plan = placement.plan(cfg, planspec.Batch(64, 2, 32, 4, True), placement.Machine("cpu"))
    m = build_model(cfg, seed=3, adamw=ADAMW, plan=dataclasses.replace(plan, embed_rows=plan_rows))
    losses, g = [], torch.Generator().manual_seed(7)
    for _ in range(steps):
        mbs = [
            MicroBatch(ids, ids) for ids in (2 * torch.randint(0, 40, (2, 32), generator=g) for _ in range(2))
        ]
        loss, _ = m.engine.forward_backward(mbs)
        _, coef = m.engine.clip_grad_norm(0.5)
        m.engine.step(1e-2, coef)
        losses.append(loss.item())
    ids = torch.randint(0, 96, (1, 32), generator=g)
    logits = m.engine.logits(MicroBatch(ids, ids))
    out = losses, m.state.master(), logits
    m.close()
    return out


def test_the_forward_on_the_looked_up_rows_trains_as_the_whole_table():
    """Tokens drawn from 40 even rows of 96: the forward sees only those, remapped, and the
    losses, every weight after three steps and the logits after them equal training that
    fetches the whole table."""
    l0, w0, z0 = _train(False)
    l1, w1, z1 = _train(True)
    assert l0 == l1
    assert torch.equal(w0, w1) and torch.equal(z0, z1)


def test_a_tied_table_is_not_fetched_as_rows():
    cfg = _cfg(tied=True)
    plan = placement.plan(cfg, planspec.Batch(64, 2, 32, 4, True), placement.Machine("cpu"))
    with pytest.raises(ValueError, match="tied"):
        build_model(cfg, plan=dataclasses.replace(plan, embed_rows=True))


# ---------------------------------------------------------------------------- the plan
def _shape(cfg):
    return planspec.model_shape(cfg, formula_layer_memory(cfg, STEP16K.compute_bytes))


RUN_1032 = Path(__file__).resolve().parents[1] / "bench/results/2026-11-28_1032_x2-B16k-auto-rows-ds16.json"


def _recorded_plan(**choices):
    """The plan of the recorded 8B run with the rows (two-H200 machine, 16k tokens, all state in
    host memory; its machine and measured layer as the run had them), under `choices`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import replay
    from memory import batch_of, shape_of

    from megatrain.planning.probe import LayerMemory

    (r,) = [r for r in replay.runs_in(str(RUN_1032)) if r["system"] == "megatrain-host"]
    run = replay.run_of(r)
    c = Choices(gpu_state="off", gpu_step_units=None, **choices)
    with replay.as_recorded(r):  # with the bytes its fetches moved
        return r, placement.plan(
            shape_of(run)[0], batch_of(run), replay.machine_of(r), c, LayerMemory(**r["layer_mem"])
        )


def test_auto_fetches_the_rows_of_8b_at_16k_where_the_cost_model_puts_them_faster():
    """8.03B, 16k tokens, all state in host memory on the two-H200 machine, with the bytes the
    recorded run's fetches moved (its bf16 copy of the weights): `auto` takes the rows and steps
    the units after the embedding on the GPU, as the run did (25 units; its plan also costed the
    copy's cast in the host's pass, which the master's halves have none of, so the count is not
    compared); the step ROWS_GAIN faster than the same search without them; the host holds the
    table's gradient and the rows' buffers."""
    r, on = _recorded_plan()
    _, off = _recorded_plan(embedding_rows=False)
    assert r["plan"]["embed_rows"] and r["plan"]["gpu_stepped_units"] == 25
    assert on.embed_rows and on.gpu_stepped_units > 0
    assert not off.embed_rows and off.gpu_stepped_units > 0
    assert on.stepped.start == 1 and on.gpu_grad_lead >= 1
    assert on.step_time_s < (1 - placement.ROWS_GAIN) * off.step_time_s
    assert any(n.startswith("embedding: stepped in host memory") for n in on.notes)
    s = _shape(B8)
    rows = planspec.looked_up_rows(s, STEP16K)
    assert rows == 16384
    # its host buffers: the table's gradient, the rows' page-locked ways out and in with their
    # headroom
    room = planspec.ROW_HEADROOM * 4096 * rows  # elements
    assert on.host["embedding gradient (fp32, the step's rows)"] == 4 * s.units[0]
    assert on.host["embedding rows (page-locked)"] == int(room) * (4 + 2)


def test_auto_takes_the_rows_only_where_they_save_rows_gain(monkeypatch):
    _, on = _recorded_plan()
    _, off = _recorded_plan(embedding_rows=False)
    gain = 1 - on.step_time_s / off.step_time_s
    monkeypatch.setattr(placement, "ROWS_GAIN", gain + 0.001)
    _, held = _recorded_plan()
    assert on.embed_rows and not held.embed_rows
    assert (held.gpu_stepped_units, held.step_time_s) == (off.gpu_stepped_units, off.step_time_s)


def test_rows_are_refused_where_they_cannot_be():
    s = _shape(B8)
    m = cuda(139, 240)
    assert placement.rows_refused(s, m) == ""
    assert "tied" in placement.rows_refused(_shape(TIED), m)
    assert "multiple of 8" in placement.rows_refused(_shape(llama(4100, 4, 25, 5, 14336)), m)
    assert "one process" in placement.rows_refused(s, dataclasses.replace(m, world=Layout(ranks=2)))
    assert "resident" in placement.rows_refused(s, m, resident=1)
    assert "GPU" in placement.rows_refused(s, placement.Machine("cpu"))
    with pytest.raises(ConfigError, match="embedding_rows: not with tied"):
        placement.plan(TIED, STEP16K, m, Choices(embedding_rows=True))
    # asked for with a count of the user's: the rows, and the count after the embedding
    p = placement.plan(B8, STEP16K, m, Choices(gpu_state="off", gpu_step_units=3, embedding_rows=True))
    assert p.embed_rows and list(p.stepped) == [1, 2, 3]
    assert not placement.plan(B8, STEP16K, m, Choices(gpu_state="off", gpu_step_units=3)).embed_rows


def test_the_config_key_takes_true_false_or_auto():
    base = {"model_config": "m"}
    assert TrainConfig.from_dict({**base, "embedding_rows": "auto"}).embedding_rows is None
    assert TrainConfig.from_dict({**base, "embedding_rows": False}).embedding_rows is False
    with pytest.raises(ConfigError, match="^embedding_rows"):
        TrainConfig.from_dict({**base, "embedding_rows": "sometimes"})


def test_the_bench_reports_the_rows_computed_ahead_where_the_plan_fetched_them():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import _report

    assert _report._rows_ahead({"plan": {"embed_rows": False}, "rows_ahead_s": 0.5}) == ""
    line = _report._rows_ahead({"plan": {"embed_rows": True}, "rows_ahead_s": 0.0123})
    assert line == "the embedding's rows computed ahead in 12.3 ms a step; "
    r = {
        "plan": {"embed_rows": True},
        "rows_ahead_s": 0.0123,
        "rows_wait_s": 0.0456,
        "rows_copy_wait_s": 0.0078,
    }
    assert _report._rows_ahead(r) == (
        "the embedding's rows computed ahead in 12.3 ms a step after 45.6 ms waiting for them to be "
        "posted and 7.8 ms for the gradient's rows to land; "
    )

"""Sharded traffic and a host state partitioned over machines (layout.py, processgroup.py,
partition.py) on the CPU with gloo: each equals one process with the same global batch, each
simulated machine holds only its part of the state, and checkpoints move between the designs and
world sizes exactly."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from test_checkpoint import make_run, metrics, tensors, write_yaml
from test_distributed import assert_close_weights, assert_same_run, launch

from megatrain import plan as planning
from megatrain import planreport
from megatrain.config import TrainConfig
from megatrain.errors import CheckpointError, ConfigError, OutputError
from megatrain.host.state import HostState, build_units
from megatrain.io.checkpoint import open_checkpoint
from megatrain.io.partition import check_shared
from megatrain.io.weights import export_model, load_hf_weights
from megatrain.models.config import ModelConfig
from megatrain.parallel.distributed import world_layout
from megatrain.parallel.layout import Layout, piece_len
from megatrain.parallel.processgroup import start
from megatrain.planning import footprint
from megatrain.planning.placement import Machine
from megatrain.trainer import train

STEPS = 3


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """One process with 4 micro-batches a step, 3 steps with clipping active, a checkpoint after
    every step, evaluated at the end on 10 samples (3 chunks of 2 x 2 in a world of 2: one rank
    has a chunk fewer than the other)."""
    tmp = tmp_path_factory.mktemp("sharded")
    base = make_run(tmp)
    lines = (tmp / "data.jsonl").read_text().splitlines()
    (tmp / "eval.jsonl").write_text("\n".join(lines[:10]) + "\n")
    base.update(max_steps=STEPS, save_steps=1, gradient_accumulation_steps=4)
    base.update(eval_dataset=str(tmp / "eval.jsonl"), eval_steps=STEPS)
    torch.set_num_threads(1)
    train(TrainConfig(**base, output_dir=str(tmp / "one")))
    return tmp, base, write_yaml(tmp / "run.yaml", base)


def launched(cfg_path: Path, out: Path, *overrides: str) -> None:
    proc = launch(cfg_path, *overrides, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr


def same_as_one(tmp: Path, out: Path, steps: list[int]) -> None:
    """The run in `out` trained as the one process did: losses, norms, eval, weights, moments."""
    one = tmp / "one"
    assert_same_run(metrics(out), metrics(one), steps)
    (got,), (want,) = ([r for r in metrics(d) if "eval_loss" in r] for d in (out, one))
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5, abs=0)
    assert_close_weights(tensors(out / "final"), tensors(one / "final"))  # one Hugging Face model
    assert_close_weights(whole(out / "checkpoint-3"), whole(one / "checkpoint-3"))


def whole(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights and moments, read into one whole host state as a resume does."""
    cfg = ModelConfig.from_json(path)
    state = HostState(build_units(cfg))
    load_hf_weights(state, path, cfg, progress=False)
    open_checkpoint(path, cfg).load_moments(state)
    return {
        "master": state.master(),
        "exp_avg": state.exp_avg.clone(),
        "exp_avg_sq": state.exp_avg_sq.clone(),
    }


@pytest.mark.slow
def test_sharded_traffic_equals_one_process(ref):
    """Two processes, each copying half of every unit and all-gathering the rest, gradients
    reduce-scattered (gloo: all-reduce and slice), the clip norm summed from the halves."""
    tmp, _, cfg_path = ref
    out = tmp / "sharded"
    launched(cfg_path, out, "gradient_accumulation_steps=2", "ddp_traffic=sharded")
    assert max(r.get("grad_norm", 0) for r in metrics(out)) > 1.0  # clipping was active
    same_as_one(tmp, out, list(range(1, STEPS + 1)))
    assert (out / "checkpoint-3" / "model.safetensors").is_file()  # one machine: the plain format


@pytest.fixture(scope="module")
def parts(ref):
    """Two simulated machines of one process each: the state partitioned, a checkpoint a step."""
    tmp, _, cfg_path = ref
    out = tmp / "parts"
    launched(cfg_path, out, "gradient_accumulation_steps=2", "nproc_per_node=1", "nnodes=2")
    return out


@pytest.mark.slow
def test_partitioned_state_equals_one_process(ref, parts):
    tmp = ref[0]
    same_as_one(tmp, parts, list(range(1, STEPS + 1)))
    files = sorted(p.name for p in (parts / "checkpoint-3").glob("*.safetensors"))
    assert files == [
        f"{k}.machine-0000{m}-of-00002.safetensors" for k in ("model", "optimizer") for m in (1, 2)
    ]
    # `megatrain export` makes one Hugging Face model of the machines' segments.
    exported, _ = export_model(parts / "checkpoint-3", tmp / "exported", torch.float32, progress=False)
    assert_close_weights(tensors(exported), tensors(tmp / "one" / "final"))  # final/: its weights


@pytest.mark.slow
def test_each_machine_holds_only_its_part(ref, parts):
    units = build_units(ModelConfig.from_json(ref[1]["model_config"]))
    layout = Layout(ranks=2, machines=2, sharded=True)
    held = json.loads((parts / "plan.json").read_text())["host_state_bytes_per_machine"]
    assert held == [12 * layout.held((u.numel for u in units), m) for m in (0, 1)]
    assert sum(held) == 12 * sum(u.numel for u in units)  # the parts make the whole, once
    assert max(held) < 0.6 * sum(held)
    # The plan counted this machine's part, not the whole state.
    plan = json.loads((parts / "plan.json").read_text())["plan"]
    assert plan["host"]["fp32 weights + AdamW moments"] == held[0]


@pytest.mark.slow
def test_checkpoints_move_between_designs_and_world_sizes(ref, parts):
    tmp, base, cfg_path = ref
    one = tmp / "one"
    # Partitioned over 2 machines -> one process (the plain format's world).
    a = tmp / "parts_then_one"
    train(TrainConfig(**base, output_dir=str(a), resume_from_checkpoint=str(parts / "checkpoint-1")))
    assert_same_run(metrics(a), metrics(one), [2, 3])
    assert_close_weights(whole(a / "checkpoint-3"), whole(one / "checkpoint-3"))
    # One process (plain format) -> 2 machines x 2 processes, partitioned.
    b = tmp / "one_then_parts"
    resume = f"resume_from_checkpoint={one / 'checkpoint-1'}"
    launched(cfg_path, b, "gradient_accumulation_steps=1", "nnodes=2", resume)
    assert_same_run(metrics(b), metrics(one), [2, 3])
    assert_close_weights(whole(b / "checkpoint-3"), whole(one / "checkpoint-3"))
    assert len(json.loads((b / "plan.json").read_text())["host_state_bytes_per_machine"]) == 2


@pytest.mark.slow
def test_a_missing_segment_is_refused_by_name(ref, parts, tmp_path):
    src = parts / "checkpoint-1"
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in src.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    key = next(k for k in index["weight_map"] if k.startswith("model.layers.1.mlp.up_proj.weight["))
    del index["weight_map"][key]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"segment.*model\.layers\.1\.mlp\.up_proj\.weight"):
        open_checkpoint(bad, ModelConfig.from_json(bad))


class SecondMachine:
    """Rank 1 of a world of two machines, whose `output_dir` is another file system: it sees its
    own plan.json, not the one rank 0 wrote."""

    rank, is_main, holds_state = 1, False, True
    layout = Layout(2, 2, sharded=True)

    def __init__(self, crc_of_rank_0: int):
        self.want = crc_of_rank_0

    def first(self, obj):
        return self.want

    def each(self, obj):
        return [self.want, obj]


def test_an_output_dir_the_machines_do_not_share_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_text("{}")  # this machine's own file of that name
    with pytest.raises(OutputError, match="rank 1 does not see it as rank 0 wrote it;.*share"):
        check_shared(SecondMachine(crc_of_rank_0=12345), tmp_path / "plan.json")
    check_shared(SecondMachine(zlib.crc32(b"{}")), tmp_path / "plan.json")  # the same file: fine


# ---------------------------------------------------------------------------- the layout
def test_spans_pieces_and_parts_cut_units_alike():
    for numel, ranks, machines in [(1024 * 7, 2, 2), (1024 * 9, 4, 2), (1024, 4, 4), (1024 * 8, 4, 1)]:
        lay = Layout(ranks, machines, sharded=True)
        spans = [lay.span(numel, r) for r in range(ranks)]
        step = piece_len(numel, ranks)
        assert all(lo == min(r * step, numel) and hi - lo <= step for r, (lo, hi) in enumerate(spans))
        assert spans[0][0] == 0 and spans[-1][1] == numel
        assert lay.padded(numel) == ranks * step >= numel
        parts = [lay.part(numel, m) for m in range(machines)]
        per = ranks // machines
        assert parts == [(spans[m * per][0], spans[(m + 1) * per - 1][1]) for m in range(machines)]
        assert sum(hi - lo for lo, hi in parts) == numel
        assert [lay.piece(numel, r) for r in range(ranks)] == spans
    assert Layout(2).piece(4096, 1) == (0, 4096) and Layout(2).padded(4096) == 4096  # plain


def test_bad_combinations_are_one_line(monkeypatch, tmp_path):
    base = make_run(tmp_path)
    with pytest.raises(ConfigError, match="ddp_traffic: plain .* partitioned over 2 machines"):
        TrainConfig(**base, nnodes=2, ddp_traffic="plain")
    with pytest.raises(ConfigError, match="ddp_traffic: must be one of auto, plain, sharded"):
        TrainConfig(**base, ddp_traffic="zero3")
    with pytest.raises(ConfigError, match="nnodes: must be >= 1"):
        TrainConfig(**base, nnodes=0)
    with pytest.raises(ConfigError, match="nnodes: 2 machines need several processes"):
        start(torch.device("cpu"), 10, "auto", 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="nnodes: 1, but the world is 4 processes on 2 machine"):
        world_layout("auto", 1)
    with pytest.raises(ConfigError, match="ddp_traffic: plain"):
        world_layout("plain")
    assert world_layout() == Layout(4, 2, sharded=True)  # across machines: partitioned, sharded
    assert world_layout("auto", 4) == Layout(4, 4, sharded=True)  # simulated within them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="same number of processes"):
        world_layout()


def test_the_preflight_checks_one_machines_part(tmp_path):
    """A host that holds half the state but not all of it: refused on one machine, accepted as
    one of two machines, and `megatrain plan` reports the part."""
    base = make_run(tmp_path, hidden_size=256, intermediate_size=512, num_hidden_layers=8)
    base["gradient_placement"] = "two_pass"  # no gradients kept: the state is what does not fit
    model_cfg = ModelConfig.from_json(base["model_config"])
    state = 12 * sum(u.numel for u in build_units(model_cfg))
    roomy = TrainConfig(**base, max_host_memory="1TB", device="cpu")
    need = planning.check(model_cfg, roomy, planning.machine_of(roomy, "cpu"), 4).plan.host_total
    usable = need - state // 4  # half the state less would fit
    budget = dict(max_host_memory=int(usable / (1 - footprint.HOST_RESERVE)))  # the plan keeps a reserve
    one = TrainConfig(**base, **budget, device="cpu")
    two = TrainConfig(**base, **budget, device="cpu", nnodes=2)
    machine = planning.machine_of(one, "cpu")
    assert not planning.check(model_cfg, one, machine, 4).fits
    result = planning.check(model_cfg, two, planning.machine_of(two, "cpu"), 4)
    assert result.fits
    assert result.plan.host["fp32 weights + AdamW moments"] < 0.55 * state
    report = planreport.report(model_cfg, result, "cpu", "float32", two)
    assert "world: 2 processes on 2 machine(s), sharded traffic, host state partitioned" in report
    assert isinstance(result.machine, Machine) and result.machine.world.machines == 2


# ---------------------------------------------------------------------------- on GPUs
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("design", ["ddp_traffic=sharded", "nnodes=2"])
def test_two_gpus_sharded_and_partitioned_equal_one(tmp_path, design):
    """NCCL all-gather and reduce-scatter, the streaming transport copying each rank's span, a
    partitioned state on two simulated machines: against one GPU with the same global batch."""
    base = make_run(tmp_path)
    base.update(device="cuda", compute_dtype="float32", torch_compile=False)
    base.update(max_steps=STEPS, save_steps=1, gradient_accumulation_steps=4)
    train(TrainConfig(**base, output_dir=str(tmp_path / "one")))
    overrides = ["gradient_accumulation_steps=2", design] + (
        ["nproc_per_node=1"] if design == "nnodes=2" else []
    )
    launched(write_yaml(tmp_path / "run.yaml", base), tmp_path / "two", *overrides)
    assert_same_run(metrics(tmp_path / "two"), metrics(tmp_path / "one"), list(range(1, STEPS + 1)))
    assert_close_weights(tensors(tmp_path / "two" / "final"), tensors(tmp_path / "one" / "final"))
    assert_close_weights(whole(tmp_path / "two" / "checkpoint-3"), whole(tmp_path / "one" / "checkpoint-3"))

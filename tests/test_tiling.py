"""The tiled MLP and long context: a layer whose MLP runs over sequence tiles holds one tile's
intermediates at a time and gives the untiled layer's numbers (eager, compiled, bf16); the plan
tiles only where the untiled layer does not fit, and `megatrain plan` names the longest context
that the training preflight accepts; the tiled layer is measured only where a plan reads it, and
that plan is the plan of the layer measured both ways."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import write_yaml
from test_cli import run_cli
from test_placement import B8, cuda
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain.models.config import ModelConfig
from megatrain.models.decoder import DecoderLayer, rope_cos_sin, rope_inv_freq
from megatrain.planning import placement
from megatrain.planning.placement import Batch, Choices, Plan, PlanError
from megatrain.planning.probe import LayerMemory, LayerProbe, formula_layer_memory

GiB = 2**30
CFG = ModelConfig.from_hf(tiny_config("llama", hidden_size=64, intermediate_size=112, mlp_bias=True))
FFN = 112  # no other dimension of the layer or the batch has this size
TOKENS = 2 * 256  # two sequences of 256


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = DecoderLayer(CFG)
    params = {n: (torch.randn(p.shape, generator=g) * 0.1).to(dtype) for n, p in shapes.named_parameters()}
    x = torch.randn(2, 256, CFG.hidden_size, generator=g).to(dtype)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    inv, scale = rope_inv_freq(CFG)
    cos, sin = rope_cos_sin(inv, scale, torch.arange(256).expand(2, 256), dtype)
    return params, x, dy, (cos, sin)


def _grads(tile: int, dtype=torch.float32, call=None):
    """As the engine's backward sweep: the layer recomputed from its input with its parameters as
    leaves, differentiated with torch.autograd.grad. Returns (output, [dx, *parameter grads])."""
    params, x, dy, rope = _inputs(dtype)
    with torch.device("meta"):
        layer = DecoderLayer(CFG, mlp_tile_tokens=tile)
    leaves = {n: p.requires_grad_() for n, p in params.items()}
    x.requires_grad_()

    def layer_call(p, x, cos, sin):
        return functional_call(layer, p, (x, (cos, sin), None))

    y = (call(layer_call) if call else layer_call)(leaves, x, *rope)
    return y.detach(), torch.autograd.grad(y, [x, *leaves.values()], dy)


def _ffn_sized(t: torch.Tensor) -> int:
    """Elements of a tokens x ffn tensor (an MLP intermediate, whole or a tile's), else 0."""
    return t.numel() if t.dim() >= 2 and t.shape[-1] == FFN and t.shape[0] != CFG.hidden_size else 0


class _LargestFfnTensor(TorchDispatchMode):
    """The most elements of any tensor an op produces whose last dimension is the FFN width."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, _ffn_sized(t))
        return out


def test_tiled_layer_holds_one_tiles_intermediates_and_gives_the_untiled_numbers():
    """Forward and backward with tiles of 48 tokens: no tensor of tokens x ffn is ever made or saved,
    only one tile's; output and every gradient equal the untiled layer's within fp32 rounding."""
    results = {}
    for tile in (0, 48):
        saved = []

        def pack(t, saved=saved):
            saved.append(_ffn_sized(t))
            return t

        with _LargestFfnTensor() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[tile] = _grads(tile)
        results[tile] += (mode.largest, max(saved))
    (y0, g0, largest0, saved0), (y1, g1, largest1, saved1) = results[0], results[48]
    assert largest0 >= TOKENS * FFN and saved0 >= TOKENS * FFN  # untiled: the whole sequence's
    assert largest1 <= 48 * FFN and saved1 <= 48 * FFN  # tiled: one tile's (saved while recomputed)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    assert len(g1) == len(g0) == 1 + len(list(DecoderLayer(CFG).parameters()))
    for a, b in zip(g1, g0):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tiled_layer_under_torch_compile():
    """Compiled (the engine compiles its layer call on CUDA): the tile loop runs eagerly inside the
    compiled layer and the gradients are the eager untiled layer's. (`aot_eager` traces what
    inductor would; inductor itself runs in the GPU tests.)"""
    torch._dynamo.reset()
    _, ref = _grads(0)
    _, got = _grads(48, call=lambda fn: torch.compile(fn, backend="aot_eager"))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tiled_bf16_weight_gradients_sum_in_fp32():
    """In bf16 the tiled weight gradients are as close to the fp32 ones as the untiled layer's
    (each tile's product summed in fp32, rounded once), not one rounding per tile worse."""
    _, ref = _grads(0, torch.float32)
    err = {}
    for tile in (0, 4):  # 128 tiles: summed in bf16, the error would be 1.9x the untiled one
        _, g = _grads(tile, torch.bfloat16)
        err[tile] = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(g[1:], ref[1:]))
    assert err[4] < 1.5 * err[0] + 1e-3, err


# ---------------------------------------------------------------------------- the plan
SHORT = Batch(micro_batch_tokens=16384, micro_batches=1, seq_len=16384, compute_bytes=2, clip=True)
LONG = Batch(micro_batch_tokens=327680, micro_batches=1, seq_len=327680, compute_bytes=2, clip=True)


def test_plan_tiles_only_where_the_untiled_layer_does_not_fit():
    short = placement.plan(B8, SHORT, cuda(139, 256))
    assert short.mlp_tile_tokens == 0 and not any("MLP tiled" in n for n in short.notes)
    machine = cuda(80, 256)
    with pytest.raises(PlanError, match="GPU memory: one layer's working set"):
        placement.plan(B8, LONG, machine, Choices(mlp_tile_tokens=0))
    tiled = placement.plan(B8, LONG, machine)
    t = tiled.mlp_tile_tokens
    assert t >= placement.MIN_MLP_TILE and t & (t - 1) == 0 and t < LONG.micro_batch_tokens
    assert tiled.gpu_peak <= placement.usable_gpu(machine)
    assert any(f"MLP tiled over the sequence, {t:,} tokens per tile" in n for n in tiled.notes)
    # the largest tile that fits, up to the cap (longer tiles run no faster)
    assert t == placement.MAX_MLP_TILE
    squeezed = cuda(75, 256)  # a GPU where the capped tile does not fit, a smaller one does
    small = placement.plan(B8, LONG, squeezed).mlp_tile_tokens
    assert placement.MIN_MLP_TILE <= small < t
    with pytest.raises(PlanError):
        placement.plan(B8, LONG, squeezed, Choices(mlp_tile_tokens=2 * small))


# One layer as a device would measure it (the formula's, with a rate of its own), and untiled alone.
MEASURED = replace(formula_layer_memory(B8, 2), flops_per_s=6.1e14)
UNTILED = LayerMemory(*(getattr(MEASURED, k) for k in ("graph_per_token", "backward_per_token",
                      "backward_fixed", "forward_per_token", "flops_per_s")))  # fmt: skip


def _probe() -> tuple[LayerProbe, list[int]]:
    """A LayerProbe of MEASURED, untiled until its tiled layer is asked for (counted)."""
    calls: list[int] = []
    return LayerProbe(UNTILED, lambda: calls.append(1) or MEASURED), calls


def _planned(batch, machine, choices, layer) -> tuple[Plan | None, str]:
    """placement.plan's plan and notes, or its PlanError's message."""
    try:
        p = placement.plan(B8, batch, machine, choices, layer)
    except PlanError as e:
        return None, str(e)
    return p, "\n".join(p.notes)


@pytest.mark.parametrize(
    "batch, machine, choices",
    [
        (SHORT, cuda(139, 256), Choices()),
        (STEP16K := Batch(16384, 4, 4096, 2, True, rows=4), cuda(80, 400), Choices()),
        (SHORT, cuda(40, 256), Choices(gpu_state="off")),
        (Batch(16384, 1, 16384, 2, clip=False), cuda(139, 256), Choices(gpu_step_units=None)),
        (LONG, cuda(80, 256), Choices(mlp_tile_tokens=0)),  # refused untiled, as measured both ways
    ],
)
def test_a_plan_that_stops_untiled_never_measures_the_tiled_layer(batch, machine, choices):
    probe, calls = _probe()
    want = _planned(batch, machine, choices, MEASURED)
    assert _planned(batch, machine, choices, probe) == want and calls == []
    if want[0] is not None:
        assert want[0].grad_mode != "two_pass" and want[0].mlp_tile_tokens == 0


@pytest.mark.parametrize(
    "batch, machine, choices",
    [
        (LONG, cuda(80, 256), Choices()),  # untiled does not fit: tiled
        (LONG, cuda(75, 256), Choices()),  # nor the longest tile
        (SHORT, cuda(139, 256), Choices(mlp_tile_tokens=1024)),  # the user's tiles
        (LONG, cuda(75, 256), Choices(mlp_tile_tokens=2 * placement.MAX_MLP_TILE)),  # ... refused
        (SHORT, cuda(40, 256), Choices(gradient_placement="two_pass")),  # two passes untiled
    ],
)
def test_a_plan_that_needs_the_tiled_layer_measures_it_once_and_is_the_measured_plan(batch, machine, choices):
    probe, calls = _probe()
    want = _planned(batch, machine, choices, MEASURED)
    assert _planned(batch, machine, choices, probe) == want and calls == [1]
    assert _planned(batch, machine, choices, probe) == want and calls == [1]  # kept


def test_the_replanning_searches_measure_the_tiled_layer_once(tmp_path):
    """`megatrain plan`'s searches (the settings that would fit, the limits, the longest context)
    and the preflight plan many times; the tiled layer is measured once, and each answer is the
    one of the layer measured both ways."""
    from megatrain import plan
    from megatrain.config import TrainConfig

    B8.hf_config.save_pretrained(tmp_path / "model")
    mcfg = ModelConfig.from_json(tmp_path / "model")
    run = TrainConfig(model_config=str(tmp_path / "model"), device="cuda", max_length=262144,
                      per_device_train_batch_size=2, output_dir=str(tmp_path / "out"))  # fmt: skip
    machine = cuda(80, 256)
    probe, calls = _probe()
    refused, want = (plan.check(mcfg, run, machine, 2, layer_mem=lm) for lm in (probe, MEASURED))
    assert not refused.fits and refused.problem == want.problem and calls == [1]
    assert "would fit with" in refused.problem
    probe, calls = _probe()
    one = replace(run, per_device_train_batch_size=1, max_length=16384)
    assert plan.limits(mcfg, one, machine, 2, probe) == plan.limits(mcfg, one, machine, 2, MEASURED)
    assert plan.longest_context(mcfg, one, machine, 2, probe) == plan.longest_context(
        mcfg, one, machine, 2, MEASURED
    )
    assert calls == [1]


def test_tiling_costs_the_mlp_recompute_in_the_time_model():
    forced, plain = (
        placement.plan(B8, SHORT, cuda(139, 256), Choices(mlp_tile_tokens=tile)) for tile in (1024, 0)
    )
    assert forced.mlp_tile_tokens == 1024 and forced.step_time_s > plain.step_time_s


def test_longest_context_is_accepted_and_three_percent_more_is_refused(tmp_path, capsys):
    """`megatrain plan` for the 8B shape on a 141 GB GPU and a 256 GiB host names the longest
    context (MLP tiled, activations parked); the training preflight accepts that length and
    refuses 3% more with one line."""
    from megatrain import plan
    from megatrain.config import TrainConfig

    tiny_config(
        "llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
    ).save_pretrained(tmp_path / "model")  # fmt: skip
    run = dict(
        model_config=str(tmp_path / "model"),
        device="cuda",
        max_gpu_memory="141GB",
        max_host_memory="256GiB",
        max_length=65536,
        output_dir=str(tmp_path / "out"),
    )
    rc, stdout, _ = run_cli(capsys, "plan", write_yaml(tmp_path / "run.yaml", run))
    assert rc == 0, stdout
    line = next(x for x in stdout.splitlines() if x.startswith("longest context: "))
    n = int(re.match(r"longest context: ([\d,]+) tokens per sequence", line)[1].replace(",", ""))
    assert n > 256 * 1024 and "MLP tiles of" in line and "boundary activations in host memory" in line
    mcfg = ModelConfig.from_json(tmp_path / "model")
    p, _ = plan.preflight(mcfg, TrainConfig(**dict(run, max_length=n)), "cuda", 2)
    assert p.mlp_tile_tokens > 0
    over = int(n * 1.03)
    with pytest.raises(plan.InsufficientMemory) as e:
        plan.preflight(mcfg, TrainConfig(**dict(run, max_length=over)), "cuda", 2)
    assert "\n" not in str(e.value) and str(e.value).startswith("no placement fits: ")
    rc, stdout, _ = run_cli(capsys, "plan", write_yaml(tmp_path / "over.yaml", dict(run, max_length=over)))
    assert rc == 1 and "does not fit" in stdout


def test_longctx_bench_dry_run_prints_each_runs_plan(capsys):
    """bench/longctx.py --dry-run plans every named run on the CPU: a row per run with the plan's
    tokens/s, model TFLOP/s (attention counted: at 512k it is most of the work) and peaks, and
    nothing measured."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import longctx

    longctx.main(["--dry-run", "--runs", "B128k,B256k,B512k,tiny"])
    out = capsys.readouterr().out
    head = longctx.HEADER.splitlines()[0]
    assert head in out
    columns = [c.strip() for c in head.strip("|").split("|")]
    rows = {}
    for line in out.splitlines():
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
        if line.startswith("| ") and cells["run"] in longctx.RUNS:
            rows[cells["run"]] = cells
    assert set(rows) == {"B128k", "B256k", "B512k", "tiny"}
    for r in rows.values():
        measured = ("tokens/s", "model TFLOP/s", "GPU peak GiB", "host peak GiB")
        assert all(r[k] == "-" for k in measured), r  # nothing measured
        assert float(r["plan tokens/s"].replace(",", "")) > 0 and float(r["GPU peak plan GiB"]) <= 139, r
    limit, over = (longctx.dry_plan(longctx.memory.parse(longctx.RUNS[k])) for k in ("B-limit", "B-limit+3%"))
    n = limit["resolved_run"]["tokens"]
    assert n == limit["resolved_run"]["limit"] > 262144 and "plan" in limit  # the planner's longest fits
    assert over["error"].startswith("no placement fits")  # 3% more is refused
    b512 = rows["B512k"]
    assert float(b512["host peak plan GiB"]) <= 240 and not b512["plan"].endswith("park0")
    weights_only = 6 * 8.03e9 * float(b512["plan tokens/s"].replace(",", "")) / 1e12
    assert float(b512["plan TFLOP/s"]) > 5 * weights_only  # causal attention counted


def test_longctx_detached_runs_are_reported_and_collected_once_all_are_done(tmp_path, monkeypatch, capsys):
    """bench/longctx.py --detach starts one process of its own session that runs the runs one after
    another (never two at once: each measures the machine's free memory) and returns; --collect
    says which still run or wait, and once all have ended writes the table: a run's RESULT line as
    its record, a run that died as its last output."""
    import json
    import os
    import sys
    import time
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import longctx

    record = longctx.dry_plan(longctx.memory.parse(longctx.RUNS["tiny"]))
    record.update(step_times=[4.0, 2.0], measured={"gpu_peak_allocated": 2**30, "host_peak_rss": 2**31})
    fake = {  # tiny: a worker that finishes after a second; B128k: one that dies at once
        "tiny": f"import time, json; time.sleep(1.5); print('RESULT ' + json.dumps({record!r}))",
        "B": "import sys; print('CUDA is not available'); sys.exit(1)",
    }
    monkeypatch.setattr(longctx, "_worker", lambda run: [sys.executable, "-c", fake[run["model"]]])
    runs = tmp_path / "runs"
    longctx.main(["--runs", "tiny,B128k", "--detach", str(runs)])
    for _ in range(100):  # the detached process starting up
        if (runs / "tiny.start").exists():
            break
        time.sleep(0.05)
    assert longctx.collect(str(runs)) is None  # tiny is still running
    before = (runs / "runs.json").read_text()
    with pytest.raises(SystemExit, match="already holds detached runs"):  # never over what runs
        longctx.main(["--runs", "tiny", "--detach", str(runs)])
    assert (runs / "runs.json").read_text() == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tiny.out").write_text("a file of the user's")
    with pytest.raises(SystemExit, match="is not empty"):  # nor over anything else
        longctx.main(["--runs", "tiny", "--detach", str(mine)])
    assert (mine / "tiny.out").read_text() == "a file of the user's" and len(list(mine.iterdir())) == 1
    said = capsys.readouterr().out
    assert "tiny: running for" in said and "B128k: waiting for the runs before it" in said
    os.waitpid(int((runs / "serve.pid").read_text()), 0)  # here it is this process's child: reap it
    starts = {n: float((runs / f"{n}.start").read_text()) for n in ("tiny", "B128k")}
    assert starts["B128k"] - starts["tiny"] >= 1.5  # after tiny had ended
    out = tmp_path / "out"
    longctx.main(["--collect", str(runs), "--out", str(out)])
    [written] = [json.loads(p.read_text()) for p in out.glob("*_longctx.json")]
    by_name = {r["name"]: r for r in written["runs"]}
    assert by_name["tiny"]["tokens_per_s"] == 8192 / 2.0  # the last step's
    assert "CUDA is not available" in by_name["B128k"]["error"]
    assert by_name["tiny"]["started_by"].endswith("--detach " + str(runs))


def test_attention_at_long_context_runs_at_its_own_rate_in_the_cost_model():
    """The committed 8B runs at 128k, 256k and ~400k tokens (one sequence per step): with one rate
    for every FLOP (the probe's layer at 8k tokens, attention a sixth of its work) the cost model is
    17-29% fast on each; with the causal attention at a rate of its own (450 TFLOP/s, fitted on these
    runs; the probe now measures it) and the rest at the layer's, it predicts each within 8% (3-5%).
    With both rates equal it is the one-rate model exactly."""
    import dataclasses
    import json
    import sys
    from pathlib import Path

    from megatrain.planning import footprint, planspec
    from megatrain.planning.planspec import Machine, Plan
    from megatrain.planning.probe import LayerMemory

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import memory

    results = Path(__file__).resolve().parents[1] / "bench/results"
    runs = []
    for name in (
        "2026-11-23_0150_longctx.json",
        "2026-11-23_0354_longctx.json",
        "2026-11-23_0739_longctx.json",
    ):
        runs += [r for r in json.loads((results / name).read_text())["runs"] if "step_times" in r]
    assert [r["name"] for r in runs] == ["B128k", "B256k", "B-limit"]
    for r in runs:
        cfg = memory.shape_of(r.get("resolved_run") or r["run"])[0]
        batch = memory.batch_of(r.get("resolved_run") or r["run"])
        plan, machine = Plan.from_json(r["plan"]), Machine.from_json(r["machine"])
        one = LayerMemory(**r["layer_mem"])
        split = dataclasses.replace(one, dense_flops_per_s=one.flops_per_s, attention_flops_per_s=450e12)
        same = dataclasses.replace(
            one, dense_flops_per_s=one.flops_per_s, attention_flops_per_s=one.flops_per_s
        )

        def predicted(lm, cfg=cfg, batch=batch, plan=plan, machine=machine):
            return footprint.evaluate(planspec.model_shape(cfg, lm), batch, plan, machine).step_time_s

        measured = min(r["step_times"])
        assert predicted(same) == pytest.approx(predicted(one), rel=1e-12)
        assert predicted(one) < 0.85 * measured, (r["name"], predicted(one), measured)
        assert predicted(split) == pytest.approx(measured, rel=0.08), (r["name"], predicted(split), measured)

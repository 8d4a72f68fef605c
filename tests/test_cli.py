"""The `megatrain` command line: export round trip into transformers, plot, TensorBoard, the
memory preflight (plan / refusing train), and one-line errors for bad inputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_tokenizer
from safetensors import safe_open
from test_checkpoint import make_run, metrics, one_thread, tensors, write_yaml  # noqa: F401 (fixture)

from megatrain import plan
from megatrain.batch import MicroBatch
from megatrain.cli import main
from megatrain.config import TrainConfig
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model
from megatrain.trainer import train


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help and usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------- export
def test_export_round_trip_into_transformers(tmp_path, capsys):
    import transformers

    base = make_run(tmp_path, vocab=640)  # room for the tiny tokenizer's 600 ids
    tiny_tokenizer("chatml").save_pretrained(tmp_path / "tok")
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=3, tokenizer_name_or_path=str(tmp_path / "tok")))
    ckpt = out / "checkpoint-3"
    master = {k: v for k, v in tensors(ckpt).items() if not k.startswith("exp_avg")}

    # fp32, sharded: bit-identical tensors; transformers gives the engine's logits.
    rc, stdout, _ = run_cli(
        capsys, "export", ckpt, tmp_path / "hf32", "--dtype", "float32", "--max-shard-size", "150KB"
    )
    assert rc == 0 and "exported" in stdout
    hf32 = tmp_path / "hf32"
    index = json.loads((hf32 / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    for s in shards:  # at most 150 KB of tensors, unless one tensor alone is larger (as in HF)
        keys = [k for k, f in index["weight_map"].items() if f == s]
        assert len(keys) == 1 or sum(master[k].numel() * 4 for k in keys) <= 150_000
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in master.values())
    assert_equal_tensors(tensors(hf32), master)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (hf32 / name).is_file(), name
    assert not list(hf32.glob("optimizer*")) and not (hf32 / "trainer_state.json").exists()

    model = transformers.AutoModelForCausalLM.from_pretrained(hf32, attn_implementation="eager").eval()
    assert model.dtype == torch.float32
    tok = transformers.AutoTokenizer.from_pretrained(hf32)
    assert tok.chat_template and len(tok) == 600
    ids = torch.randint(0, 640, (2, 17), generator=torch.Generator().manual_seed(0))
    mt = build_model(ModelConfig.from_json(ckpt), weights=ckpt, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, mt.engine.logits(MicroBatch(ids, ids)), rtol=1e-5, atol=1e-5
        )

    # bf16 (the default): each tensor is the master rounded to bf16, config says so.
    rc, _, _ = run_cli(capsys, "export", ckpt, tmp_path / "hf16")
    assert rc == 0
    got = tensors(tmp_path / "hf16")
    assert_equal_tensors(got, {k: v.to(torch.bfloat16) for k, v in master.items()})
    assert json.loads((tmp_path / "hf16" / "config.json").read_text())["dtype"] == "bfloat16"
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf16")
    assert bf16.dtype == torch.bfloat16

    # Exporting the training run's final/ directory works the same way.
    rc, _, _ = run_cli(capsys, "export", out / "final", tmp_path / "again", "--dtype", "float32")
    assert rc == 0
    assert_equal_tensors(tensors(tmp_path / "again"), tensors(out / "final"))


def assert_equal_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_export_streams_one_tensor_at_a_time(tmp_path, monkeypatch, capsys):
    """Each source tensor is read only when it is written and released before the next is read:
    an export never holds a second copy of the model."""
    import weakref

    from megatrain import weights

    base = make_run(tmp_path)
    train(TrainConfig(**base, output_dir=str(tmp_path / "out"), max_steps=1))
    refs, alive_at_read = [], []
    orig_get = weights.TensorReader.get

    def get(self, key):
        alive_at_read.append(sum(r() is not None for r in refs))
        t = orig_get(self, key)
        refs.append(weakref.ref(t))
        return t

    monkeypatch.setattr(weights.TensorReader, "get", get)
    for dtype in ("float32", "bfloat16"):
        refs.clear()
        alive_at_read.clear()
        rc, _, _ = run_cli(
            capsys, "export", tmp_path / "out" / "checkpoint-1", tmp_path / dtype, "--dtype", dtype
        )
        assert rc == 0 and len(refs) == len(tensors(tmp_path / dtype))
        # fp32: the tensor being written stays referenced until the next one arrives; bf16: only
        # its converted copy does.
        assert max(alive_at_read) == (1 if dtype == "float32" else 0)


# ---------------------------------------------------------------------------- plot, tensorboard
def test_plot_writes_png(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    recs = [
        {
            "step": s,
            "loss": 5 - s / 20,
            "grad_norm": 2.0 + s % 3,
            "lr": 1e-3 * s / 40,
            "tokens_per_s": 1000 + s,
        }
        for s in range(1, 41)
    ]
    recs[10] = {"step": 11, "loss": None, "grad_norm": None, "lr": 2e-4, "tokens_per_s": 990, "skipped": True}
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 41, "lo')
    rc, stdout, _ = run_cli(capsys, "plot", out)
    png = out / "training.png"
    assert rc == 0 and str(png) in stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (w, h) == (1210, 770)  # 11 x 7 inches at 110 dpi
    rc, _, _ = run_cli(capsys, "plot", out, "--out", tmp_path / "sub" / "p.png")
    assert rc == 0 and (tmp_path / "sub" / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_tensorboard_writes_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=4, report_to="tensorboard"))
    events = list((out / "runs").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    acc = EventAccumulator(str(out / "runs"))
    acc.Reload()
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(acc.Tags()["scalars"])
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert losses == pytest.approx([r["loss"] for r in metrics(out)], rel=1e-6)


# ---------------------------------------------------------------------------- plan / preflight
def test_plan_prints_estimate(tmp_path, capsys):
    base = make_run(tmp_path)
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(tmp_path / "out")))
    rc, stdout, _ = run_cli(capsys, "plan", cfg)
    assert rc == 0, stdout
    n = ModelConfig.from_json(tmp_path / "model").num_params
    assert f"parameters ({n:,})" in stdout
    assert (
        "host memory" in stdout and "available (MemAvailable)" in stdout and stdout.rstrip().endswith("fits")
    )
    assert "2 x 32 per micro-batch, x 2 accumulation = 128 per optimizer step" in stdout
    assert not (tmp_path / "out").exists()

    # Planning for a GPU from a machine without one: the GPU table, availability unknown.
    rc, stdout, _ = run_cli(
        capsys, "plan", cfg, "device=cuda", "per_device_train_batch_size=4", "max_length=4096"
    )
    assert rc == 0
    assert (
        "GPU memory" in stdout
        and "fp32 gradients (all units)" in stdout
        and "no CUDA device visible" in stdout
    )
    e = plan.estimate(
        ModelConfig.from_json(tmp_path / "model"),
        device="cuda",
        compute_bytes=2,
        batch=4,
        accum=2,
        max_length=4096,
    )
    assert e.gpu["fp32 gradients (all units)"] == 4 * n
    assert e.gpu["boundary activations"] == 4 * 4096 * 2 * 64 * 2 * 3  # tokens/step x hidden x 2 B x layers
    assert e.pinned == 4 * n + e.host["pinned gradient staging"]


def test_plan_numbers_for_a_large_model():
    """An 8B Llama: the arithmetic the docstring promises, without allocating anything."""
    cfg = ModelConfig.from_hf(
        tiny_config(
            "llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    )
    assert 8.0e9 < cfg.num_params < 8.1e9
    e = plan.estimate(cfg, device="cuda", compute_bytes=2, batch=1, accum=8, max_length=4096)
    GiB = 2**30
    assert e.host["fp32 weights + AdamW moments + runtime"] == int(13.0 * cfg.num_params)
    assert 29 < e.gpu["fp32 gradients (all units)"] / GiB < 31
    assert e.gpu["boundary activations"] == 8 * 4096 * 4096 * 2 * 32
    assert e.gpu["one layer's recompute"] == 4096 * (10 * 4096 + 4 * 14336) * 2
    assert e.gpu["loss chunk"] == min(2**32, 4096 * 128256 * 8)  # fp32 logits + their gradient
    # the head (norm + 128256 x 4096 lm_head) is the largest unit: 3 bf16 copies + one fp32 staging copy.
    assert e.gpu["weight buffers"] == (128256 * 4096 + 4096) * (3 * 2 + 4)


def test_train_refuses_a_run_that_cannot_fit(tmp_path, monkeypatch, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "run.yaml", dict(base, output_dir=str(out), per_device_train_batch_size=4, max_steps=2)
    )
    need = {
        b: plan.estimate(
            ModelConfig.from_json(tmp_path / "model"),
            device="cpu",
            compute_bytes=4,
            batch=b,
            accum=2,
            max_length=32,
        ).host_total
        for b in (2, 4)
    }
    # Room for batch size 2 (or 3) but not 4.
    monkeypatch.setattr(plan, "host_available", lambda *a: need[2] + 1)
    rc, _, err = run_cli(capsys, "train", cfg)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: not enough host memory: need ~"), err
    assert "available (MemAvailable); would fit with per_device_train_batch_size=" in lines[0]
    assert re.search(r"per_device_train_batch_size=[23]\b", lines[0]) and "max_length=" in lines[0]
    assert not out.exists()

    rc, stdout, _ = run_cli(capsys, "plan", cfg)
    assert rc == 1 and "DOES NOT FIT" in stdout

    # Nothing fits at all: say so.
    monkeypatch.setattr(plan, "host_available", lambda *a: 1024)
    rc, _, err = run_cli(capsys, "train", cfg)
    assert rc == 2 and "no batch setting fits: use a machine with more memory or a smaller model" in err

    # preflight_check=false only warns.
    rc, stdout, err = run_cli(capsys, "train", cfg, "preflight_check=false")
    assert rc == 0 and "megatrain: warning: not enough host memory" in stdout + err
    assert (out / "final").is_dir()


def test_host_available_reads_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable:   2048 kB\n")
    assert plan.host_available(str(tmp_path / "meminfo")) == 2048 * 1024
    assert plan.host_available(str(tmp_path / "nope")) is None
    assert plan.host_available() > 0  # this machine


# ---------------------------------------------------------------------------- bad inputs
def _bad_inputs(tmp_path: Path) -> dict:
    base = make_run(tmp_path)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (tmp_path / "broken.jsonl").write_text(
        '{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5, 6]}\n{"input_ids": [7,\n'
    )
    (tmp_path / "empty.jsonl").write_text("")
    return base


BAD = [
    (["model_config=null", "model_name_or_path={tmp}/missing"], "{tmp}/missing"),
    (["model_config={tmp}/gpt2"], "model_type 'gpt2' is not supported"),
    (["lerning_rate=1e-4"], "unknown config key 'lerning_rate'; did you mean 'learning_rate'?"),
    (["learning_rate=fast"], "learning_rate: expected float, got 'fast'"),
    (["max_steps=0"], "max_steps: must be > 0"),
    (["dataset={tmp}/broken.jsonl"], "{tmp}/broken.jsonl:3: not valid JSON"),
    (["dataset={tmp}/empty.jsonl"], "{tmp}/empty.jsonl: file is empty"),
    (["dataset={tmp}/nowhere.jsonl"], "dataset {tmp}/nowhere.jsonl: no such file"),
    (["max_shard_size=huge"], "max_shard_size: expected bytes or a size"),
    (["resume_from_checkpoint=true"], "resume_from_checkpoint: no checkpoint-* directory"),
    (["oops"], "override 'oops': expected key=value"),
    # Evaluation data is read and checked before anything is written, like the training data.
    (["eval_dataset={tmp}/broken.jsonl"], "{tmp}/broken.jsonl:3: not valid JSON"),
    (["eval_dataset={tmp}/nowhere.jsonl"], "eval_dataset {tmp}/nowhere.jsonl: no such file"),
    (["eval_strategy=epoch"], "eval_strategy: needs an eval_dataset"),
    (
        ["eval_dataset={tmp}/data.jsonl", "save_steps=3", "eval_steps=2", "load_best_model_at_end=true"],
        "load_best_model_at_end: save_steps 3 must be a round multiple of eval_steps 2",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_train_bad_input_is_one_line_exit_2(tmp_path, capsys, overrides, message):
    base = _bad_inputs(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=2))
    rc, stdout, err = run_cli(capsys, "train", cfg, *[o.format(tmp=tmp_path) for o in overrides])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    assert message.format(tmp=tmp_path) in lines[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "{tmp}/none.yaml"], "{tmp}/none.yaml: config file does not exist"),
        (["export", "{tmp}/nockpt", "{tmp}/x"], "{tmp}/nockpt: checkpoint directory does not exist"),
        (["export", "{tmp}/gpt2", "{tmp}/x"], "model_type 'gpt2' is not supported"),
        (["export", "{tmp}/model", "{tmp}/x"], "no model.safetensors or model.safetensors.index.json"),
        (["export", "{tmp}/a", "{tmp}/b", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["export", "{tmp}/a", "{tmp}/b", "--max-shard-size", "lots"], "'lots': expected bytes or a size"),
        (["export"], "the following arguments are required: checkpoint, out"),
        (["plot", "{tmp}/nothing"], "{tmp}/nothing/metrics.jsonl: no such file"),
        (["plan", "{tmp}/run.yaml", "bogus=1"], "unknown config key 'bogus'"),
        (["fly"], "argument COMMAND: invalid choice: 'fly'"),
    ],
)
def test_other_commands_bad_input(tmp_path, capsys, argv, message):
    base = _bad_inputs(tmp_path)
    write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(tmp_path / "out")))
    rc, _, err = run_cli(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    assert message.format(tmp=tmp_path) in lines[0]
    assert not (tmp_path / "x").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["train", "export", "plot", "plan"])
def test_help(capsys, command):
    rc, stdout, _ = run_cli(capsys, command, "--help")
    assert rc == 0 and stdout.startswith(f"usage: megatrain {command}")


def test_export_reads_safetensors_headers_only_before_writing(tmp_path, capsys):
    """A checkpoint missing a tensor is refused before the output directory is created."""
    base = make_run(tmp_path)
    train(TrainConfig(**base, output_dir=str(tmp_path / "out"), max_steps=1))
    ck = tmp_path / "out" / "checkpoint-1"
    from safetensors.torch import save_file

    with safe_open(ck / "model.safetensors", "pt") as h:
        t = {k: h.get_tensor(k) for k in h.keys() if k != "model.norm.weight"}  # noqa: SIM118
    save_file(t, ck / "model.safetensors")
    rc, _, err = run_cli(capsys, "export", ck, tmp_path / "hf")
    assert rc == 2 and f"{ck}: tensor model.norm.weight is missing" in err
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]


def test_plan_parks_boundary_activations_in_host_memory_above_a_third_of_the_gpu():
    from megatrain.models.config import ModelConfig
    from megatrain.plan import estimate

    cfg = ModelConfig.from_hf(tiny_config("llama"))
    kw = dict(device="cuda", compute_bytes=2, batch=8, accum=4, max_length=4096)
    on_gpu = estimate(cfg, gpu_bytes=10**12, **kw)
    parked = estimate(cfg, gpu_bytes=10**6, **kw)
    forced = estimate(cfg, gpu_bytes=10**12, offload_activations=True, **kw)
    boundary = on_gpu.gpu["boundary activations"]
    assert boundary == 8 * 4 * 4096 * cfg.hidden_size * 2 * cfg.num_hidden_layers
    assert "boundary activations" not in parked.gpu
    assert parked.host["boundary activations (page-locked)"] == boundary
    assert parked.pinned - on_gpu.pinned == boundary
    assert forced.host == parked.host

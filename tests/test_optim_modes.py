"""`optim` end to end: Hugging Face's names and what megatrain refuses, checkpoints that say their
moments' format (a resume keeps it, bitwise; another mode is refused in one line), export that
writes weights only, the bytes each mode takes in the plan and plan.json, `megatrain plan`'s
largest model per mode and the leaner mode it names where a run does not fit, and several
processes (shared and partitioned state) training 8-bit moments as one."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from test_checkpoint import assert_bitwise, make_run, metrics, one_thread, tensors, write_yaml  # noqa: F401
from test_cli import run_cli
from transformers.training_args import OptimizerNames

from megatrain import plan as planning
from megatrain.config import TrainConfig
from megatrain.errors import CheckpointError, ConfigError
from megatrain.host import moments
from megatrain.host.moments import BF16, BLOCK, FP32, Q8, Moments
from megatrain.host.state import build_units
from megatrain.models.config import ModelConfig
from megatrain.trainer import train

ANY_BF16 = dict(optim="adamw_anyprecision", optim_args="momentum_dtype=bfloat16,variance_dtype=bfloat16")


# ---------------------------------------------------------------------------- names
def test_the_names_taken_are_hugging_faces_and_select_their_formats():
    hf = {o.value for o in OptimizerNames}
    assert set(moments.OPTIM) <= hf and set(moments.NOT_BUILT) <= hf
    for name in ("adamw_torch", "adamw_torch_fused", "paged_adamw_32bit"):
        assert moments.resolve(name) == FP32
    for name in ("adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"):
        assert moments.resolve(name) == Q8
    assert moments.resolve("adamw_anyprecision") == FP32  # Hugging Face's default dtypes: float32
    assert moments.resolve(**ANY_BF16) == BF16
    mixed = moments.resolve("adamw_anyprecision", " momentum_dtype = bfloat16 , use_kahan_summation=False")
    assert mixed == Moments("bfloat16", "float32") and mixed.name == "bf16+fp32"
    assert TrainConfig(model_config="x.json").optim == "adamw_torch"  # Hugging Face's default
    for f in (FP32, BF16, Q8, mixed):  # what checkpoints and plans record, and the keys that select it
        assert moments.named(f.name) == f
        assert TrainConfig(model_config="x.json", **f.settings).moments() == f
    assert (FP32.bytes_per_param, BF16.bytes_per_param, Q8.bytes_per_param) == (8, 4, 2 + 8 / BLOCK)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(optim="adafactor"),
            r"^optim: 'adafactor' is not supported \(megatrain's optimizer is AdamW\); supported: adamw_torch, ",
        ),
        (
            dict(optim="lion_8bit"),
            r"^optim: 'lion_8bit' is not supported .*paged_adamw_8bit, adamw_anyprecision$",
        ),
        (dict(optim="sgd"), r"^optim: 'sgd' is not supported"),
        (
            dict(optim="adamw_torch_4bit"),
            r"torchao's 4-bit moments are not built; adamw_8bit is bitsandbytes'",
        ),
        (dict(optim="adamw_8bit", optim_args="betas=0.9"), r"^optim_args: adamw_8bit takes none"),
        (
            dict(optim="adamw_anyprecision", optim_args="momentum_dtype"),
            r"^optim_args: 'momentum_dtype' is not key=value",
        ),
        (
            dict(optim="adamw_anyprecision", optim_args="momentum_dtype=float16"),
            r"momentum_dtype must be float32 or bfloat16",
        ),
        (
            dict(optim="adamw_anyprecision", optim_args="lr=1"),
            r"takes momentum_dtype, variance_dtype, .*not 'lr'",
        ),
        (
            dict(optim="adamw_anyprecision", optim_args="use_kahan_summation=True"),
            r"master weights are exact fp32",
        ),
    ],
)
def test_what_is_not_taken_is_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(model_config="x.json", **settings)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- checkpoints, export
@pytest.mark.parametrize("mode", [dict(optim="adamw_8bit"), ANY_BF16], ids=["8bit", "bf16"])
def test_a_checkpoint_says_its_mode_resumes_bitwise_and_refuses_another(tmp_path, mode):
    base = make_run(tmp_path) | mode | dict(max_steps=4)
    fmt = TrainConfig(**base).moments()
    ref = train(TrainConfig(**base, output_dir=str(tmp_path / "a"), save_steps=2))
    ckpt = tmp_path / "a" / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["optimizer_moments"] == fmt.name
    units = build_units(ModelConfig.from_json(base["model_config"]))
    with safe_open(ckpt / "optimizer.safetensors", "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
        for u in units:
            for p in u.params:
                for field in fmt.fields:
                    t = f.get_slice(f"{field.name}.{p.key}")
                    shape = list(p.shape) if field.per == 1 else [math.ceil(p.numel / BLOCK)]
                    assert (t.get_shape(), t.get_dtype()) == (
                        shape,
                        {"uint8": "U8", "bfloat16": "BF16", "float32": "F32"}[field.dtype],
                    )
    assert len(keys) == len(fmt.fields) * sum(len(u.params) for u in units)
    resumed = train(TrainConfig(**base, output_dir=str(tmp_path / "b"), resume_from_checkpoint=str(ckpt)))
    assert [r["loss"] for r in metrics(tmp_path / "b") if "loss" in r] == [
        r["loss"] for r in metrics(tmp_path / "a") if "loss" in r and r["step"] > 2
    ]
    assert_bitwise(tensors(resumed), tensors(ref))
    assert_bitwise(tensors(tmp_path / "b" / "checkpoint-4"), tensors(tmp_path / "a" / "checkpoint-4"))
    # Export is the weights alone, whatever the optimizer: fp32 AdamW's keys, shapes and dtypes.
    fp32 = train(
        TrainConfig(**(base | dict(optim="adamw_torch", optim_args=None)), output_dir=str(tmp_path / "c"))
    )
    exported, plain = tensors(ref), tensors(fp32)
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {
        k: (v.shape, v.dtype) for k, v in plain.items()
    }
    with pytest.raises(CheckpointError) as e:
        train(
            TrainConfig(
                **(base | dict(optim="adamw_torch", optim_args=None)),
                output_dir=str(tmp_path / "d"),
                resume_from_checkpoint=str(ckpt),
            )
        )
    theirs = " ".join(f"{k}={v}" for k, v in fmt.settings.items()).replace(" ", ", ")
    assert str(e.value) == (
        f"{ckpt}: its AdamW moments are {fmt.name} ({theirs}), this run's fp32; a run resumes in the optimizer "
        f"mode it saved (set {theirs}, or start a new run from its weights)"
    )
    assert not (tmp_path / "d").exists()


def test_a_checkpoint_from_before_optim_is_fp32(tmp_path):
    """trainer_state.json without optimizer_moments (written before `optim`) holds fp32 moments:
    it resumes as adamw_torch and is refused by adamw_8bit."""
    base = make_run(tmp_path) | dict(max_steps=2, save_steps=2)
    train(TrainConfig(**base, output_dir=str(tmp_path / "a")))
    ckpt = tmp_path / "a" / "checkpoint-2"
    st = json.loads((ckpt / "trainer_state.json").read_text())
    del st["optimizer_moments"]
    (ckpt / "trainer_state.json").write_text(json.dumps(st))
    (ckpt / "megatrain_manifest.json").unlink()  # edited by hand: resumed unverified
    with pytest.raises(
        CheckpointError, match="its AdamW moments are fp32 \\(optim=adamw_torch\\), this run's 8bit"
    ):
        train(
            TrainConfig(
                **base, optim="adamw_8bit", output_dir=str(tmp_path / "b"), resume_from_checkpoint=str(ckpt)
            )
        )
    train(
        TrainConfig(
            **(base | dict(max_steps=3)), output_dir=str(tmp_path / "c"), resume_from_checkpoint=str(ckpt)
        )
    )


# ---------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("fmt", [FP32, BF16, Q8], ids=["fp32", "bf16", "8bit"])
def test_each_modes_bytes_are_in_the_plan_and_plan_json(tmp_path, fmt):
    base = make_run(tmp_path) | fmt.settings | dict(max_steps=1)
    cfg = TrainConfig(**base, output_dir=str(tmp_path / "out"))
    train(cfg)
    record = json.loads((tmp_path / "out" / "plan.json").read_text())
    units = build_units(ModelConfig.from_json(base["model_config"]))
    n = sum(u.numel for u in units)
    want = 4 * n + sum(f.nbytes(n) for f in fmt.fields)
    assert record["plan"]["moments"] == fmt.name
    assert record["plan"]["state_bytes_per_param"] == 4 + fmt.bytes_per_param
    assert record["plan"]["host"]["fp32 weights + AdamW moments"] == want
    assert record["host_state_bytes_per_machine"] == [want]  # what the run allocated


def _sized(tmp_path):
    """A run whose state is most of its host memory: a wider tiny Llama, short rows."""
    base = make_run(tmp_path, vocab=2000, hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    return base | dict(max_length=32, per_device_train_batch_size=1)


def test_megatrain_plan_prints_the_largest_model_of_each_mode_and_names_the_leaner_one_that_fits(
    tmp_path, capsys
):
    base = _sized(tmp_path)
    cfg_path = write_yaml(
        tmp_path / "run.yaml", base | dict(output_dir=str(tmp_path / "out"), dataset=base["dataset"])
    )
    model_cfg = ModelConfig.from_json(base["model_config"])
    machine = planning.machine_of(TrainConfig(**base), "cpu")

    def least(**mode) -> int:
        """The least max_host_memory `megatrain plan` fits the run in with `mode`."""
        cfg = TrainConfig(**(base | mode))
        lo, hi, data = 0, 1 << 40, planning.data_bytes(cfg)
        while hi - lo > 1024:
            mid = (lo + hi) // 2
            at = replace(machine, host_bytes=mid)
            lo, hi = (lo, mid) if planning.check(model_cfg, cfg, at, 4, data).fits else (mid, hi)
        return hi

    fp32, bf16 = least(), least(**ANY_BF16)
    assert least(optim="adamw_8bit") < bf16 < fp32
    budget = (fp32 + bf16) // 2  # fp32 AdamW does not fit it, bf16 moments do
    rc, out, _ = run_cli(capsys, "plan", cfg_path, f"max_host_memory={budget}")
    assert rc == 1
    [line] = [x for x in out.splitlines() if x.startswith("does not fit:")]
    assert (
        "would fit with optim=adamw_anyprecision optim_args=momentum_dtype=bfloat16,variance_dtype=bfloat16"
        in line
    )
    rc, out, _ = run_cli(capsys, "plan", cfg_path, f"max_host_memory={budget}", "optim=adamw_8bit")
    assert rc == 0 and "fits" in out.splitlines()
    rows = out.split("by optimizer mode\n")[1].splitlines()[:3]
    counts = [float(r.split()[0][:-1]) * (1e9 if r.split()[0].endswith("B") else 1e6) for r in rows]
    assert counts[0] < counts[1] < counts[2]  # fp32, bf16, 8-bit: each leaner holds more
    assert rows[2].endswith("8bit moments, 6.03 B/param: optim=adamw_8bit (this run)")
    assert "12 B/param: optim=adamw_torch" in rows[0] and "8 B/param: optim=adamw_anyprecision" in rows[1]
    # The count is the room beside the run's other buffers over each mode's bytes a parameter.
    q8 = planning.check(model_cfg, TrainConfig(**base, optim="adamw_8bit"), machine, 4).plan
    room = planning.state_room(q8, machine)
    assert planning.largest_models(q8, machine) == {
        f: int(room // (4 + f.bytes_per_param)) for f in (FP32, BF16, Q8)
    }


# ---------------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_several_processes_train_8bit_moments_as_one(tmp_path):
    """Two processes sharing the machine's state (each steps its span) and two machines each
    holding its part (its segments of the codes and absmax in the checkpoint) train as one
    process does, up to the order of fp32 sums; the partitioned checkpoint resumes in one
    process."""
    from test_distributed import assert_same_run, launch

    def assert_close_weights(a, b) -> None:
        """fp32 AdamW's tolerance (the order of sums) but for a few elements: a gradient one ulp
        apart moves a moment across a code's edge now and then, and that element's update by up
        to a code's step (less than the learning rate each step)."""
        assert a.keys() == b.keys()
        far = sum(int((~torch.isclose(a[k], b[k], rtol=1e-5, atol=1e-6)).sum()) for k in a)
        assert far <= 1e-4 * sum(t.numel() for t in a.values()), far
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 3 * TrainConfig(**base).learning_rate

    base = make_run(tmp_path) | dict(
        max_steps=3, save_steps=1, gradient_accumulation_steps=4, optim="adamw_8bit"
    )
    torch.set_num_threads(1)
    train(TrainConfig(**base, output_dir=str(tmp_path / "one")))
    path = write_yaml(tmp_path / "run.yaml", base)
    for name, extra in (("two", []), ("parts", ["nproc_per_node=1", "nnodes=2"])):
        proc = launch(path, "gradient_accumulation_steps=2", *extra, f"output_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr
        assert_same_run(metrics(tmp_path / name), metrics(tmp_path / "one"), [1, 2, 3])
        assert_close_weights(tensors(tmp_path / name / "final"), tensors(tmp_path / "one" / "final"))
    files = sorted(p.name for p in (tmp_path / "parts" / "checkpoint-3").glob("optimizer*.safetensors"))
    assert files == [f"optimizer.machine-0000{m}-of-00002.safetensors" for m in (1, 2)]
    resumed = tmp_path / "parts_then_one"
    ckpt = str(tmp_path / "parts" / "checkpoint-1")
    train(TrainConfig(**base, output_dir=str(resumed), resume_from_checkpoint=ckpt))
    assert_same_run(metrics(resumed), metrics(tmp_path / "one"), [2, 3])
    assert_close_weights(tensors(resumed / "final"), tensors(tmp_path / "one" / "final"))

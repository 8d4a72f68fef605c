"""The `megatrain` command line: export round trip into transformers, plot, TensorBoard, the
memory preflight (plan / refusing train), and one-line errors for bad inputs."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_tokenizer
from safetensors import safe_open
from test_checkpoint import make_run, metrics, one_thread, tensors, write_yaml  # noqa: F401 (fixture)

from megatrain.cli import main
from megatrain.config import TrainConfig
from megatrain.data.batch import MicroBatch
from megatrain.host.split import to_bf16
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
    # Checkpoint, final/ and export all stop generating at the chat template's end of turn.
    im_end = tiny_tokenizer("chatml").convert_tokens_to_ids("<|im_end|>")
    for d in (ckpt, out / "final", hf32):
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [2, im_end], d

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

    # bf16 (the default): each tensor is the master rounded to bf16 as its halves round (the bf16
    # weights training computed with, host/split.py), config says so.
    rc, _, _ = run_cli(capsys, "export", ckpt, tmp_path / "hf16")
    assert rc == 0
    got = tensors(tmp_path / "hf16")
    assert_equal_tensors(got, {k: to_bf16(v) for k, v in master.items()})
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

    from megatrain.io import weights

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
        # The writer drops each tensor (fp32) or its converted copy (bf16) once it is written.
        assert max(alive_at_read) == 0


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
# ---------------------------------------------------------------------------- bad inputs
def _bad_inputs(tmp_path: Path) -> dict:
    base = make_run(tmp_path)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    (tmp_path / "broken.jsonl").write_text(
        '{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5, 6]}\n{"input_ids": [7,\n'
    )
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "vocab.jsonl").write_text('{"input_ids": [1, 96]}\n{"input_ids": [1, 97]}\n')
    (tmp_path / "huge.jsonl").write_text(f'{{"input_ids": [1, {2**70}]}}\n')
    (tmp_path / "text.jsonl").write_text('{"text": "the people who were there"}\n')
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04\x95\xff\x00binary")
    (tmp_path / "list.json").write_text("[1, 2]")
    tiny_tokenizer(None).save_pretrained(tmp_path / "tok")  # 600 ids, the model has 97
    return base


BAD = [
    (["model_config=null", "model_name_or_path={tmp}/missing"], "{tmp}/missing"),
    (
        ["model_config={tmp}/gpt2"],
        "{tmp}/gpt2/config.json: model_type 'gpt2': modules with parameters besides",
    ),
    (["model_config={tmp}/weights.bin"], "{tmp}/weights.bin: not a JSON file (binary, or not UTF-8 text)"),
    (
        ["model_config=null", "model_name_or_path={tmp}/weights.bin"],
        "{tmp}/weights.bin: not a JSON file (binary, or not UTF-8 text)",
    ),
    (
        ["model_config={tmp}/list.json"],
        "{tmp}/list.json: expected a JSON object (a Hugging Face config.json)",
    ),
    (["lerning_rate=1e-4"], "unknown config key 'lerning_rate'; did you mean 'learning_rate'?"),
    (
        ["fsdp=full_shard"],
        "config key 'fsdp' (Hugging Face's) is not taken: megatrain's several-GPU training is its own",
    ),
    (["learning_rate=fast"], "learning_rate: expected float, got 'fast'"),
    (["max_steps=0"], "max_steps: must be > 0"),
    (["dataset={tmp}/broken.jsonl"], "{tmp}/broken.jsonl:3: not valid JSON"),
    (["dataset={tmp}/empty.jsonl"], "{tmp}/empty.jsonl: file is empty"),
    (["dataset={tmp}/nowhere.jsonl"], "dataset {tmp}/nowhere.jsonl: no such file"),
    (["max_shard_size=huge"], "max_shard_size: expected bytes or a size"),
    (["resume_from_checkpoint=true"], "resume_from_checkpoint: no checkpoint-* directory"),
    (["oops"], "override 'oops': expected key=value"),
    (["learning_rate=nan"], "learning_rate: must be a finite number (got nan)"),
    (["max_grad_norm=.inf"], "max_grad_norm: must be a finite number (got inf)"),
    (["adam_epsilon=NaN"], "adam_epsilon: must be a finite number (got nan)"),
    (["num_train_epochs=.inf", "max_steps=-1"], "num_train_epochs: must be a finite number (got inf)"),
    (["warmup_ratio=.nan"], "warmup_ratio: must be a finite number (got nan)"),
    (["weight_decay=-.inf"], "weight_decay: must be a finite number (got -inf)"),
    ([f"seed={2**70}"], f"seed: must be in [0, 2**32) (got {2**70})"),
    (
        ["dataset={tmp}/vocab.jsonl"],
        "{tmp}/vocab.jsonl:2: token id 97 in 'input_ids' is outside the vocabulary [0, 97)",
    ),
    (
        ["dataset={tmp}/huge.jsonl"],
        f"{{tmp}}/huge.jsonl:1: token id {2**70} in 'input_ids' is outside the vocabulary",
    ),
    (
        ["dataset={tmp}/text.jsonl", "tokenizer_name_or_path={tmp}/tok"],
        "{tmp}/text.jsonl:1: the tokenizer gives token id",
    ),
    # Evaluation data is read and checked before anything is written, like the training data.
    (["eval_dataset={tmp}/broken.jsonl"], "{tmp}/broken.jsonl:3: not valid JSON"),
    (["eval_dataset={tmp}/nowhere.jsonl"], "eval_dataset {tmp}/nowhere.jsonl: no such file"),
    (
        ["eval_dataset={tmp}/vocab.jsonl"],
        "{tmp}/vocab.jsonl:2: token id 97 in 'input_ids' is outside the vocabulary [0, 97)",
    ),
    (["eval_strategy=epoch"], "eval_strategy: needs an eval_dataset"),
    (
        ["tokenizer_name_or_path={tmp}/no-tok"],
        "tokenizer_name_or_path: {tmp}/no-tok: no such file or directory",
    ),
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
        (
            ["export", "{tmp}/gpt2", "{tmp}/x"],
            "{tmp}/gpt2/config.json: model_type 'gpt2': modules with parameters besides",
        ),
        (["export", "{tmp}/model", "{tmp}/x"], "no model.safetensors or model.safetensors.index.json"),
        (["export", "{tmp}/a", "{tmp}/b", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["export", "{tmp}/a", "{tmp}/b", "--max-shard-size", "lots"], "'lots': expected bytes or a size"),
        (["export"], "the following arguments are required: checkpoint, out"),
        (["plot", "{tmp}/nothing"], "{tmp}/nothing/metrics.jsonl: no such file"),
        (["plan", "{tmp}/run.yaml", "bogus=1"], "unknown config key 'bogus'"),
        (
            ["plan", "{tmp}/run.yaml", "model_config={tmp}/weights.bin"],
            "{tmp}/weights.bin: not a JSON file (binary, or not UTF-8 text)",
        ),
        (
            ["plan", "{tmp}/run.yaml", "model_config=null", "model_name_or_path={tmp}/weights.bin"],
            "{tmp}/weights.bin: not a JSON file (binary, or not UTF-8 text)",
        ),
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


# ---------------------------------------------------------------------------- outputs and environment
def test_output_dir_that_is_a_file(tmp_path, capsys):
    base = make_run(tmp_path)
    f = tmp_path / "taken"
    f.write_text("mine")
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, max_steps=1))
    for out, what in [
        (f, f"output_dir: {f} is a file"),
        (f / "sub", f"output_dir: {f / 'sub'} is inside {f}"),
    ]:
        rc, _, err = run_cli(capsys, "train", cfg, f"output_dir={out}")
        lines = err.strip().splitlines()
        assert (
            rc == 2
            and len(lines) == 1
            and lines[0].startswith(f"megatrain: error: {what}, which is a file"[:-15])
        ), err
        assert f.read_text() == "mine"


class ReadOnly:
    """From `start()` on, what is created or written under `root` fails as on a read-only file
    system (EROFS) or a directory without write permission (EACCES); reading works."""

    def __init__(self, monkeypatch, root: Path, code: int = errno.EROFS):
        import builtins
        import io
        import os

        real = {"open": builtins.open, "os.open": os.open, "mkdir": os.mkdir}
        self.on = False

        def refuse(path) -> None:
            if self.on and str(os.path.abspath(path)).startswith(str(root)):
                raise OSError(code, os.strerror(code), str(path))

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
                refuse(file)
            return real["open"](file, mode, *args, **kwargs)

        def os_open(path, flags, *args, **kwargs):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                refuse(path)
            return real["os.open"](path, flags, *args, **kwargs)

        def mkdir(path, *args, **kwargs):
            refuse(path)
            return real["mkdir"](path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "mkdir", mkdir)

    def start(self) -> None:
        self.on = True


@pytest.mark.parametrize(
    "code,verb", [(errno.EROFS, "cannot write"), (errno.EACCES, "cannot access")], ids=["EROFS", "EACCES"]
)
def test_a_read_only_output_dir_is_one_line(tmp_path, capsys, monkeypatch, code, verb):
    import os

    from megatrain.io.ownership import RunLock

    base = make_run(tmp_path)
    ro = tmp_path / "ro"
    (ro / "empty").mkdir(parents=True)
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, max_steps=1))
    fs = ReadOnly(monkeypatch, ro, code)
    fs.start()
    why = os.strerror(code)
    for out, what in [
        (ro / "new", f"output_dir: cannot create {ro / 'new'}: {why}"),
        (ro / "empty", f"output_dir: cannot write in {ro / 'empty'}: {why}"),
    ]:
        rc, _, err = run_cli(capsys, "train", cfg, f"output_dir={out}")
        lines = err.strip().splitlines()
        assert rc == 2 and lines == [f"megatrain: error: {what}"], err
    assert sorted(p.name for p in ro.iterdir()) == ["empty"] and not any((ro / "empty").iterdir())
    # The file system turns read-only once the run holds output_dir (remounted after errors).
    fs.on = False
    enter = RunLock.__enter__

    def enter_then_read_only(self):
        out = enter(self)
        fs.start()
        return out

    monkeypatch.setattr(RunLock, "__enter__", enter_then_read_only)
    rc, _, err = run_cli(capsys, "train", cfg, f"output_dir={ro / 'later'}")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0] == f"megatrain: error: {verb} {ro / 'later' / 'train_config.json'}: {why}"


def test_missing_tensorboard_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import sys

    # `import x` raises ImportError while sys.modules["x"] is None: as if it were not installed.
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=1, report_to="tensorboard")
    )
    rc, _, err = run_cli(capsys, "train", cfg)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert (
        lines[0]
        == "megatrain: error: report_to: tensorboard is not installed (pip install tensorboard, or report_to: none)"
    )
    assert not out.exists()


def _hf_model_dir(tmp_path: Path) -> Path:
    """A tiny Llama saved by transformers (vocab 97, max_position_embeddings 256), no tokenizer."""
    from helpers import tiny_hf_model

    tiny_hf_model("llama").save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_pretokenised_data_needs_no_tokenizer(tmp_path, capsys):
    base = make_run(tmp_path)  # ids below 97
    del base["model_config"]
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "run.yaml",
        dict(base, model_name_or_path=str(_hf_model_dir(tmp_path)), output_dir=str(out), max_steps=2),
    )
    rc, _, err = run_cli(capsys, "train", cfg)
    assert rc == 0, err
    assert (out / "final" / "model.safetensors").is_file() and not (out / "final" / "tokenizer.json").exists()
    # A tokenizer named explicitly must exist, and text data still needs one.
    rc, _, err = run_cli(
        capsys, "train", cfg, f"tokenizer_name_or_path={tmp_path}", f"output_dir={tmp_path / 'o2'}"
    )
    assert rc == 2 and f"tokenizer {tmp_path}: directory has no tokenizer.json" in err
    (tmp_path / "text.jsonl").write_text('{"text": "hello"}\n')
    rc, _, err = run_cli(
        capsys, "train", cfg, f"dataset={tmp_path / 'text.jsonl'}", f"output_dir={tmp_path / 'o2'}"
    )
    assert rc == 2 and "the text format needs a tokenizer (set tokenizer_name_or_path)" in err
    assert not (tmp_path / "o2").exists()


def test_no_carriage_returns_without_a_terminal(tmp_path, capsys):
    """Progress bars redraw with '\\r': without a terminal (a log file, CI) there must be none,
    from loading weights, tokenizing, training or saving."""
    base = make_run(tmp_path)
    del base["model_config"], base["disable_tqdm"]  # the default: decide by the terminal
    tiny_tokenizer("chatml").save_pretrained(tmp_path / "tok")
    out = tmp_path / "out"
    run = dict(
        base, model_name_or_path=str(_hf_model_dir(tmp_path)), tokenizer_name_or_path=str(tmp_path / "tok")
    )
    cfg = write_yaml(tmp_path / "run.yaml", dict(run, output_dir=str(out), max_steps=2, save_steps=1))
    capsys.readouterr()  # transformers' own bar from saving the model above
    rc, stdout, err = run_cli(capsys, "train", cfg)
    assert rc == 0, err
    assert "step 2/2 loss" in stdout  # log lines instead of a bar
    assert "\r" not in err + stdout
    rc, stdout, err = run_cli(capsys, "export", out / "checkpoint-2", tmp_path / "exported")
    assert rc == 0 and "\r" not in err + stdout


def test_doubtful_settings_are_warned_about(tmp_path, capsys):
    base = make_run(tmp_path)
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(tmp_path / "out"), max_steps=2))
    rc, stdout, _ = run_cli(capsys, "train", cfg, "max_length=300", "warmup_steps=2")
    assert rc == 0
    assert "megatrain: warning: max_length 300 is beyond the model's max_position_embeddings 256" in stdout
    assert (
        "megatrain: warning: warmup of 2 steps is not shorter than the run's 2 steps: the learning rate never reaches learning_rate 0.003"
        in stdout
    )
    rc, stdout, _ = run_cli(capsys, "train", cfg, "warmup_steps=1", f"output_dir={tmp_path / 'o2'}")
    assert rc == 0 and "warning" not in stdout


def test_a_zero_learning_rate_is_warned_about():
    """learning_rate 0 is legal (transformers and torch take it) but trains nothing: one warning,
    which train and plan print (config_warnings); any other rate, none."""
    from megatrain.checks import config_warnings

    model_cfg = ModelConfig.from_hf(tiny_config())
    zero = TrainConfig(model_config="unused", max_length=64, learning_rate=0)
    assert config_warnings(zero, model_cfg) == ["learning_rate is 0: the steps leave the weights as they are"]
    assert config_warnings(TrainConfig(model_config="unused", max_length=64), model_cfg) == []


# ---------------------------------------------------------------------------- version and help
def test_version(capsys):
    from importlib.metadata import version

    rc, stdout, _ = run_cli(capsys, "--version")
    assert rc == 0 and stdout.strip() == f"megatrain {version('megatrain')}"


def test_train_help_lists_every_config_key(capsys):
    from dataclasses import fields

    from megatrain.config import key_docs

    rc, stdout, _ = run_cli(capsys, "train", "--help")
    assert rc == 0
    docs = key_docs()
    keys = [f.name for f in fields(TrainConfig) if f.name != "extra"]
    assert sorted(docs) == sorted(keys)  # every key has a docstring
    flat = " ".join(stdout.split())
    for k in keys:
        assert re.search(rf"(^|\n)  {k}\b", stdout), k
        assert " ".join(docs[k].split()[:6]) in flat, k
    assert "max_length (default 1024)" in flat and "gpu_state (default auto)" in flat


# ---------------------------------------------------------------------------- chat models stop
@pytest.mark.parametrize("template,token", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>"), (None, None)])
def test_end_of_turn_token_from_the_template(template, token):
    from megatrain.data.chat import end_of_turn_id

    tok = tiny_tokenizer(template)
    assert end_of_turn_id(tok) == (tok.convert_tokens_to_ids(token) if token else None)


def test_exported_chat_model_stops_at_the_end_of_turn(tmp_path, capsys):
    """The template ends turns with <|im_end|>, the model's EOS is </s>: generate() must stop at
    <|im_end|>, which is what a model fine-tuned on these chats emits at the end of an answer."""
    import transformers

    from megatrain.io.weights import save_hf_checkpoint

    tok = tiny_tokenizer("chatml")
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    cfg = ModelConfig.from_hf(tiny_config("llama", vocab_size=640))
    mt = build_model(cfg, device="cpu")
    save_hf_checkpoint(mt.state, cfg, tmp_path / "final", dtype=torch.float32, tokenizer=tok, progress=False)
    rc, _, err = run_cli(capsys, "export", tmp_path / "final", tmp_path / "exported", "--dtype", "float32")
    assert rc == 0, err

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])

    class EndTurnThird(transformers.LogitsProcessor):
        """Two ordinary tokens (never an end), then the end of turn: as a chat model answers."""

        def __call__(self, input_ids, scores):
            scores[:, [eos, im_end]] = -float("inf")
            if input_ids.shape[1] == ids.shape[1] + 2:
                scores[:, im_end] = 1e9
            return scores

    for d in ("final", "exported"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d).eval()
        assert model.generation_config.eos_token_id == [eos, im_end]
        out = model.generate(
            ids, max_new_tokens=12, do_sample=False, logits_processor=[EndTurnThird()], pad_token_id=0
        )
        assert out.shape[1] == ids.shape[1] + 3 and out[0, -1] == im_end, (d, out)


def test_export_copies_a_tokenizer_it_cannot_load(tmp_path, capsys):
    """Export only reads the tokenizer for its chat template: one it cannot load (a slow-only
    tokenizer, say) is copied as before, not refused."""
    from megatrain.io.weights import save_hf_checkpoint

    cfg = ModelConfig.from_hf(tiny_config("llama"))
    save_hf_checkpoint(build_model(cfg, device="cpu").state, cfg, tmp_path / "m", progress=False)
    (tmp_path / "m" / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    rc, _, err = run_cli(capsys, "export", tmp_path / "m", tmp_path / "out")
    assert rc == 0, err
    assert (
        tmp_path / "out" / "tokenizer_config.json"
    ).read_text() == '{"tokenizer_class": "NoSuchTokenizer"}'


def test_bad_input_is_answered_before_torch_loads(tmp_path):
    """`train --help`, an unknown key, a bad value, a missing config file, dataset or local model
    directory: each answered (exit 0 or 2) before torch or transformers is imported, so in about a
    second, not the ten that importing them takes on a busy machine. One interpreter runs every case in turn and says,
    after each, whether either library was imported."""
    import subprocess
    import sys

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    cfg = write_yaml(tmp_path / "run.yaml", {"model_config": str(tmp_path), "dataset": str(data)})
    missing = str(tmp_path / "no-model")  # a local path's form, not a Hub repository's
    no_model = write_yaml(tmp_path / "none.yaml", {"model_name_or_path": missing, "dataset": str(data)})
    cases = [
        ["train", "--help"],
        ["train", cfg, "learning_rat=1"],
        ["train", cfg, "learning_rate=-1"],
        ["train", cfg, "lr_scheduler_type=step"],
        ["train", cfg, "truncation=cut"],
        ["train", cfg, "nproc_per_node=0"],
        ["train", cfg, "eval_strategy=sometimes"],
        ["train", str(tmp_path / "missing.yaml")],
        ["train", cfg, f"dataset={tmp_path / 'missing.jsonl'}"],
        ["train", no_model],
        ["train", cfg, f"tokenizer_name_or_path={missing}"],
        ["plan", cfg, "max_steps=0"],
    ]
    driver = (
        "import contextlib, io, json, sys\n"
        "from megatrain.cli import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            rc = main(argv)\n"
        "        except SystemExit as e:\n"
        "            rc = e.code\n"
        "    print(rc, 'torch' in sys.modules or 'transformers' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver, json.dumps([[str(a) for a in c] for c in cases])],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    answers = proc.stdout.split("\n")[: len(cases)]
    assert answers == ["0 False"] + ["2 False"] * (len(cases) - 1), list(zip(cases, answers))


def test_the_time_to_the_first_step_is_told_by_part(tmp_path, capsys, monkeypatch):
    """Before step 1 the run says how long the command took to get there, and where it went: a
    slow weight initialisation shows in its own part, and the parts add up to the total."""
    import time

    import megatrain.runtime as runtime

    slow = runtime.init_random

    def slow_init(*a, **kw):
        time.sleep(0.6)
        return slow(*a, **kw)

    monkeypatch.setattr(runtime, "init_random", slow_init)
    import megatrain.trainer as trainer

    plan = trainer.preflight

    def slow_plan(*a, **kw):
        time.sleep(0.4)
        return plan(*a, **kw)

    monkeypatch.setattr(trainer, "preflight", slow_plan)
    base = make_run(tmp_path)
    train(TrainConfig(**base, output_dir=str(tmp_path / "out"), max_steps=1, save_strategy="no"))
    out, err = capsys.readouterr()
    line = next(ln for ln in (out + err).splitlines() if "ready for step 1" in ln)
    total = float(re.search(r"ready for step 1 ([\d.]+) s after the command", line).group(1))
    parts = dict((k.strip(), float(v)) for k, v in re.findall(r"(?:: |, )([a-z ]+?) ([\d.]+)(?=,|$)", line))
    assert parts["the random weights"] >= 0.6, line
    assert parts["the memory plan"] >= 0.4 and parts.get("the inputs", 0.0) < 0.4, line  # apart
    assert "imports and the command line" in parts, line  # (parts under 0.05 s are left out)
    assert abs(sum(parts.values()) - total) <= 0.05 * len(parts) + 0.1, line  # each part is rounded

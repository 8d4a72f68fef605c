"""`megatrain` command line: train, export, plot, plan, chat.

Exit codes: 0 done; 1 training diverged (non-finite steps), or `plan` says the run does not
fit; 2 bad input (one line "megatrain: error: ..." naming the key, file or line); 130 / 143 a run
stopped by SIGINT / SIGTERM (after saving a checkpoint, or at once on a second signal; see
guard.py).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from . import CUDA_ALLOC_CONF, OMP_WAIT_POLICY
from .errors import MegatrainError
from .guard import Aborted, TrainingInterrupted


class _Parser(argparse.ArgumentParser):
    lists_keys = False
    """Whether --help ends with the configuration keys (train, plan)."""

    def error(self, message: str):
        # One line, like every other error, instead of argparse's usage block.
        print(f"megatrain: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)

    def format_help(self) -> str:
        # Built on demand: reading the keys imports the config (and torch), which `megatrain
        # --version` and the other commands' help should not wait for.
        return super().format_help() + (_keys_help() if self.lists_keys else "")


def _keys_help() -> str:
    """The configuration keys with their defaults and docstrings, from TrainConfig itself."""
    import dataclasses
    import textwrap

    from .config import TrainConfig, key_docs
    from .configdocs import default_text

    docs = key_docs()
    lines = ["", "configuration keys (in the YAML file, or as key=value overrides):"]
    for f in dataclasses.fields(TrainConfig):
        if f.name not in docs:
            continue
        default = default_text(f)
        lines.append(f"  {f.name}{f' (default {default})' if default else ''}")
        lines += textwrap.wrap(docs[f.name], width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatrain")
    except PackageNotFoundError:  # running from a source tree that is not installed
        from . import __version__

        return __version__


def _size(text: str) -> int:
    from .config import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def _train(args) -> int:
    from .config import TrainConfig

    cfg = TrainConfig.load(args.config, args.overrides)  # bad keys stop here, before any launch
    _check_files(cfg)
    from .devices import check_devices, in_world, resolve_device

    nproc = cfg.world().ranks  # nnodes > 1: simulated machines, all on this one
    if nproc > 1 and not in_world():
        from .parallel.launch import launch

        check_devices(resolve_device(cfg.device), nproc)
        return launch(args.config, args.overrides, nproc)
    from .trainer import train

    train(cfg)
    return 0


def _check_files(cfg) -> None:
    """The dataset files and local model paths a run reads, found (their owner's errors) before
    torch loads: a missing one answers at once (a Hub name is asked for later)."""
    from pathlib import Path

    from . import hub
    from .config import DATASET_KEYS
    from .data.sources import resolve_dataset
    from .errors import ConfigError

    cfg.require_dataset()
    for key in DATASET_KEYS:
        if getattr(cfg, key) is not None:
            resolve_dataset(cfg, key)
    for key in hub.MODEL_KEYS:
        name = getattr(cfg, key)
        if name is not None and not Path(name).exists() and not hub.is_hub_name(name):
            raise ConfigError(f"{key}: {name}: no such file or directory")


def _export(args) -> int:
    import torch

    from .io.weights import export_model
    from .metrics import show_progress

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    progress = show_progress(None)  # on a terminal only
    out, verified = export_model(
        args.checkpoint,
        args.out,
        dtype=dtype,
        max_shard_bytes=args.max_shard_size,
        progress=progress,
        overwrite=args.overwrite,
    )
    checked = "its source's checksums verified" if verified else "the source has no checksums to verify"
    print(f"megatrain: exported {out} ({args.dtype}; {checked})")
    return 0


def _plot(args) -> int:
    from .plot import plot_metrics

    print(f"megatrain: wrote {plot_metrics(args.output_dir, args.out, args.overwrite)}")
    return 0


def _chat(args) -> int:
    from .talk import Chat, converse, find_tokenizer, is_vision_model, load_model, model_dir

    directory = model_dir(args.model)
    tokenizer = find_tokenizer(directory, args.tokenizer)
    processor = None
    if is_vision_model(directory):  # its processor renders the conversation and its images
        from .data.vision import load_processor

        processor = load_processor(args.tokenizer or directory)
        tokenizer = processor.tokenizer
    elif args.image:
        raise MegatrainError(f"--image: {directory} is a text model (images need a vision-language one)")
    templated = getattr(processor or tokenizer, "chat_template", None)
    if args.system is not None and (args.raw or not templated):
        why = "which --raw leaves out" if args.raw else "and the tokenizer has none"
        raise MegatrainError(f"--system: a system message needs the chat template, {why}")
    if not args.raw and not templated:
        print(
            "megatrain: the tokenizer has no chat template: the text is continued as it is", file=sys.stderr
        )
    model = load_model(directory, args.device, args.dtype)
    chat = Chat(
        model,
        tokenizer,
        raw=args.raw,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        processor=processor,
    )
    for image in args.image or []:
        chat.attach(image)
    if args.prompt is not None:
        chat.answer(args.prompt)
    elif sys.stdin.isatty():
        converse(chat)
    else:  # text piped in: one answer, as --prompt
        chat.answer(sys.stdin.read().rstrip("\n"))
    return 0


def _number(kind: type, low: float, high: float | None = None, closed: bool = True):
    """An argparse type: a number of `kind` >= `low` (> `low` unless `closed`), <= `high`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low or (not closed and value == low) or (high is not None and value > high):
            span = f"{'>=' if closed else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text!r}: must be {span}")
        return value

    return parse


def _plan(args) -> int:
    from .config import TrainConfig

    cfg = TrainConfig.load(args.config, args.overrides)  # bad keys stop here, before torch loads
    import torch

    from . import plan, planreport
    from .checks import config_warnings
    from .determinism import full_determinism
    from .io.pretrained import local_models
    from .models.config import ModelConfig
    from .stages import stage_model

    cfg = local_models(cfg, weights=False)  # config.json is enough
    model_cfg = stage_model(cfg, ModelConfig.from_json(cfg.model_name_or_path or cfg.model_config), None)
    # Plan for the device the config names, even where it is not present (a login node): the
    # budgets then come from max_gpu_memory / max_host_memory.
    kind = (
        cfg.device.split(":")[0] if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if kind not in ("cpu", "cuda"):
        raise MegatrainError(f"device: {cfg.device!r} is not supported (auto, cpu, cuda, cuda:N)")
    name = cfg.device if cfg.device != "auto" else kind
    if kind == "cuda" and not torch.cuda.is_available():
        name = "cuda"
    dtype = {"auto": "bfloat16" if kind == "cuda" else "float32"}.get(cfg.compute_dtype, cfg.compute_dtype)
    compute_bytes = 2 if dtype == "bfloat16" else 4
    # The layer measured as the run will run it (layer_mem: None without a device), its tiled
    # layer where a plan below asks for it (probe.LayerProbe): measured as train would, too.
    with full_determinism(cfg.full_determinism):
        machine, layer_mem = plan.measured(model_cfg, cfg, name, compute_bytes)
        data = plan.data_bytes(cfg)
        result = plan.check(model_cfg, cfg, machine, compute_bytes, data, layer_mem)
        for warning in config_warnings(cfg, model_cfg):  # as train warns
            print(f"megatrain: warning: {warning}")
        print(planreport.report(model_cfg, result, name, dtype, cfg, data))
        if result.fits:
            print(planreport.limits_line(model_cfg, cfg, result.machine, compute_bytes, layer_mem))
        print(planreport.context_line(model_cfg, cfg, result.machine, compute_bytes, layer_mem))
    return 0 if result.fits else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="megatrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"megatrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a model: megatrain train CONFIG.yaml [key=value ...]")
    p.add_argument("config", help="YAML config file (Hugging Face TrainingArguments names)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, values parsed as YAML")
    p.set_defaults(func=_train)
    p.lists_keys = True

    p = sub.add_parser("export", help="write a Hugging Face model from a checkpoint directory")
    p.add_argument(
        "checkpoint", help="output_dir/checkpoint-N (or any directory with config.json + safetensors)"
    )
    p.add_argument("out", help="a new (or empty) directory to write, atomically")
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it is a previous export (nothing else)"
    )
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weight dtype (bfloat16)"
    )
    p.add_argument(
        "--max-shard-size", type=_size, default="5GB", help="largest safetensors file, e.g. 2GB (5GB)"
    )
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "plot", help="draw loss, learning rate, grad norm and tokens/s to a PNG (or JPEG, SVG, PDF)"
    )
    p.add_argument("output_dir", help="a training output_dir (reads its metrics.jsonl)")
    p.add_argument(
        "--out",
        help="file to write: .png, .jpg, .svg or .pdf, by its suffix (default OUTPUT_DIR/training.png)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it is a plot megatrain wrote, unchanged since (nothing else)",
    )
    p.set_defaults(func=_plot)

    p = sub.add_parser("chat", help="talk to a trained model: megatrain chat MODEL_DIR [--prompt TEXT]")
    p.add_argument(
        "model", metavar="MODEL_DIR", help="a run's final/ (or its output_dir), an export, or a checkpoint-N"
    )
    p.add_argument(
        "--prompt", metavar="TEXT", help="answer TEXT once and exit (as text piped into stdin does)"
    )
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation")
    p.add_argument(
        "--max-new-tokens",
        metavar="N",
        type=_number(int, 1),
        default=256,
        help="longest answer, in tokens (256)",
    )
    p.add_argument(
        "--temperature",
        metavar="T",
        type=_number(float, 0.0),
        help="0: greedy; above: sampling (default: the model's generation_config.json)",
    )
    p.add_argument(
        "--top-p", metavar="P", type=_number(float, 0.0, 1.0, closed=False), help="nucleus sampling mass"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="auto: bfloat16 on CUDA, else float32",
    )
    p.add_argument(
        "--tokenizer", metavar="PATH", help="a tokenizer directory, where MODEL_DIR and its run have none"
    )
    p.add_argument("--raw", action="store_true", help="continue the text as it is, without the chat template")
    p.add_argument(
        "--image",
        metavar="PATH",
        action="append",
        help="an image with the first message (a vision-language model; repeatable)",
    )
    p.set_defaults(func=_chat)

    p = sub.add_parser("plan", help="estimate host and GPU memory of a run before starting it")
    p.add_argument("config", help="YAML config file, as for train")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, as for train")
    p.set_defaults(func=_plan)
    p.lists_keys = True
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)  # before torch starts
    if "torch" not in sys.modules:  # OpenMP reads it as torch loads; later it would only mislead
        os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)  # runtime.cpu_threads
    args = build_parser().parse_args(argv)
    # In a data-parallel world every rank meets the same errors: the first one reports them.
    rank = int(os.environ.get("RANK", "0"))
    say = (lambda text: print(text, file=sys.stderr)) if rank == 0 else (lambda text: None)
    try:
        return args.func(args)
    except TrainingInterrupted as e:
        say(f"megatrain: {e}")
        return e.exit_code
    except MegatrainError as e:
        text = " ".join(str(e).split())  # one line, whatever a library put in the message
        print(f"megatrain: error: {'' if rank == 0 else f'rank {rank}: '}{text}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except Aborted as e:
        print(f"megatrain: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("megatrain: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        # Saves and exports say more (writing.AtomicDir); this catches the small files, and a
        # file system that turns read-only (or a permission taken away) in the middle of a run.
        verb = "cannot access" if e.errno in (errno.EACCES, errno.EPERM) else "cannot write"  # reads too
        where = f"{verb} {e.filename}" if e.filename else verb
        print(f"megatrain: error: {where}: {e.strerror}", file=sys.stderr)
        return 2
    except Exception as e:
        lost = _lost_peer(e)
        if lost is None:
            raise
        first = (str(lost).strip().splitlines() or [type(lost).__name__])[0][:300]
        print(
            f"megatrain: error: rank {rank}: another rank stopped or did not answer ({first})",
            file=sys.stderr,
        )
        return 1


def _lost_peer(e: BaseException | None) -> BaseException | None:
    """The failed collective behind `e` (the optimizer thread's, too) in a data-parallel world: a
    rank died, or a timeout passed. None for any other error."""
    dist = sys.modules.get("torch.distributed")
    if "WORLD_SIZE" not in os.environ or dist is None:
        return None
    while e is not None:
        if isinstance(e, dist.DistError) or "gloo" in str(e).lower() or "nccl" in str(e).lower():
            return e
        e = e.__cause__
    return None


if __name__ == "__main__":
    sys.exit(main())

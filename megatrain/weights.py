"""Hugging Face checkpoints in and out: safetensors read one unit at a time straight into the
host master weights, and written back as sharded safetensors with an index.

Reading never builds the model: each tensor is memory-mapped by safetensors, converted to fp32
into its place in `HostState.master`, and dropped, so peak host memory is the state plus one
tensor. Writing streams the same way (`write_safetensors`): the header is computed from the
shapes, then each tensor is converted and appended, so fp32 master weights are written straight
from host memory and an export never holds a second copy of the model.

Every directory is written atomically: into a dot-named temporary sibling, fsynced, renamed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from .errors import CheckpointError, ConfigError
from .models.config import ModelConfig
from .state import HostState, build_units

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_dir: str | Path, prefix: str = "model") -> dict[str, Path]:
    """Map every tensor key to the safetensors file holding it (`{prefix}.safetensors`, or the
    shards named by `{prefix}.safetensors.index.json`)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: model directory does not exist")
    index, single = d / f"{prefix}.safetensors.index.json", d / f"{prefix}.safetensors"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            files = {k: d / f for k, f in wm.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index}: names {f.name}, which does not exist")
        return files
    if single.is_file():
        with _open_safetensors(single) as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(f"{d}: no {single.name} or {index.name} (only safetensors checkpoints are read)")


def _open_safetensors(path: Path):
    """safe_open, with a corrupt or truncated file reported as a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # SafetensorError, OSError: the header does not match the file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


class TensorReader:
    """Reads tensors by key from a set of safetensors files, each opened once, lazily."""

    def __init__(self, files: dict[str, Path], where: str | Path):
        self.files, self.where = files, where  # `where` names the checkpoint in errors
        self._handles: dict[Path, object] = {}

    def _handle(self, key: str):
        path = self.files[key]
        if path not in self._handles:
            self._handles[path] = _open_safetensors(path)
        return self._handles[path]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name, e.g. F32 or BF16."""
        return self._handle(key).get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handle(key).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.files[key]}: cannot read {key} ({e})") from None

    def check(self, key: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
        """Raise a CheckpointError naming the file unless `key` exists with this shape (and dtype)."""
        if key not in self.files:
            raise CheckpointError(f"{self.where}: tensor {key} is missing")
        if self.shape(key) != shape:
            raise CheckpointError(
                f"{self.files[key]}: {key} has shape {self.shape(key)}, config.json implies {shape}"
            )
        if dtype is not None and self.dtype(key) != dtype:
            raise CheckpointError(f"{self.files[key]}: {key} is {self.dtype(key)}, expected {dtype}")

    def close(self) -> None:
        self._handles.clear()


def load_hf_weights(state: HostState, model_dir: str | Path, cfg: ModelConfig, progress=True) -> None:
    """Fill `state.master` from a Hugging Face safetensors checkpoint, units in parallel threads
    (reading, and converting to fp32, release the GIL)."""
    reader = TensorReader(checkpoint_files(model_dir), model_dir)
    for unit in state.units:  # every tensor present with its shape before anything is read
        for p in unit.params:
            reader.check(p.key, p.shape)

    def load(unit) -> None:
        views = state.params(unit)
        for p in unit.params:
            views[p.name].copy_(reader.get(p.key))

    try:
        _per_unit(load, state.units, "loading weights", progress)
    finally:
        reader.close()


def _per_unit(fn, units, desc: str, progress: bool) -> None:
    """fn(unit) for every unit on a thread pool, with a progress bar; the first error is raised."""
    workers = min(len(units), os.cpu_count() or 1, 32)
    with (
        ThreadPoolExecutor(workers) as pool,
        tqdm(total=len(units), desc=desc, disable=not progress, unit="unit") as bar,
    ):
        for fut in as_completed([pool.submit(fn, u) for u in units]):
            fut.result()
            bar.update(1)


def init_random(state: HostState, cfg: ModelConfig, seed: int, progress: bool = False) -> None:
    """Hugging Face's initialisation: N(0, initializer_range) for linear and embedding weights,
    zeros for biases, ones for norms. Each unit draws from its own generator seeded from `seed`
    and its index, so units fill in parallel threads and the result depends on the seed alone."""
    std = getattr(cfg.hf_config, "initializer_range", 0.02) or 0.02

    def fill(unit) -> None:
        gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
        views = state.params(unit)
        for p in unit.params:
            v = views[p.name]
            if "norm" in p.name:
                v.fill_(1.0)
            elif p.name.endswith("bias"):
                v.zero_()
            else:
                v.normal_(0.0, std, generator=gen)

    _per_unit(fill, state.units, "initialising weights", progress)


def _atomic_dir(out_dir: Path):
    """A temporary sibling directory that replaces `out_dir` on success. Its name starts with a
    dot, so nothing that looks for `checkpoint-N` or `final` can mistake it for one."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0o022)  # mkdtemp makes the directory private; give it the usual mode
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_dir(tmp: Path, out_dir: Path) -> None:
    """fsync everything in `tmp`, then swap it into place as `out_dir`."""
    _fsync_dir(tmp)
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ writing safetensors
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, get) -> int:
    """Write one safetensors file, one tensor at a time: `get(key)` is called for each entry in
    order and its result converted to `dtype` and appended, so peak memory is one tensor (none
    for fp32 views of the master weights, which are written in place). Returns the data bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for key, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for key, shape in entries:
            t = get(key).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: shape {tuple(t.shape)}, announced {shape}")
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return off


def write_sharded(
    out_dir: Path,
    prefix: str,
    entries: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    get,
    max_shard_bytes: int,
    progress: bool = False,
) -> list[str]:
    """`{prefix}.safetensors`, or shards `{prefix}-0000i-of-0000N.safetensors` plus
    `{prefix}.safetensors.index.json` when the tensors exceed `max_shard_bytes`, as
    transformers writes them. Shards are planned from the shapes first, so each is streamed.
    Returns the file names written."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for key, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += nbytes
    n = len(shards)
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(tqdm(shards, desc=f"saving {prefix}", disable=not progress, unit="shard")):
        fname = f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        total += write_safetensors(out_dir / fname, shard, dtype, get)
        weight_map.update({k: fname for k, _ in shard})
        names.append(fname)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def write_model_config(
    out_dir: Path, cfg: ModelConfig, dtype: torch.dtype, generation_from: Path | None = None, tokenizer=None
) -> None:
    """config.json (with `architectures` and the weights' dtype) and generation_config.json:
    copied from `generation_from` when that directory has one (it carries the model's EOS ids
    and sampling defaults), else derived from the model config. When `tokenizer` has a chat
    template, the token that ends its assistant turns joins the EOS ids, so `generate()` stops
    where a chat model ends its answer."""
    hf = copy.deepcopy(cfg.hf_config)
    hf.architectures = [type_to_arch(cfg.model_type)]
    if isinstance(inspect.getattr_static(type(hf), "torch_dtype", None), property):
        hf.dtype = dtype  # transformers 5.x; `torch_dtype` is a deprecated alias there
    else:
        hf.torch_dtype = dtype
    hf.save_pretrained(out_dir)
    src = Path(generation_from) / "generation_config.json" if generation_from else None
    if src is not None and src.is_file():
        shutil.copyfile(src, out_dir / "generation_config.json")
    else:
        with contextlib.suppress(Exception):  # models without generation defaults have none
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf).save_pretrained(out_dir)
    if tokenizer is not None:
        from .data.chat import end_of_turn_id

        eot = end_of_turn_id(tokenizer)
        if eot is not None:
            _add_eos(out_dir / "generation_config.json", eot, getattr(hf, "eos_token_id", None))


def _add_eos(path: Path, token_id: int, default) -> None:
    """Add `token_id` to generation_config.json's eos_token_id, a list as transformers writes it
    for chat models (`default`, the model config's EOS, when the file names none)."""
    gen = json.loads(path.read_text()) if path.is_file() else {}
    eos = gen.get("eos_token_id", default)
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    if token_id not in eos:
        gen["eos_token_id"] = [*eos, token_id]
        path.write_text(json.dumps(gen, indent=2) + "\n")


def save_hf_checkpoint(
    state: HostState,
    cfg: ModelConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
    tokenizer=None,
    progress: bool = True,
    generation_from: str | Path | None = None,
) -> Path:
    """Write a Hugging Face model directory (sharded safetensors + index, config.json,
    generation_config.json, tokenizer files) atomically: either the whole directory appears or
    nothing changes. Call `transport.synchronize()` first on CUDA."""
    out_dir = Path(out_dir)
    tmp = _atomic_dir(out_dir)
    try:
        params = dict(state.named_parameters())
        entries = [(k, tuple(v.shape)) for k, v in params.items()]
        write_sharded(tmp, "model", entries, dtype, params.__getitem__, max_shard_bytes, progress)
        write_model_config(tmp, cfg, dtype, Path(generation_from) if generation_from else None, tokenizer)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# Everything transformers' AutoTokenizer may read, chat templates included.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def export_model(
    src: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = True,
) -> Path:
    """Export a checkpoint (or any model directory with config.json + safetensors) as a Hugging
    Face model in `dtype`, atomically. Tensors are read one at a time from the memory-mapped
    source and written straight out: peak memory is one tensor, no GPU needed. Every tensor the
    config implies is checked (presence, shape) before anything is written."""
    src, out_dir = Path(src), Path(out_dir)
    if not src.is_dir():
        raise CheckpointError(f"{src}: checkpoint directory does not exist")
    if src.resolve() == out_dir.resolve():
        raise CheckpointError(f"{out_dir}: the output directory must differ from the checkpoint")
    cfg = ModelConfig.from_json(src)
    from .data.tokenizer import load_tokenizer  # only for the chat template's end-of-turn token

    try:
        tokenizer = load_tokenizer(src, optional=True)
    except ConfigError:
        tokenizer = None  # e.g. a slow-only tokenizer: its files are still copied as they are
    reader = TensorReader(checkpoint_files(src), src)
    entries = [(p.key, p.shape) for u in build_units(cfg) for p in u.params]
    try:
        for key, shape in entries:
            reader.check(key, shape)
        tmp = _atomic_dir(out_dir)
        try:
            write_sharded(tmp, "model", entries, dtype, reader.get, max_shard_bytes, progress)
            write_model_config(tmp, cfg, dtype, src, tokenizer)
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copyfile(src / name, tmp / name)
            commit_dir(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        reader.close()
    return out_dir


def type_to_arch(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }[model_type]

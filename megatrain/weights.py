"""Hugging Face checkpoints in and out: safetensors read one unit at a time straight into the
host master weights, and written back as sharded safetensors with an index.

Reading never builds the model: each tensor is memory-mapped by safetensors, converted to fp32
into its place in `HostState.master`, and dropped, so peak host memory is the state plus one
tensor.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .errors import CheckpointError
from .models.config import ModelConfig
from .state import HostState

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor key to the safetensors file holding it."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: model directory does not exist")
    if (d / INDEX).is_file():
        try:
            wm = json.loads((d / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{d / INDEX}: malformed index ({e})") from None
        files = {k: d / f for k, f in wm.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{d / INDEX}: names {f.name}, which does not exist")
        return files
    if (d / SINGLE).is_file():
        with safe_open(d / SINGLE, framework="pt") as f:
            return {k: d / SINGLE for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(f"{d}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")


def load_hf_weights(state: HostState, model_dir: str | Path, cfg: ModelConfig, progress=True) -> None:
    """Fill `state.master` from a Hugging Face safetensors checkpoint, unit by unit."""
    files = checkpoint_files(model_dir)
    handles: dict[Path, object] = {}
    try:
        for unit in tqdm(state.units, desc="loading weights", disable=not progress, unit="unit"):
            views = state.params(unit)
            for p in unit.params:
                if p.key not in files:
                    raise CheckpointError(f"{model_dir}: tensor {p.key} is missing from the checkpoint")
                path = files[p.key]
                if path not in handles:
                    handles[path] = safe_open(path, framework="pt")
                t = handles[path].get_tensor(p.key)
                if tuple(t.shape) != p.shape:
                    raise CheckpointError(
                        f"{path}: {p.key} has shape {tuple(t.shape)}, config.json implies {p.shape}"
                    )
                views[p.name].copy_(t)
    finally:
        handles.clear()


def init_random(state: HostState, cfg: ModelConfig, seed: int) -> None:
    """Hugging Face's initialisation: N(0, initializer_range) for linear and embedding weights,
    zeros for biases, ones for norms. Deterministic per seed, one unit at a time."""
    std = getattr(cfg.hf_config, "initializer_range", 0.02) or 0.02
    # A seed per unit; the default generator samples several times faster than a private one.
    with torch.random.fork_rng(devices=[]):
        for unit in state.units:
            torch.manual_seed(seed * 100_003 + unit.index)
            views = state.params(unit)
            for p in unit.params:
                v = views[p.name]
                if "norm" in p.name:
                    v.fill_(1.0)
                elif p.name.endswith("bias"):
                    v.zero_()
                else:
                    v.normal_(0.0, std)


def _atomic_dir(out_dir: Path):
    """A temporary sibling directory that replaces `out_dir` on success."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


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


def save_hf_checkpoint(
    state: HostState,
    cfg: ModelConfig,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer=None,
    progress: bool = True,
) -> Path:
    """Write a Hugging Face model directory (sharded safetensors + index, config.json,
    generation_config.json, tokenizer files) atomically: either the whole directory appears or
    nothing changes."""
    out_dir = Path(out_dir)
    tmp = _atomic_dir(out_dir)
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key, v in state.named_parameters():
            nbytes = v.numel() * dtype.itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = v
            size += nbytes
        n = len(shards)
        weight_map, total = {}, 0
        for i, shard in enumerate(tqdm(shards, desc="saving", disable=not progress, unit="shard")):
            fname = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tensors = {k: v.to(dtype).contiguous() for k, v in shard.items()}
            save_file(tensors, tmp / fname, metadata={"format": "pt"})
            for k, t in tensors.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
            del tensors
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        hf = copy.deepcopy(cfg.hf_config)
        hf.architectures = [type_to_arch(cfg.model_type)]
        hf.torch_dtype = dtype  # transformers 4.x name; 5.x reads `dtype` and maps this to it
        hf.save_pretrained(tmp)
        with contextlib.suppress(Exception):  # models without generation defaults have none
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def type_to_arch(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }[model_type]

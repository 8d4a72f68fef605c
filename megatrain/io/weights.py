"""Hugging Face checkpoints in and out: safetensors read one unit at a time straight into the
host master weights, and written back as sharded safetensors with an index.

Reading never builds the model: each tensor is memory-mapped by safetensors, split into the
halves of the fp32 master weights in their place in the host state, and dropped, so peak host memory is the state plus one
tensor (reader.py reads whole tensors and a partitioned checkpoint's segments alike; a state
holding a part of the model reads only what falls in its part). Writing streams the same way
(writing.AtomicDir.write_tensors): the header is computed from the shapes, then each tensor is
converted and appended, so the master weights are written straight from host memory (in bf16
their halves' `hi` as it is, in fp32 joined a tensor at a time) and an
export never holds a second copy of the model. Every directory is written atomically, with a
checksum manifest (manifest.py).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import CheckpointError, ConfigError, OutputError
from ..host.split import cast
from ..host.state import HostState, build_units, checkpoint_entries, tensor_entries
from ..models.config import ModelConfig
from ..models.score import SCORE, classification_class
from . import manifest
from .reader import INDEX, TensorReader, checkpoint_files
from .writing import AtomicDir


def load_hf_weights(
    state: HostState,
    model_dir: str | Path,
    cfg: ModelConfig,
    progress=True,
    seed: int = 0,
    gate: Gate | None = None,
) -> None:
    """Fill the master weights of `state` (the part of the model it holds) from a Hugging Face safetensors
    checkpoint or a partitioned checkpoint, units in parallel threads (reading, and converting to
    fp32, release the GIL). A reward model read from a causal LM's checkpoint gets a new score
    head (`new_score`, of `seed`). `gate`: a fill beside other work (`Gate`): a tensor at a time."""
    reader = TensorReader(checkpoint_files(model_dir), model_dir)
    fresh = new_score(cfg, seed) if cfg.num_labels and SCORE not in reader.files else {}
    for key, shape in checkpoint_entries(state.units):  # all present, right shapes, before reading
        if key not in fresh:
            reader.check(key, shape)

    def read(key: str, a: int, b: int) -> torch.Tensor:
        return fresh[key].reshape(-1)[a:b] if key in fresh else reader.get_range(key, a, b)

    def load(unit) -> None:  # each tensor a parameter, or one expert's block of one
        for entry in tensor_entries(unit):
            with _piece(gate):
                state.load(unit, "master", [entry], read)

    try:
        _per_unit(load, state.units, "loading weights", progress, gate)
    finally:
        reader.close()


def new_score(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A reward model's score head where its checkpoint has none (a causal LM's): drawn as
    transformers initialises a new `score` Linear, N(0, initializer_range), from `seed`."""
    std = getattr(cfg.hf_config, "initializer_range", 0.02) or 0.02
    gen = torch.Generator().manual_seed(seed)
    return {SCORE: torch.empty(cfg.num_labels, cfg.hidden_size).normal_(0.0, std, generator=gen)}


# Elements of a parameter drawn at a time (a multiple of 16: see `draw_chunks`), so a unit's
# draws and their split into the halves stay in cache and no parameter-sized fp32 copy is made.
DRAW = 1 << 18


class Gate:
    """How a fill on threads of its own (runtime.WeightsFill) gives way to work beside it:
    `stop` skips the units not begun; `quiet()` holds every worker between two pieces of work (a
    chunk drawn, a tensor read) and begins once none is inside one, so that what it times (the
    probe's layer) runs on a host the fill leaves alone."""

    def __init__(self):
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        self._held = self._busy = 0

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def held(self) -> bool:
        """Inside a `quiet()`."""
        return self._held > 0

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopped.set()
            self._cond.notify_all()

    @contextlib.contextmanager
    def piece(self) -> Iterator[None]:
        """A worker's piece of work: it waits while the gate is held quiet (not once stopped)."""
        with self._cond:
            while self._held and not self.stopped:
                self._cond.wait()
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No piece of work runs inside: the pieces in hand finish first, the next wait for its end."""
        with self._cond:
            self._held += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()


def _piece(gate: Gate | None):
    return gate.piece() if gate is not None else contextlib.nullcontext()


def _per_unit(fn, units, desc: str, progress: bool, gate: Gate | None = None) -> None:
    """fn(unit) for every unit on a thread pool, the largest first (the last to start is then a
    small one: the pool's wall time is near the units' total over its threads), with a progress
    bar; the first error is raised; once `gate` is stopped, the units not begun are skipped. Each
    unit's torch ops run on the cores the pool leaves per thread (one where units outnumber
    cores): a thread per unit and an OpenMP team per op would put the cores' square of threads
    on them."""
    cores = os.cpu_count() or 1
    workers = min(len(units), cores, 32)
    order = sorted(units, key=lambda u: -u.numel)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, cores // workers)))  # the pool's threads inherit it
    try:
        with (
            ThreadPoolExecutor(workers) as pool,
            tqdm(total=len(units), desc=desc, disable=not progress, unit="unit") as bar,
        ):
            for fut in as_completed([pool.submit(_unless, gate, fn, u) for u in order]):
                fut.result()
                bar.update(1)
    finally:
        torch.set_num_threads(threads)


def _unless(gate: Gate | None, fn, unit) -> None:
    if gate is None or not gate.stopped:
        fn(unit)


def draw_chunks(n: int, chunk: int = DRAW) -> list[tuple[int, int]]:
    """[a, b) ranges of `n` elements that torch's CPU `normal_` fills, one after the other from one
    generator, with the same numbers as one call on all `n`: it draws a uniform per element, turns
    each 16 in place into normals and, where `n` is no multiple of 16, draws the last 16 again. So
    every range but the last is a multiple of 16 (`chunk` is), and the last at least 16 long
    (tests/test_startup.py holds it)."""
    bounds = list(range(0, n, chunk)) + [n]
    if len(bounds) > 2 and n - bounds[-2] < 16:
        del bounds[-2]
    return list(zip(bounds[:-1], bounds[1:]))


def init_random(
    state: HostState, cfg: ModelConfig, seed: int, progress: bool = False, gate: Gate | None = None
) -> None:
    """Hugging Face's initialisation: N(0, initializer_range) for linear and embedding weights,
    zeros for biases, ones for norms. Each unit draws from its own generator seeded from `seed`
    and its index, so units fill in parallel threads and the result depends on the seed alone;
    a parameter is drawn `DRAW` elements at a time, each split into the halves at once (the same
    numbers as drawn whole: `draw_chunks`). Other families are initialised by transformers' own
    rules (Gemma's norms are zero-centred, for one), a unit at a time (see `fills_apart`).
    `gate`: a fill beside other work (`Gate`): a chunk at a time."""
    if not fills_apart(cfg, None):
        return _init_as_transformers(state, cfg, seed, progress)
    std = getattr(cfg.hf_config, "initializer_range", 0.02) or 0.02

    def fill(unit) -> None:
        gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
        buf = torch.empty(DRAW + 16)
        for p in unit.params:
            # Drawn whole, also where the state holds a part of it, so every part holds the
            # numbers the whole state would (and the generator moves on as far).
            for a, b in draw_chunks(p.numel, DRAW):
                with _piece(gate):
                    _draw(buf[: b - a], p.name, std, gen)
                    state.load(unit, "master", [(p.key, p.offset + a, (b - a,))], lambda k, i, j: buf[i:j])

    _per_unit(fill, state.units, "initialising weights", progress, gate)


def _draw(v: torch.Tensor, name: str, std: float, gen: torch.Generator) -> None:
    """One chunk of parameter `name` as Hugging Face initialises it."""
    if "norm" in name:
        v.fill_(1.0)
    elif name.endswith("bias"):
        v.zero_()
    else:
        v.normal_(0.0, std, generator=gen)


def fills_apart(cfg: ModelConfig, model_dir: str | Path | None) -> bool:
    """Whether filling a state from `model_dir` (None: the random initialisation) touches no
    generator but its own, so that it may run on a thread beside other torch work: not
    transformers' own initialisation (`Family.hf_init`), which draws from the process's global
    generator, which torch.compile saves and restores around each compile."""
    from ..models.family import family_of

    return model_dir is not None or not family_of(cfg).hf_init


def parameters_in(
    cfg: ModelConfig, model_dir: str | Path | None, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every parameter by transformers' name, in `dtype`, in host memory: `model_dir`'s weights,
    or (None) the random initialisation of `seed`, as build_model fills a host state, so the same
    numbers as a policy built from that state (in bf16 its halves' `hi`, host/split.py). Read
    through a state of the weights alone: in bf16 the parameters are views of its `hi`, the rest
    freed on return."""
    state = HostState(build_units(cfg), with_optimizer=False)
    if model_dir is not None:
        load_hf_weights(state, model_dir, cfg, progress=False, seed=seed)
    else:
        init_random(state, cfg, seed)
    return {name: cast(value, dtype) for name, value in state.named_parameters()}


def _init_as_transformers(state: HostState, cfg: ModelConfig, seed: int, progress: bool) -> None:
    """Each unit's template materialised on the host and initialised by the model's own
    `_init_weights` (it draws from the global generator: units in turn, each seeded)."""
    from ..models.family import templates
    from ..models.hf import skeleton

    init, t = skeleton(cfg).model._init_weights, templates(cfg)
    for unit in tqdm(state.units, desc="initialising weights", disable=not progress, unit="unit"):
        k = unit.kind
        template = t["layers"][t["keys"][unit.index - 1]] if k == "layer" else t[k]
        module = copy.deepcopy(template).to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + unit.index)
            for sub in module.modules():
                init(sub)
        named = dict(module.named_parameters())
        params = {p.key: named[p.name] for p in unit.params}
        state.load(
            unit,
            "master",
            tensor_entries(unit, "param"),
            lambda k, a, b, params=params: params[k].reshape(-1)[a:b],
        )


def read_generation_config(model_dir: str | Path | None) -> bytes | None:
    """generation_config.json of a model directory (its EOS ids and sampling defaults), if any."""
    path = Path(model_dir) / "generation_config.json" if model_dir else None
    return path.read_bytes() if path is not None and path.is_file() else None


def write_model_config(
    out_dir: Path, cfg: ModelConfig, dtype: torch.dtype, generation: bytes | None, tokenizer=None
) -> None:
    """config.json (with `architectures` and the weights' dtype) and generation_config.json:
    `generation` (the source model's file: its EOS ids and sampling defaults) when given, else
    derived from the model config. When `tokenizer` has a chat template, the token that ends its
    assistant turns joins the EOS ids, so `generate()` stops where a chat model ends its answer."""
    hf = copy.deepcopy(cfg.saved_config)
    hf.architectures = [model_class(cfg)]
    if getattr(hf, "quantization_config", None) is not None:
        del hf.quantization_config  # weights are written in full precision (an MXFP4 source decoded)
    if isinstance(inspect.getattr_static(type(hf), "torch_dtype", None), property):
        hf.dtype = dtype  # transformers 5.x; `torch_dtype` is a deprecated alias there
    else:
        hf.torch_dtype = dtype
    hf.save_pretrained(out_dir)
    if generation is not None:
        (out_dir / "generation_config.json").write_bytes(generation)
    else:
        with contextlib.suppress(Exception):  # models without generation defaults have none
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(hf).save_pretrained(out_dir)
    if tokenizer is not None:
        from ..data.chat import end_of_turn_id

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
    read: Callable[[str], torch.Tensor] | None = None,
) -> Path:
    """Write a Hugging Face model directory (sharded safetensors + index, config.json,
    generation_config.json, tokenizer files, the manifest) atomically: either the whole
    directory appears or nothing changes. An existing `out_dir` is replaced only if it is a
    model directory megatrain wrote. Call `transport.synchronize()` first on CUDA. The weights
    are the state's, or `read(key)`'s where the state holds only a part of them."""
    entries = checkpoint_entries(state.units)
    get = read or dict(state.checkpoint_tensors()).__getitem__
    nbytes = state.num_params * dtype.itemsize
    with AtomicDir(out_dir, manifest.MODEL, nbytes=nbytes, progress=progress) as d:
        d.write_tensors("model", entries, tensor_dtypes(cfg, dtype), get, max_shard_bytes)
        write_model_config(d.path, cfg, dtype, read_generation_config(generation_from), tokenizer)
        if tokenizer is not None:
            from ..data.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, d.path)
        return d.commit()


def _export_target(src: Path, out_dir: Path, overwrite: bool) -> tuple[Callable[[Path], bool], str]:
    """The rule for what an export may replace: nothing but a previous export, and that only
    with --overwrite. Refuses targets that would put the export inside the source or replace
    the current directory. Returns AtomicDir's `may_replace` and `why_not`."""
    src_abs, cwd = src.resolve(), Path.cwd().resolve()
    target = out_dir.resolve()
    if target == src_abs or src_abs in target.parents:
        raise OutputError(f"{out_dir}: must not be the checkpoint {src} or inside it")
    if target == cwd or target in cwd.parents:
        raise OutputError(f"{out_dir}: is the current directory; export into a new one, e.g. {src.name}-hf")
    if overwrite:
        why = f"--overwrite replaces only a previous export (a directory with {manifest.MANIFEST})"
        return (lambda p: manifest.kind_of(p) == manifest.MODEL), why
    return (lambda p: False), "export never replaces anything (--overwrite replaces a previous export)"


def export_model(
    src: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = True,
    overwrite: bool = False,
) -> tuple[Path, bool]:
    """Export a checkpoint (or any model directory with config.json + safetensors) as a Hugging
    Face model in `dtype`, atomically, into a new or empty `out_dir` (or, with `overwrite`, in
    place of a previous export). Tensors are read one at a time from the memory-mapped source
    and written straight out: peak memory is one tensor per writer, no GPU needed.

    Before anything is written, every tensor the config implies is checked (presence, shape),
    the files read are verified against the source's manifest, and every source file is open:
    the small ones read, the safetensors memory-mapped, so a checkpoint deleted meanwhile (a run
    pruning it) still exports whole, or the export fails with one line. Returns the output
    directory and whether the source had checksums to verify."""
    from ..data.tokenizer import TOKENIZER_FILES, load_tokenizer

    src, out_dir = Path(src), Path(out_dir)
    if not src.is_dir():
        raise CheckpointError(f"{src}: checkpoint directory does not exist")
    may_replace, why_not = _export_target(src, out_dir, overwrite)
    AtomicDir(out_dir, manifest.MODEL, may_replace, why_not).check_target()  # refuse before reading
    identity = os.stat(src)
    cfg = ModelConfig.from_json(src)
    files = checkpoint_files(src)
    small = {
        n: (src / n).read_bytes() for n in (*TOKENIZER_FILES, "generation_config.json") if (src / n).is_file()
    }
    used = {"config.json", *small, *(f.name for f in files.values())}
    used |= {INDEX} if (src / INDEX).is_file() else set()
    try:  # only for the chat template's end-of-turn token
        tokenizer = load_tokenizer(src, optional=True)
    except ConfigError:
        tokenizer = None  # e.g. a slow-only tokenizer: its files are still copied as they are
    reader = TensorReader(files, src)  # opens (maps) every file now
    try:
        entries = checkpoint_entries(build_units(cfg))
        for key, shape in entries:
            reader.check(key, shape)
        verified = manifest.verify(src, only=used, progress=progress)
        now = os.stat(src) if src.is_dir() else None
        if now is None or (now.st_ino, now.st_dev) != (identity.st_ino, identity.st_dev):
            raise CheckpointError(f"{src}: deleted or replaced while it was being exported; export it again")
        nbytes = sum(math.prod(shape) for _, shape in entries) * dtype.itemsize
        with AtomicDir(out_dir, manifest.MODEL, may_replace, why_not, nbytes, progress) as d:
            d.write_tensors("model", entries, tensor_dtypes(cfg, dtype), reader.get, max_shard_bytes)
            write_model_config(d.path, cfg, dtype, small.pop("generation_config.json", None), tokenizer)
            for name, data in small.items():
                (d.path / name).write_bytes(data)
            d.commit()
    finally:
        reader.close()
    return out_dir, verified


def tensor_dtypes(cfg: ModelConfig, dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """The dtype each tensor of a model directory is written in: `dtype`, but fp32 for what
    transformers keeps in fp32 in a model of that dtype (`_keep_in_fp32_modules_strict` in bf16 and
    fp16, `_keep_in_fp32_modules` in fp16), so an export holds what `save_pretrained` of such a
    model writes. The lists are read from the installed transformers' model class, not copied:
    they change between releases (DeepSeek-V3 keeps its router's correction bias in fp32, and
    from 5.24 its gate weight too). The names are matched as transformers matches them (a
    search, `*` for anything)."""
    cls = _model_cls(cfg)
    keep = list(getattr(cls, "_keep_in_fp32_modules_strict", None) or []) if dtype != torch.float32 else []
    keep += list(getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else []
    if not keep:
        return lambda key: dtype
    fp32 = re.compile("|".join(k.replace("*", ".*") for k in keep))
    return lambda key: torch.float32 if fp32.search(key) else dtype


def model_class(cfg: ModelConfig) -> str:
    """The transformers class that loads an exported model (config.json's `architectures`): the
    causal LM, a reward model's sequence-classification model, or a vision-language model's
    image-text-to-text model."""
    if cfg.num_labels is not None:
        return classification_class(cfg)
    return _model_cls(cfg).__name__


def _model_cls(cfg: ModelConfig):
    from transformers import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
    )

    if cfg.vision is not None:
        return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(cfg.saved_config)]
    mapping = (
        MODEL_FOR_CAUSAL_LM_MAPPING if cfg.num_labels is None else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    )
    return mapping[type(cfg.hf_config)]

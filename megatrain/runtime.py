"""Assemble a trainable model: config, host state, transport and engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import Engine
from .errors import ConfigError
from .models.config import ModelConfig
from .optim import AdamWConfig, HostAdamW
from .state import HostState, build_units
from .transport import SerialTransport, StreamingTransport
from .weights import init_random, load_hf_weights


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device: {name!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} does not exist ({torch.cuda.device_count()} GPUs)")
    elif dev.type != "cpu":
        raise ConfigError(f"device: {name!r} is not supported (auto, cpu, cuda, cuda:N)")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "fp32": torch.float32,
    }
    if name not in table:
        raise ConfigError(f"compute_dtype: {name!r} is not one of auto, bfloat16, float32")
    return table[name]


@dataclass
class TrainableModel:
    cfg: ModelConfig
    state: HostState
    engine: Engine
    transport: SerialTransport | StreamingTransport
    optimizer: HostAdamW

    def close(self) -> None:
        self.transport.close()
        if self.engine._host_acts is not None:
            self.engine._host_acts.close()


def build_model(
    cfg: ModelConfig,
    *,
    weights: str | Path | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    compute_dtype: str | torch.dtype = "auto",
    adamw: AdamWConfig | None = None,
    overlap: bool = True,
    progress: bool = False,
    loss_chunk_tokens: int | None = None,
    gpu_state: str = "auto",
    compile: bool | None = None,
    keep_layers: int | str = "auto",
    offload_activations: bool | str = "auto",
) -> TrainableModel:
    """Host state filled from `weights` (a Hugging Face directory) or randomly initialised, and an
    engine on `device`. `overlap=False` selects the serial reference schedule on CUDA;
    `gpu_state="off"` keeps all state in host memory (see StreamingTransport.make_resident);
    `compile` compiles the decoder layer with torch.compile (default: on CUDA only)."""
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(compute_dtype, device) if isinstance(compute_dtype, str) else compute_dtype
    state = HostState(build_units(cfg))
    if weights is not None:
        load_hf_weights(state, weights, cfg, progress=progress)
    else:
        init_random(state, cfg, seed)
    opt = HostAdamW(state, adamw or AdamWConfig())
    if compile is None:
        compile = device.type == "cuda"
    if device.type == "cuda":
        transport = StreamingTransport(state, opt, device, dtype, overlap=overlap, gpu_state=gpu_state)
    else:
        transport = SerialTransport(state, opt, device, dtype)
    engine = Engine(
        cfg,
        state,
        transport,
        device,
        dtype,
        loss_chunk_tokens=loss_chunk_tokens,
        compile=compile,
        keep_layers=keep_layers,
        offload_activations=offload_activations,
    )
    return TrainableModel(cfg, state, engine, transport, opt)

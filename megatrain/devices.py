"""The device a run names, checked, and whether this process is one of a launched world: what
`megatrain train` asks before it starts a data-parallel launch, so that the launching process
imports none of the training machinery it never runs."""

from __future__ import annotations

import os

import torch

from .errors import ConfigError


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


def in_world() -> bool:
    """Started by torchrun (or launch.py) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_devices(device: torch.device, nproc: int) -> None:
    """Refuse a world of `nproc` processes per machine that `device` cannot give a GPU each."""
    if device.type != "cuda":
        return
    if device.index is not None:
        raise ConfigError(f"device: {device} names one GPU; with several processes each uses cuda:LOCAL_RANK")
    if nproc > torch.cuda.device_count():
        raise ConfigError(
            f"nproc_per_node: {nproc} processes, but this machine has {torch.cuda.device_count()} GPUs"
        )

"""Assemble a trainable model: config, host state, transport and engine. A run's host state may be
filled while the plan probes a layer on the device (`WeightsFill`): it needs no plan."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from . import CUDA_ALLOC_CONF, OMP_WAIT_POLICY
from .devices import resolve_device
from .engine import momentkernel
from .engine.engine import Engine
from .engine.optim import AdamWConfig, HostAdamW
from .engine.transport import SerialTransport, StreamingTransport, Transport
from .errors import ConfigError
from .host.disk import DiskTier
from .host.moments import FP32, Moments, named
from .host.state import HostState, build_units
from .io.weights import Gate, init_random, load_hf_weights
from .models.config import ModelConfig
from .objectives.base import Objective
from .objectives.cross_entropy import CrossEntropy
from .parallel.distributed import Collective, Single
from .parallel.layout import Layout
from .planning import placement
from .planning.placement import Batch, Choices, Machine, Plan, optimizer_threads
from .planning.probe import LayerMemory, LayerProbe, layer_probe_for


def configure_allocator() -> None:
    """Expandable segments for the CUDA caching allocator, unless the user configured it
    (PYTORCH_CUDA_ALLOC_CONF). Many tensors of a few sizes, some of several GB, come and go every
    layer: without them the allocator strands gigabytes between them (measured: 3-8 GiB reserved
    but unallocated under a 22-40 GiB cap), and a run that fits its plan dies for memory.
    Effective for allocations made after the call."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    if torch.cuda.is_available():
        # torch >= 2.10 names it for every accelerator; the CUDA name warns there on each process
        setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setting or torch.cuda.memory._set_allocator_settings)(CUDA_ALLOC_CONF)


def cpu_threads(ranks_per_machine: int = 1) -> int:
    """Intra-op threads of a run on the CPU: its share of the CPUs this process may run on (its
    affinity, which a container or taskset narrows; torch counts the machine's cores). Where
    OpenMP's threads spin rather than sleep (OMP_WAIT_POLICY is not PASSIVE: torch loaded before
    the command line could set it), the CPUs that other work keeps busy (the load average) are
    left to it: a spinning thread whose core another process takes stalls every op."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = cpus // max(1, ranks_per_machine)
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != OMP_WAIT_POLICY:
        share = min(share, cpus - int(os.getloadavg()[0]))
    return max(1, share)


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
    transport: Transport
    optimizer: HostAdamW
    plan: Plan

    def close(self) -> None:
        self.transport.close()
        if self.engine.host_acts is not None:
            self.engine.host_acts.close()
        if self.state.tier is not None:
            self.state.tier.close()


def probe_machine(
    machine: Machine,
    probe_layer: Callable[[], LayerMemory | LayerProbe | None],
    moments: Moments = FP32,
    fill: WeightsFill | None = None,
) -> tuple[Machine, LayerMemory | LayerProbe | None]:
    """What a plan takes of this machine beyond its budgets (`placement.measure`), the same for
    every way a run is planned (`make_plan`, `train`'s preflight, `megatrain plan`): one layer
    measured on the device (`probe_layer`), and the host's AdamW read once more after that, seconds after the first reading, the better one kept: a host busy at a process's start
    reads slow, and the plan then steps too many units on the GPU (a 32-core host read 2.96 G
    params/s there and ran 4.46 in the steps: bench/results/2026-11-27_2140_x2-summary.md). For
    bf16 and 8-bit `moments`, their kernel's pass timed alike (`momentkernel.rate`): its share of
    fp32's depends on the host (0.5 of it on a 2-core CPU, 0.95 on a 16-core H200 host). `fill`: a
    host state filled while the layer is probed, joined before the host is read again (a host
    busy filling reads slow)."""
    with fill.running() if fill is not None else contextlib.nullcontext():
        layer_mem = probe_layer()
    rate = placement.host_adam_rate(machine.device, machine.world, again=True)
    machine = replace(machine, adam_params_s=rate)
    own = placement.measured_adam_rate(
        machine.device, machine.world, partial(momentkernel.rate, moments), True
    )
    if own is not None:
        machine = replace(machine, moment_adam_params_s={**machine.moment_adam_params_s, moments.name: own})
    return machine, layer_mem


def make_plan(
    cfg: ModelConfig,
    device: str | torch.device,
    compute_dtype: torch.dtype,
    *,
    batch_size: int = 1,
    seq_len: int = 4096,
    grad_accum: int = 1,
    clip: bool = True,
    masked: bool = False,
    attention_span: float | None = None,
    choices: Choices | None = None,
    max_gpu_memory: int | None = None,
    max_host_memory: int | None = None,
    compile: bool | None = None,
    world: Layout | None = None,
) -> tuple[Plan, Machine]:
    """The placement of a run on this machine: placement.plan with measured budgets and, on
    CUDA, one layer's activation memory measured by running it (probe.py; `compile` as the
    engine will run it, default on). `world`: the data-parallel world's layout (layout.py)."""
    if torch.device(device).type == "cuda":
        configure_allocator()
    choices = choices or Choices()
    machine, layer_mem = probe_machine(
        placement.measure(device, max_gpu_memory, max_host_memory, world),
        lambda: layer_probe_for(cfg, device, compute_dtype, compile, batch_size * seq_len, masked),
        named(choices.moments),
    )
    batch = Batch(
        micro_batch_tokens=batch_size * seq_len,
        micro_batches=grad_accum,
        seq_len=seq_len,
        compute_bytes=compute_dtype.itemsize,
        clip=clip,
        masked=masked,
        rows=batch_size,
        attention_span=attention_span,
    )
    return placement.plan(cfg, batch, machine, choices, layer_mem), machine


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
    plan: Plan | None = None,
    choices: Choices | None = None,
    compile: bool | None = None,
    machine: Machine | None = None,
    collective: Collective | None = None,
    after_load: Callable[[HostState], None] | None = None,
    objective: Objective | None = None,
    offload_dir: str | Path | list[str | Path] | None = None,
    timings: dict[str, float] | None = None,
    filled: WeightsFill | None = None,
) -> TrainableModel:
    """Host state filled from `weights` (a Hugging Face directory) or randomly initialised, and an
    engine on `device`, placed as `plan` says (without one: `make_plan` for one 4096-token
    sequence per step under `choices`). `overlap=False` selects the serial reference schedule on
    CUDA; `compile` compiles the decoder layer with torch.compile (default: on CUDA only);
    `machine` carries a user's max_gpu_memory, which caps the CUDA allocator. In a data-parallel
    world (`collective`) the machine's ranks share one host state (the machine's part of it, when
    partitioned over machines), filled by one of them.
    `after_load(state)` completes the state (a resumed checkpoint's AdamW moments) before the
    transport copies any of it to the device. `objective`: the loss the engine computes
    (objectives/; default: next-token cross-entropy). `offload_dir`: where the plan's disk tier
    (`plan.disk_units`) goes, a folder or one per drive (host/disk.py). `timings` gets the
    seconds of its parts: the host state, its weights, on CUDA the host memory's page-locking and
    the GPU-resident state, and the rest of the device's engine. `filled`: the host state, its
    weights filled already (`WeightsFill`, joined: `weights` and `seed` are its)."""
    clock = _Clock(timings)
    collective = collective or Single()
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(compute_dtype, device) if isinstance(compute_dtype, str) else compute_dtype
    if device.type == "cuda":
        configure_allocator()
    adamw = adamw or AdamWConfig()
    if plan is None:
        choices = replace(choices or Choices(), moments=adamw.moments.name)
        plan, machine = make_plan(
            cfg, device, dtype, choices=choices, compile=compile, world=collective.layout
        )
    # The ranks of a world run one schedule (their collectives must pair up): the first one's.
    plan = collective.first(plan)
    placement.check_gpu_stepping(plan.gpu_stepped_units, device.type, collective.world_size)
    if device.type == "cuda" and machine is not None:
        fraction = placement.allocator_fraction(
            machine, torch.cuda.get_device_properties(device).total_memory
        )
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, device.index or torch.cuda.current_device())
    clock.mark("the plan")
    state = filled.state if filled is not None else collective.host_state(build_units(cfg), adamw.moments)
    if plan.disk_units and state.exp_avg is not None:  # before anything is written to the moments
        if collective.world_size > 1:
            raise ConfigError("offload_dir: the disk tier is built for one process per machine")
        DiskTier(state, plan.disk_units, offload_dir)
    clock.mark("the host state")
    if collective.holds_state:
        if filled is None:
            _fill(state, cfg, weights, seed, progress)
        if after_load is not None:
            after_load(state)
    collective.barrier()  # the weights are in place before any rank reads them
    clock.mark(weights_part(weights))
    opt = HostAdamW(state, adamw, world=collective)
    if compile is None:
        compile = device.type == "cuda"
    transport: Transport
    if device.type == "cuda":
        threads = optimizer_threads(collective.local_world_size)
        transport = StreamingTransport(
            state,
            opt,
            device,
            dtype,
            plan,
            overlap=overlap,
            threads=threads,
            collective=collective,
            zero_moments=after_load is None,  # nothing but after_load writes moments before this
        )
        clock.parts(transport.setup_s)
    else:
        if "OMP_NUM_THREADS" not in os.environ:  # the user's choice stands
            torch.set_num_threads(cpu_threads(collective.local_world_size))
        transport = SerialTransport(state, opt, device, dtype, collective=collective)
    objective = objective or CrossEntropy()
    engine = Engine(
        cfg, state, transport, device, dtype, plan, objective, compile=compile, collective=collective
    )
    if state.tier is not None:  # its blocks are read ahead in the optimizer's order
        state.tier.expect(engine.step_order())
    clock.mark("the engine on the device")
    return TrainableModel(cfg, state, engine, transport, opt, plan)


def weights_part(weights: str | Path | None) -> str:
    """The part of a run's start that fills the master weights from `weights` (`timings`)."""
    return "the weights" if weights is not None else "the random weights"


def _fill(
    state: HostState, cfg: ModelConfig, weights, seed: int, progress: bool, gate: Gate | None = None
) -> None:
    """The master weights: `weights` read (a Hugging Face directory, a checkpoint), else drawn."""
    if weights is not None:
        load_hf_weights(state, weights, cfg, progress=progress, seed=seed, gate=gate)
    else:
        init_random(state, cfg, seed, progress=progress, gate=gate)


class WeightsFill:
    """A run's host state, its master weights filled on a thread of their own while the plan
    probes a layer (`probe_machine`), for `build_model` (`filled`). The state needs no plan: the
    disk tier, made after it, holds only the moments, which the fill leaves alone. It is made at
    `start`, after the plan has read the host's free memory; every rank of a world maps it (a
    collective), the one that holds it fills it; `gate.quiet()` holds it while the probe times
    the layer. `seconds`: the fill's; `waited`: those of them that `join` waited for (`beside`:
    the rest, hidden behind the probe)."""

    def __init__(
        self,
        cfg: ModelConfig,
        collective: Collective,
        moments: Moments,
        weights,
        seed: int,
        progress: bool = False,
    ):
        self.cfg, self.collective, self.moments = cfg, collective, moments
        self.weights, self.seed, self.progress = weights, seed, progress
        self.state: HostState | None = None
        self.seconds = self.waited = 0.0
        self.gate = Gate()  # `quiet()` for the probe's timed passes; stopped where the probe fails
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def beside(self) -> float:
        """Seconds of the fill hidden behind the probe."""
        return max(0.0, self.seconds - self.waited)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The fill running while the body runs: joined after it, stopped where the body raises."""
        self.start()
        try:
            yield
        except BaseException:
            self.stop()
            raise
        self.join()

    def start(self) -> None:
        self.state = self.collective.host_state(build_units(self.cfg), self.moments)
        if self.collective.holds_state:
            self._thread = threading.Thread(target=self._run, name="megatrain-weights", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        t = time.monotonic()
        try:
            _fill(self.state, self.cfg, self.weights, self.seed, self.progress, self.gate)
        except BaseException as e:  # raised by `join`, in the thread that waits
            self._error = e
        self.seconds = time.monotonic() - t

    def join(self) -> None:
        """Wait for the fill; its error is raised here (the state dropped)."""
        t = time.monotonic()
        try:
            if self._thread is not None:
                self._thread.join()
        except BaseException:  # an interrupt while waiting
            self.stop()
            raise
        self.waited = time.monotonic() - t
        if self._error is not None:
            self.state = None
            raise self._error

    def stop(self) -> None:
        """The units not begun skipped, the thread joined, the state dropped (and the fill's own
        error, if any: the caller raises its own)."""
        self.gate.stop()
        if self._thread is not None:
            self._thread.join()
        self.state = None


class _Clock:
    """Seconds between marks, into `into` (None: nothing kept)."""

    def __init__(self, into: dict[str, float] | None):
        self.into, self.t = into, time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        if self.into is not None:
            self.into[name] = self.into.get(name, 0.0) + now - self.t
        self.t = now

    def parts(self, seconds: dict[str, float]) -> None:
        """Parts of the time since the last mark, timed by the code that ran (each a part of its
        own, out of the next mark's)."""
        for name, s in seconds.items():
            if self.into is not None:
                self.into[name] = self.into.get(name, 0.0) + s
            self.t += s

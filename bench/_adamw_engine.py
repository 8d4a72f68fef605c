"""The engine's host AdamW pass in a step beside torch's fused kernel at the same size:
`bench/adamw.py --engine` (its docstring says what is timed)."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megatrain.engine import clipadam
from megatrain.engine.optim import AdamWConfig, HostAdamW
from megatrain.host.hostmem import host_buffer
from megatrain.host.state import HostState, build_units
from megatrain.models.config import ModelConfig
from megatrain.models.family import count_params
from megatrain.planning.planspec import STAGING_CHUNK

LR, BETAS, WEIGHT_DECAY = 1e-5, (0.9, 0.95), 0.1
CLIPPED = 0.9  # a clip that fires; the gradients shrink 10% a pass, far from subnormals over the repeats
PATTERN = 1 << 20  # elements of the random block that fills a buffer, repeated


def fill(t: torch.Tensor, scale: float, seed: int) -> None:
    """`t` filled with a random block repeated (one parallel copy: a generator would take minutes
    at 8e9 elements); AdamW's rate does not depend on the values."""
    block = torch.randn(PATTERN, generator=torch.Generator().manual_seed(seed)).mul_(scale)
    k, n = divmod(t.numel(), PATTERN)
    t[: k * PATTERN].view(k, PATTERN).copy_(block.expand(k, PATTERN))
    t[k * PATTERN :].copy_(block[:n])


def llama(shape: str, params: float, vocab: int | None = None) -> ModelConfig:
    """A Llama with `shape`'s layers (bench/_shapes.py) and as many of them as bring it nearest
    `params` parameters, at least one; `vocab` in place of the shape's (a small host's size)."""
    from _shapes import DENSE_SHAPES
    from _systems import model_config

    if shape not in DENSE_SHAPES:
        sys.exit(f"adamw.py: --shape {shape!r} is not one of {', '.join(DENSE_SHAPES)}")

    def at(layers: int) -> ModelConfig:
        m = {**DENSE_SHAPES[shape], "layers": layers, "vocab": vocab or DENSE_SHAPES[shape]["vocab"]}
        return ModelConfig.from_hf(model_config({"shape": m, "seq": 4096}))

    one, two = count_params(at(1)), count_params(at(2))
    return at(max(1, round((params - one) / (two - one)) + 1))


class EnginePass:
    """The engine's host state of `cfg`, its optimizer, and gradients held in host memory as the
    transport holds them (one buffer, each unit's span in turn). The moments stay untouched until
    the first pass, as in a run."""

    def __init__(self, cfg: ModelConfig, weight_decay: float = WEIGHT_DECAY):
        self.state = HostState(build_units(cfg))
        self.opt = HostAdamW(self.state, AdamWConfig(lr=LR, betas=BETAS, weight_decay=weight_decay))
        spans = [self.opt.span(u) for u in self.state.units]
        buf, self.held, off = host_buffer(sum(hi - lo for lo, hi in spans)), [], 0
        for lo, hi in spans:
            self.held.append(buf[off : off + hi - lo])
            off += hi - lo
        for u in self.state.units:  # the master weights through their halves, a unit at a time
            weights = torch.empty(u.numel)
            fill(weights, 0.02, 0)
            self.state.set_master(u, 0, weights)
        fill(buf, 1e-3, 1)
        self.chunk = min(STAGING_CHUNK, max(u.numel for u in self.state.units))  # the transport's
        self.numel = sum(p.numel for u in self.state.units for p in u.params if p.train)
        self.steps = 0

    def run(self, coef: torch.Tensor | None, fused: bool = False) -> None:
        """One pass: clipadam's kernel on the master weights' halves (`fused`), or torch's kernel
        on fp32 made from them and split back, after the clip's multiply of each chunk whole."""
        self.opt.fused_clip = fused
        self.steps += 1
        for u in self.state.units:
            self.opt.step_held(u, self.held[u.index], coef, LR, self.steps, self.chunk)


class KernelPass:
    """torch's fused AdamW over flat fp32 arrays of `n` elements, `chunk` at a time."""

    def __init__(self, n: int, chunk: int, weight_decay: float = WEIGHT_DECAY):
        self.weight_decay = weight_decay
        self.p, self.g, self.m, self.v = (torch.empty(n) for _ in range(4))
        fill(self.p, 0.02, 2)
        fill(self.g, 1e-3, 3)
        self.m.zero_(), self.v.zero_()
        self.n, self.chunk, self.step_no = n, chunk, torch.zeros(())

    def run(self) -> None:
        self.step_no += 1
        for a in range(0, self.n, self.chunk):
            b = min(self.n, a + self.chunk)
            torch._fused_adamw_(
                [self.p[a:b]], [self.g[a:b]], [self.m[a:b]], [self.v[a:b]], [], [self.step_no], amsgrad=False,
                lr=LR, beta1=BETAS[0], beta2=BETAS[1], weight_decay=self.weight_decay, eps=1e-8, maximize=False,
            )  # fmt: skip


FUSED = "engine, clipped, multiplied in the kernel's pass"


def measure_engine(
    cfg: ModelConfig,
    repeats: int,
    fused: bool = False,
    weight_decay: float = WEIGHT_DECAY,
) -> tuple[list[dict], dict]:
    """Each pass `repeats` times after a first one, interleaved (drift in the machine's state
    falls on all alike); the best of each, G params/s over the engine's stepped elements. The
    clipped pass scales each chunk whole before torch's kernel, and (`fused`) in the kernel that
    multiplies as it steps, where it builds and equals torch's here (clipadam.py)."""
    t0 = time.perf_counter()
    engine = EnginePass(cfg, weight_decay)
    kernel = KernelPass(engine.numel, engine.chunk, weight_decay)
    setup_s = time.perf_counter() - t0
    # The transport sets the optimizer's threads on the calling thread before its worker starts;
    # the worker takes that count at its first parallel op.
    worker = ThreadPoolExecutor(1, thread_name_prefix="megatrain-optimizer")
    on_worker = lambda fn: lambda: worker.submit(_clock, fn).result()  # noqa: E731
    here = lambda fn: lambda: _clock(fn)  # noqa: E731
    clipped, one = torch.tensor(CLIPPED), torch.tensor(1.0)
    if fused and clipadam.load()[0] is None:
        print(f"--clip-fused: the kernel is not used here: {clipadam.load()[1]}", flush=True)
        fused = False
    passes = [
        ("kernel", "calling", here(kernel.run)),
        ("kernel", "worker", on_worker(kernel.run)),
        ("engine, clipped", "worker", on_worker(lambda: engine.run(clipped))),
        *([(FUSED, "worker", on_worker(lambda: engine.run(clipped, fused=True)))] if fused else []),
        ("engine, coefficient 1", "worker", on_worker(lambda: engine.run(one))),
        ("engine, unclipped", "worker", on_worker(lambda: engine.run(None))),
    ]
    times: dict[str, list[float]] = {name + where: [] for name, where, _ in passes}
    for _ in range(repeats + 1):
        for name, where, fn in passes:
            times[name + where].append(fn())
            print(f"{name:22s} {where:8s} {times[name + where][-1]:7.3f} s", flush=True)
    threads_on_worker = worker.submit(torch.get_num_threads).result()
    worker.shutdown()
    n = engine.numel
    rows = []
    for name, where, _ in passes:
        first, *rest = times[name + where]
        best = min(rest)
        rows.append({"pass": name, "piece": engine.chunk, "thread": where, "first_s": first, "seconds": best,
                     "gparams_per_s": n / best / 1e9, "times_s": rest})  # fmt: skip
    kernel_rate = max(r["gparams_per_s"] for r in rows if r["pass"] == "kernel")
    for r in rows:
        r["vs_kernel"] = r["gparams_per_s"] / kernel_rate
    engine_row = next(r for r in rows if r["pass"] == "engine, clipped")
    summary = {
        "engine_params": n,
        "layers": cfg.num_hidden_layers,
        "chunk": engine.chunk,
        "threads_on_worker": threads_on_worker,
        "setup_s": setup_s,
        "kernel_gparams_per_s": kernel_rate,
        "engine_gparams_per_s": engine_row["gparams_per_s"],
        "ratio": engine_row["vs_kernel"],
        "engine_first_pass_s": engine_row["first_s"],
        "fused_ratio": next((r["vs_kernel"] for r in rows if r["pass"] == FUSED), None),
    }
    return rows, summary


def _clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def engine_table(rows: list[dict]) -> str:
    out = [
        "| pass | piece | thread | first pass s | best s | G params/s | vs kernel |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [
        f"| {r['pass']} | {r['piece']:,} | {r['thread']} | {r['first_s']:.3f} | {r['seconds']:.3f} | "
        f"{r['gparams_per_s']:.2f} | {r['vs_kernel']:.0%} |"
        for r in rows
    ]
    return "\n".join(out)


# ----------------------------------------------------------------------------- beside a step
BESIDE = ("none", "launch", "link", "launch+link")
LINK_BYTES = 512 << 20  # each direction's buffer pair


class Beside:
    """What runs beside the host AdamW in a training step, started for the length of a `with`:
    `launch`, a thread launching small kernels in a Python loop (the launching thread: a core,
    the GIL between its calls; on the CPU, small ops in its place); `link`, page-locked host
    buffers copied to and from the GPU on two streams without pause (the link's traffic through
    host memory, waited for without spinning). `link_gb_s`: both directions' rate while it ran."""

    def __init__(self, kinds: str):
        self.kinds = set() if kinds == "none" else set(kinds.split("+"))
        if "link" in self.kinds and not torch.cuda.is_available():
            raise ValueError("--beside link needs a GPU")
        self.link_gb_s: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Beside:
        self._stop.clear()
        targets = {"launch": self._launch, "link": self._link}
        self._threads = [threading.Thread(target=targets[k], daemon=True) for k in sorted(self.kinds)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _launch(self) -> None:
        x = torch.ones(1024, device="cuda" if torch.cuda.is_available() else "cpu")
        while not self._stop.is_set():
            for _ in range(64):
                x.add_(1.0)

    def _link(self) -> None:
        host = [torch.empty(LINK_BYTES // 4, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(LINK_BYTES // 4, device="cuda") for _ in range(2)]
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        moved, t0 = 0, time.perf_counter()
        while not self._stop.is_set():
            done = []
            for s, (dst, src) in zip(streams, [(dev[0], host[0]), (host[1], dev[1])]):
                with torch.cuda.stream(s):
                    dst.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event(blocking=True)  # waited for asleep, not spinning
                    ev.record(s)
                done.append(ev)
            for ev in done:
                ev.synchronize()
            moved += 2 * LINK_BYTES
        self.link_gb_s = moved / (time.perf_counter() - t0) / 1e9


def measure_beside(
    cfg: ModelConfig,
    repeats: int,
    kinds: list[str],
    blocks: list[int],
    weight_decay: float = WEIGHT_DECAY,
) -> list[dict]:
    """The kernel (calling thread) and the engine's clipped pass in clipadam's kernel at each of
    clipadam's `blocks` (0: one block a thread), beside each of
    `kinds` (BESIDE); `repeats` after a first pass, interleaved; the best of each. `vs_kernel`:
    against the kernel beside the same; `vs_alone`: against the kernel beside nothing."""
    if clipadam.load()[0] is None:
        raise SystemExit(f"--beside: clipadam's kernel is not used here: {clipadam.load()[1]}")
    besides = [Beside(kind) for kind in kinds]  # a kind this machine cannot run refused before the setup
    engine = EnginePass(cfg, weight_decay)
    kernel = KernelPass(engine.numel, engine.chunk, weight_decay)
    worker = ThreadPoolExecutor(1, thread_name_prefix="megatrain-optimizer")
    clipped = torch.tensor(CLIPPED)

    def engine_at(block: int):
        def run() -> None:
            before, clipadam.BLOCK = clipadam.BLOCK, block
            try:
                engine.run(clipped, fused=True)
            finally:
                clipadam.BLOCK = before

        return lambda: worker.submit(_clock, run).result()

    passes = [("kernel", None, lambda: _clock(kernel.run))]
    passes += [(FUSED, b, engine_at(b)) for b in blocks]
    rows = []
    for kind, beside in zip(kinds, besides):
        times: dict[int, list[float]] = {k: [] for k in range(len(passes))}
        with beside:
            for _ in range(repeats + 1):
                for k, (name, block, fn) in enumerate(passes):
                    times[k].append(fn())
                    print(
                        f"beside {kind:12s} {name[:40]:40s} block {block} {times[k][-1]:7.3f} s", flush=True
                    )
        for k, (name, block, _) in enumerate(passes):
            first, *rest = times[k]
            rows.append({"beside": kind, "pass": name, "block": block, "first_s": first,
                         "seconds": min(rest), "gparams_per_s": engine.numel / min(rest) / 1e9,
                         "times_s": rest, "link_gb_s": beside.link_gb_s})  # fmt: skip
    worker.shutdown()
    alone = next((r["gparams_per_s"] for r in rows if r["beside"] == "none" and r["block"] is None), None)
    for r in rows:
        same = next(x["gparams_per_s"] for x in rows if x["beside"] == r["beside"] and x["block"] is None)
        r["vs_kernel"] = r["gparams_per_s"] / same
        r["vs_alone"] = None if alone is None else r["gparams_per_s"] / alone
    return rows


def beside_table(rows: list[dict]) -> str:
    out = [
        "| beside | pass | block | best s | G params/s | vs kernel beside the same | vs kernel alone | link GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        block = "-" if r["block"] is None else ("a thread's share" if r["block"] == 0 else f"{r['block']:,}")
        alone = "-" if r["vs_alone"] is None else f"{r['vs_alone']:.0%}"
        link = "-" if r["link_gb_s"] is None else f"{r['link_gb_s']:.1f}"
        out.append(
            f"| {r['beside']} | {r['pass']} | {block} | {r['seconds']:.3f} | {r['gparams_per_s']:.2f} | "
            f"{r['vs_kernel']:.0%} | {alone} | {link} |"
        )
    return "\n".join(out)

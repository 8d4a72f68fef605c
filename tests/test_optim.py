"""The host AdamW against torch's own: bitwise the same weights and moments as
`torch.optim.AdamW(fused=True)` over the same parameters, however the optimizer's pass is cut;
and the moments' pages mapped before a unit's first step."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config

from megatrain.engine import clipadam, optim
from megatrain.engine.engine import Engine
from megatrain.engine.optim import AdamWConfig, HostAdamW
from megatrain.host.disk import DiskTier
from megatrain.host.hostmem import PAGE, host_buffer, populate
from megatrain.host.split import join, split, to_bf16
from megatrain.host.state import HostState, build_units
from megatrain.io.weights import init_random
from megatrain.models.config import ModelConfig

ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# (clip coefficient, learning rate, elements a chunk) of each step: a clip that fires, a norm under
# the threshold (a coefficient of exactly one), no clipping, a clip that fires again; chunks that
# cut parameters, and whole units. The engine cuts at multiples of 64 elements (pages, chunks of 32M): the kernel's vector loop
# then covers the elements it covers in a whole tensor (a cut elsewhere moves some into its scalar
# tail, whose rounding may differ).
STEPS = [(0.37, 1e-2, 1024), (1.0, 5e-3, 192), (None, 2e-3, 10**9), (0.6, 1e-3, 10**9)]


def _state():
    """A tiny Qwen2 with one frozen tensor in its first layer, its weights initialised. Its
    biases are undecayed parameters between decayed ones; its hidden size (48) leaves padding
    after each bias and between the two norms of a layer."""
    cfg = ModelConfig.from_hf(tiny_config("qwen2", hidden_size=48))
    units = build_units(cfg)
    layer = units[1]
    frozen = [dataclasses.replace(p, train=p.name != "self_attn.k_proj.weight") for p in layer.params]
    units[1] = dataclasses.replace(layer, params=tuple(frozen))
    state = HostState(units)
    init_random(state, cfg, seed=0)
    return state


@pytest.fixture
def two_threads():
    """The optimizer's pass on two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("fused", [False, True])  # torch's kernel after the multiply; clipadam's
def test_held_gradients_step_bitwise_as_torch_adamw_and_padding_stays_untouched(
    fused, two_threads, monkeypatch
):
    if fused:  # every tensor split over the two threads in blocks of 64, not only those of 64K elements
        monkeypatch.setattr(clipadam, "MIN_PER_THREAD", 64)
        monkeypatch.setattr(clipadam, "BLOCK", 64)
        assert clipadam.load()[0] is not None, clipadam.load()[1]
    state = _state()
    opt = HostAdamW(state, ADAMW)
    opt.fused_clip = fused
    specs = [(u, p) for u in state.units for p in u.params]
    ref = {p.key: torch.nn.Parameter(state.master(u)[p.offset : p.offset + p.numel]) for u, p in specs}
    groups = [
        {"params": [ref[p.key] for u, p in specs if p.train and p.decay], "weight_decay": ADAMW.weight_decay},
        {"params": [ref[p.key] for u, p in specs if p.train and not p.decay], "weight_decay": 0.0},
    ]
    assert groups[0]["params"] and groups[1]["params"]
    torch_opt = torch.optim.AdamW(groups, lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps, fused=True)
    g = torch.Generator().manual_seed(0)
    for step, (coef, lr, piece) in enumerate(STEPS, start=1):
        grads = [torch.randn(u.numel, generator=g) for u in state.units]  # padding too
        for u, p in specs:
            gr = grads[u.index][p.offset : p.offset + p.numel]
            ref[p.key].grad = gr.clone() if coef is None else gr * torch.tensor(coef)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
        for u in state.units:
            opt.step_held(u, grads[u.index], None if coef is None else torch.tensor(coef), lr, step, piece)
        for u, p in specs:
            m, v = (state.flat(u, w)[p.offset : p.offset + p.numel] for w in ("exp_avg", "exp_avg_sq"))
            assert torch.equal(state.master(u)[p.offset : p.offset + p.numel], ref[p.key].detach()), (
                step,
                p.key,
            )
            if p.train:
                assert torch.equal(m, torch_opt.state[ref[p.key]]["exp_avg"]), (step, p.key)
                assert torch.equal(v, torch_opt.state[ref[p.key]]["exp_avg_sq"]), (step, p.key)
            else:  # frozen: never stepped, its moments never written
                assert not m.any() and not v.any()
        for which in state.buffers:  # the alignment padding is no parameter's
            flat = getattr(state, which).clone()
            for u, p in specs:
                flat[state.starts[u.index] + p.offset :][: p.numel] = 0
            assert not flat.any(), (step, which)


@pytest.mark.parametrize("coef", [0.37, 1.0])
def test_the_clip_multiplies_the_held_gradient_in_place(coef):
    """The plain pass (torch's kernel after the multiply) scales the held gradient where it lies
    (the transport's buffer is scratch), as a multiply would: by a coefficient of one, it is left
    as it was."""
    state = _state()
    opt = HostAdamW(state, ADAMW)
    opt.fused_clip = False
    unit = state.units[1]
    grad = torch.randn(unit.numel, generator=torch.Generator().manual_seed(1))
    before = grad.clone()
    opt.step_held(unit, grad, torch.tensor(coef), 1e-2, 1, 1000)
    assert torch.equal(grad, before * torch.tensor(coef))


def _resident() -> int:
    """Bytes of this process resident in memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_populate_maps_the_pages_and_keeps_what_they_hold():
    """Fresh memory is mapped (resident) after `populate`, still zero; memory already written
    keeps its values, to the last element of a tensor that ends mid-page."""
    n = 4 * 2**20  # 16 MiB
    fresh = host_buffer(n)
    before = _resident()
    assert populate([fresh[: n // 2], fresh[n // 2 :]], threads=3)
    assert _resident() - before >= 0.9 * n * 4 and not fresh.any()
    written = host_buffer(n)
    written.copy_(torch.arange(n, dtype=torch.float32))
    assert populate([written[5 : n - 7]], threads=2) and populate([written[:0]], threads=2)
    assert torch.equal(written, torch.arange(n, dtype=torch.float32))


def test_the_first_step_of_a_unit_populates_its_moments_once_and_not_the_disk_tiers(tmp_path, monkeypatch):
    state = _state()
    DiskTier(state, 2, tmp_path)
    calls = []
    monkeypatch.setattr(optim, "populate", lambda tensors, threads: calls.append((tensors, threads)) or True)
    opt = HostAdamW(state, ADAMW)
    for step in (1, 2):
        for u in state.units:
            opt.step_held(u, torch.randn(u.numel), torch.tensor(0.5), 1e-2, step, 192)
    stepped = [u for u in state.units if not state.tier.holds(u)]
    assert len(stepped) == len(state.units) - 2
    assert [[t.data_ptr() for t in tensors] for tensors, _ in calls] == [
        [state.flat(u, w).data_ptr() for w in ("exp_avg", "exp_avg_sq")] for u in stepped
    ]
    assert all(len(tensors) == 2 and tensors[0].numel() == u.numel for (tensors, _), u in zip(calls, stepped))
    assert {threads for _, threads in calls} == {torch.get_num_threads()}


def test_the_kernel_steps_every_unit_the_disk_tiers_too_as_torchs_kernel_on_fp32_does(tmp_path):
    """clipadam's kernel steps the halves of every unit, a block at a time on the disk tier's
    staged moments, bitwise as torch's kernel on fp32 made from the halves (and split back) does,
    over clipped, coefficient-one and unclipped steps and ranges stepped as they landed; the held
    gradient stays unscaled in its pass, scaled in place in the other."""
    results = []
    for fused in (False, True):
        state = _state()
        DiskTier(state, 2, tmp_path / str(fused))
        opt = HostAdamW(state, ADAMW)
        opt.fused_clip = fused
        g = torch.Generator().manual_seed(4)
        for step, coef in enumerate((0.37, 1.0, None), start=1):
            for u in state.units:
                c = None if coef is None else torch.tensor(coef)
                grad = torch.randn(u.numel, generator=g)
                before = grad.clone()
                opt.step_held(u, grad, c, 1e-2, step, 1000)
                assert torch.equal(grad, before if fused or coef is None else before * c)
        unit = state.units[-1]  # the tier's last unit, a range of it
        opt.step_range(unit, 64, 640, torch.randn(576, generator=g), 1e-2, 4)
        tier = state.tier
        moments = [
            torch.cat(list(tier.pieces(u, w, 0, u.numel))) for u in tier.units for w in state.moment_names
        ]
        results.append([state.hi.clone(), state.lo.clone(), state.exp_avg.clone(), *moments])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_the_kernels_halves_give_back_every_fp32_pattern():
    """The kernel's halves (its C repeats host/split.py's rule) give back each of the 2^32 fp32
    bit patterns (two threads, a half each), and equal split.py's on every high half (`check`)."""
    from concurrent.futures import ThreadPoolExecutor

    kernel = clipadam.load()[0]
    assert kernel is not None, clipadam.load()[1]
    with ThreadPoolExecutor(2) as pool:  # ctypes lets go of the GIL
        bad = list(pool.map(lambda first: kernel.round_trips(first, 1 << 31), (0, 1 << 31)))
    assert bad == [0, 0]
    x = torch.tensor([3.0e38, -3.4e38, float("inf"), float("nan"), 1.0 + 2**-8, -0.0])
    got, want = kernel.halves(x), split(x)
    assert torch.equal(got.hi.view(torch.int16), want.hi.view(torch.int16)) and torch.equal(got.lo, want.lo)


def test_the_fused_kernel_is_refused_where_it_cannot_be_checked_equal(monkeypatch):
    """`load` reports why the kernel stands aside: no compiler, a CPU whose torch code is not of
    the known kinds; and the check catches a kernel whose forms are not torch's (a tensor's last
    elements in the wrong form) and halves that are not host/split.py's (a bf16 half truncated:
    the weights come back, its fetches would differ)."""
    monkeypatch.setattr(clipadam, "_LOADED", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    kernel, why = clipadam.load()
    assert kernel is None and "DEFAULT" in why
    monkeypatch.undo()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(clipadam.Unavailable, match="no C compiler"):
        clipadam.ClipAdamW()
    monkeypatch.delenv("CC")
    clipadam.check(clipadam.ClipAdamW())
    for wrong in (1, 16):  # no element in the scalar form; a tail of 8-15 all in it
        with pytest.raises(clipadam.Unavailable, match="differ from torch"):
            clipadam.check(clipadam.ClipAdamW(wrong))
    rule = (
        "uint32_t hi = top + (carry & (mag < 0x7F7Fu));",
        "uint32_t top_ = top - (carry & (mag == 0x7F7Fu)); uint32_t hi = top_;",
    )
    join = ("uint32_t top = hi - (carry & (mag != 0) & (mag <= 0x7F7Fu));", "uint32_t top = hi;")
    truncating = clipadam.SOURCE.replace(*rule).replace(*join)  # truncation, undone as truncation
    assert truncating != clipadam.SOURCE
    monkeypatch.setattr(clipadam, "SOURCE", truncating)
    with pytest.raises(clipadam.Unavailable, match="differ from torch"):
        clipadam.check(clipadam.ClipAdamW())


@pytest.mark.parametrize("block", [64, 100, 1 << 12, 1 << 20, 0])
def test_the_kernels_threads_share_its_blocks_and_step_every_element_as_torch_does(block, monkeypatch):
    """Threads taking blocks from one counter (a block of any size, the last one short, more
    threads than blocks, or one block a thread: 0): every element stepped once, bitwise as
    torch's kernel steps it, its halves split.py's of torch's weights; the last elements in the
    form of torch's scalar loop."""
    monkeypatch.setattr(clipadam, "MIN_PER_THREAD", 64)
    monkeypatch.setattr(clipadam, "BLOCK", block)
    kernel = clipadam.load()[0]
    assert kernel is not None, clipadam.load()[1]
    n = 3 * 4096 + 77
    gen = torch.Generator().manual_seed(5)
    p, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
    m, v = torch.randn(n, generator=gen) * 1e-4, torch.rand(n, generator=gen) * 1e-6
    for threads in (1, 3, 7):
        ours, theirs = [split(p), m.clone(), v.clone()], [t.clone() for t in (p, m, v)]
        for step in (1, 2):
            kernel.step(ours[0], g, ours[1], ours[2], 0.37, 1e-3, step, (0.9, 0.95), 1e-8, 0.1, threads)
            torch._fused_adamw_(
                [theirs[0]], [g * torch.tensor(0.37)], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step))],
                amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False,
            )  # fmt: skip
        assert torch.equal(join(ours[0]), theirs[0]), (block, threads)
        assert all(torch.equal(a, b) for a, b in zip(ours[1:], theirs[1:])), (block, threads)
        assert torch.equal(ours[0].hi.view(torch.int16), to_bf16(theirs[0]).view(torch.int16))


class _Half(optim.Single):
    """A world whose process holds and steps the second half of every unit (from a multiple of
    64 elements), as a machine's part in a partitioned world does."""

    def __init__(self, units):
        self.parts = {u.index: (u.numel // 2 // 64 * 64, u.numel) for u in units}

    def span(self, unit):
        return self.parts[unit.index]

    def piece(self, unit):
        return self.parts[unit.index]


def test_the_fused_kernel_steps_a_part_of_the_state_as_torchs_kernel_does(two_threads, monkeypatch):
    """A process holding a part of each unit (its state from the part's start on): the fused
    kernel's weights and moments equal torch's kernel's after the multiply, bitwise, over three
    clipped steps."""
    monkeypatch.setattr(clipadam, "MIN_PER_THREAD", 64)
    monkeypatch.setattr(clipadam, "BLOCK", 64)
    full = _state()
    world = _Half(full.units)
    results = []
    for fused in (False, True):
        state = HostState(full.units, parts=[world.parts[u.index] for u in full.units])
        for u in full.units:
            lo, hi = world.parts[u.index]
            state.set_master(u, lo, full.master(u)[lo:hi])
        before = state.master()
        opt = HostAdamW(state, ADAMW, world)
        opt.fused_clip = fused
        g = torch.Generator().manual_seed(2)
        for step in (1, 2, 3):
            for u in full.units:
                lo, hi = world.parts[u.index]
                opt.step_held(u, torch.randn(hi - lo, generator=g), torch.tensor(0.37), 1e-2, step, 10**9)
        results.append([state.master(), state.exp_avg.clone(), state.exp_avg_sq.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert results[1][0].shape == before.shape and not torch.equal(results[1][0], before)  # stepped


def test_where_the_fused_kernel_is_unavailable_the_plain_pass_steps_and_a_warning_says_why(
    monkeypatch, caplog
):
    """The default asks for clipadam's kernel; where it cannot be used here, a clip that fires
    is multiplied and stepped by torch's kernel, the same state bit for bit, and one warning names
    the reason."""
    monkeypatch.setattr(clipadam, "load", lambda: (None, "no C compiler (cc: not found)"))
    results = []
    for fused in (True, False):
        state = _state()
        opt = HostAdamW(state, ADAMW)
        assert opt.fused_clip  # the default
        opt.fused_clip = fused
        g = torch.Generator().manual_seed(3)
        with caplog.at_level("WARNING", logger=optim.__name__):
            for step in (1, 2):
                for u in state.units:
                    opt.step_held(u, torch.randn(u.numel, generator=g), torch.tensor(0.37), 1e-2, step, 1000)
        results.append(state.master())
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "host AdamW: torch's kernel on fp32 made from the halves, the clip's multiply apart "
        "(no C compiler (cc: not found))"
    ]
    assert torch.equal(results[0], results[1])


def test_a_layers_gradient_buffer_is_zeroed_only_where_no_gradient_is_copied(monkeypatch):
    """The backward sweep copies a layer's first micro-batch's gradients into an unzeroed buffer
    (engine.py `_accumulate`); whatever no trained parameter covers is zeroed: the frozen
    tensor, the alignment between parameters, the padding to the ranks' pieces."""
    unit = _state().units[1]
    names = [p.name for p in unit.params if p.train]
    length = unit.numel + 40  # as a collective pads it
    fake = SimpleNamespace(collective=SimpleNamespace(padded=lambda u: length), device=torch.device("cpu"))
    full = torch.full
    monkeypatch.setattr(torch, "empty", lambda n, device: full((n,), float("nan"), device=device))
    g = Engine._grad_buffer(fake, unit, names)
    covered = torch.zeros(length, dtype=torch.bool)
    for p in unit.params:
        if p.train:
            covered[p.offset : p.offset + p.numel] = True
    frozen = next(p for p in unit.params if not p.train)
    assert not covered[frozen.offset : frozen.offset + frozen.numel].any() and not covered[unit.numel :].any()
    assert (~covered[: unit.numel]).sum() > frozen.numel  # alignment gaps too
    assert torch.isnan(g[covered]).all() and torch.equal(g[~covered], torch.zeros(int((~covered).sum())))

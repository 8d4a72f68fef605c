"""AdamW with bf16 and 8-bit moments (`optim`) against plain transcriptions of their algorithms,
bitwise, step for step, through the engine's own passes (held gradients, chunks, a clip, frozen
and undecayed tensors, tensors that end mid-block, zero and huge gradients); and against
bitsandbytes' own AdamW8bit on the CPU, step for step from the same state, within its CPU
quantiser's table (bitsandbytes is in the test extra: the CPU tests need it); and the GPU's
one-pass kernel against the same transcriptions.

The transcription is bitsandbytes' documented 8-bit blockwise update written as plainly as it
reads: per block of 256 elements of a tensor, the moments decoded (the map's value times the
block's absmax), AdamW in fp32, the new moments divided by their new absmax and stored as the
index of the nearest value of the dynamic map (argmin over all 256; a block of zeros: index 0).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import tiny_config

from megatrain.engine import momentkernel
from megatrain.engine import moments as low
from megatrain.engine.optim import AdamWConfig, HostAdamW
from megatrain.host.moments import BF16, BLOCK, Q8, Moments
from megatrain.host.split import to_bf16
from megatrain.host.state import HostState, build_units
from megatrain.io.weights import init_random
from megatrain.models.config import ModelConfig

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
# (clip coefficient, learning rate, elements a chunk of the pass): a clip that fires, none, a norm
# under the threshold; chunks that cut tensors on blocks, and whole units.
STEPS = [(0.37, 1e-2, 512), (None, 5e-3, 10**9), (1.0, 2e-3, 256), (0.6, 1e-3, 1280)]


# ---------------------------------------------------------------------------- the transcriptions
def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' `create_dynamic_map(signed)` as its source reads (7 exponent bits, 8 bits)."""
    data = []
    for i in range(7):
        n = 2**i + 1 if signed else 2 ** (i + 1) + 1
        b = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


SIGNED, UNSIGNED = dynamic_map(True), dynamic_map(False)


def adamw32(p, g, m, v, lr, step, decay):
    """AdamW in fp32 from decoded moments: (new weights, new exp_avg, new exp_avg_sq)."""
    b1, b2 = BETAS
    m = m * b1 + g * (1 - b1)
    v = v * b2 + (g * (1 - b2)) * g
    denom = torch.sqrt(v.double()).float() / math.sqrt(1 - b2**step) + EPS  # fp32's exact sqrt
    if decay:
        p = p * (1 - lr * WD)
    return p + (m / denom) * (-lr / (1 - b1**step)), m, v


def quantize_block(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = x.abs().max()
    if absmax == 0:
        return torch.zeros(x.numel(), dtype=torch.uint8), absmax
    scaled = (x / absmax).clamp(-1, 1)
    return (scaled[:, None] - code[None, :]).abs().argmin(dim=1).to(torch.uint8), absmax


def reference_8bit(p, g, codes_m, codes_v, absmax_m, absmax_v, lr, step, decay):
    """One step of one tensor, block by block: new (p, codes_m, codes_v, absmax_m, absmax_v)."""
    out = [t.clone() for t in (p, codes_m, codes_v, absmax_m, absmax_v)]
    for k, a in enumerate(range(0, p.numel(), BLOCK)):
        s = slice(a, a + BLOCK)
        m = SIGNED[codes_m[s].long()] * absmax_m[k]
        v = UNSIGNED[codes_v[s].long()] * absmax_v[k]
        out[0][s], m, v = adamw32(p[s], g[s], m, v, lr, step, decay)
        (out[1][s], out[3][k]), (out[2][s], out[4][k]) = (
            quantize_block(m, SIGNED),
            quantize_block(v, UNSIGNED),
        )
    return out


def reference_bf16(p, g, m, v, lr, step, decay):
    """One step of one tensor, moments stored in bf16 (round to nearest even) after an fp32 update."""
    p, m, v = adamw32(p, g, m.float(), v.float(), lr, step, decay)
    return p, m.to(torch.bfloat16), v.to(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------------------- the engine's passes
def _state(moments: Moments) -> HostState:
    """A tiny Qwen2 (hidden 48: norms and biases that end mid-block, undecayed tensors between
    decayed ones) with one frozen tensor, its weights initialised."""
    cfg = ModelConfig.from_hf(tiny_config("qwen2", hidden_size=48))
    units = build_units(cfg)
    layer = units[1]
    frozen = [dataclasses.replace(p, train=p.name != "self_attn.k_proj.weight") for p in layer.params]
    units[1] = dataclasses.replace(layer, params=tuple(frozen))
    state = HostState(units, moments=moments)
    init_random(state, cfg, seed=0)
    return state


def _grads(state: HostState, step: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Each unit's gradient: random, with zero tensors (the head's, from the first step; every one
    at the third), and huge elements among tiny ones in a block (their squares near fp32's top)."""
    grads = [torch.randn(u.numel, generator=gen) * 1e-2 for u in state.units]
    grads[-1].zero_()
    if step == 3:
        return [g.zero_() for g in grads]
    layer = grads[1]
    layer[:BLOCK] *= 1e-12
    layer[7] = 3e17
    layer[BLOCK + 5] = -2e18
    return grads


def _tensors(state: HostState, unit, spec):
    """A parameter's weights and moment buffers in the state (its absmax: its blocks)."""
    a, b = spec.offset, spec.offset + spec.numel
    out = [state.master(unit)[a:b]]
    for f in state.moments.fields:
        out.append(state.flat(unit, f.name)[a // f.per : -(-b // f.per)])
    return out


def _reference_step(ref: dict, specs, grads, coef, lr: float, step: int, moments: Moments) -> None:
    """The transcription's step of every trained parameter of `specs` in `ref` (key -> its weights
    and moment buffers), from each unit's gradient times the clip coefficient (None: not clipped)."""
    rule = reference_8bit if moments == Q8 else reference_bf16
    for u, p in specs:
        if not p.train:
            continue
        g = grads[u.index][p.offset : p.offset + p.numel]
        g = g if coef is None else g * torch.tensor(coef)
        ref[p.key] = rule(*ref[p.key][:1], g, *ref[p.key][1:], lr, step, p.decay)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch-ops"])
@pytest.mark.parametrize("moments", [Q8, BF16], ids=["8bit", "bf16"])
def test_the_engines_pass_equals_the_transcription_bitwise_step_for_step(moments, kernel, monkeypatch):
    """The host pass (momentkernel.py's kernel, or engine/moments.py's torch ops where it is
    unavailable) over held gradients, clipped or not, in chunks that cut tensors on blocks."""
    if kernel:
        assert momentkernel.load()[0] is not None, momentkernel.load()[1]
    else:
        monkeypatch.setattr(momentkernel, "_LOADED", (None, "not asked for"))
    state = _state(moments)
    opt = HostAdamW(state, AdamWConfig(1e-2, BETAS, EPS, WD, moments))
    specs = [(u, p) for u in state.units for p in u.params]
    assert any(p.numel % BLOCK for _, p in specs) and any(not p.decay for _, p in specs)
    ref = {p.key: [t.clone() for t in _tensors(state, u, p)] for u, p in specs}
    gen = torch.Generator().manual_seed(0)
    for step, (coef, lr, chunk) in enumerate(STEPS, start=1):
        grads = _grads(state, step, gen)
        _reference_step(ref, specs, grads, coef, lr, step, moments)
        for u in state.units:
            opt.step_held(u, grads[u.index], None if coef is None else torch.tensor(coef), lr, step, chunk)
        for u, p in specs:
            for i, (ours, theirs) in enumerate(zip(_tensors(state, u, p), ref[p.key])):
                assert same(ours, theirs), (step, p.key, i, (ours != theirs).sum().item())
    layer = state.units[1]
    first = state.flat(layer, "exp_avg_sq")[:BLOCK].float() if moments == BF16 else None
    if moments == Q8:  # the huge squares set their block's absmax: the tiny ones' codes are zero
        assert state.flat(layer, "exp_avg_sq_absmax")[0] > 1e33
    else:
        assert first is not None and first.max() > 1e33


def test_block_edges_zero_blocks_and_single_elements_as_the_transcription():
    """step_span over tensors of every kind of end: one element, a block and one, a partial block,
    several blocks; a tensor whose moments are all zero keeps index 0 and absmax 0."""
    gen = torch.Generator().manual_seed(3)
    for n in (1, 255, 256, 257, 1000, 5000):
        p = torch.randn(n, generator=gen)
        st = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
        st += [torch.zeros(-(-n // BLOCK)), torch.zeros(-(-n // BLOCK))]
        ref = [p.clone(), *(t.clone() for t in st)]
        for step in range(1, 5):
            g = torch.zeros(n) if step == 2 else torch.randn(n, generator=gen) * 10.0 ** (step - 3)
            h = low.Hyper.of(1e-3, step, BETAS, EPS, WD)
            low.step_span(p, g, tuple(st), h, decay=True)
            ref = reference_8bit(ref[0], g, *ref[1:], 1e-3, step, True)
            for ours, theirs in zip((p, *st), ref):
                assert same(ours, theirs), (n, step)
    zero = [torch.zeros(300, dtype=torch.uint8)] * 2 + [torch.zeros(2)] * 2
    low.step_span(
        torch.ones(300), torch.zeros(300), tuple(zero), low.Hyper.of(1e-3, 1, BETAS, EPS, 0.0), False
    )
    assert not any(t.any() for t in zero)


def test_the_nearest_value_is_argmins_on_midpoints_and_their_neighbours():
    """The quantiser's search equals argmin of |x - code| on the values where it is hardest: each
    midpoint of two neighbours and the fp32 values beside it, the ends, and zero."""
    for code in (SIGNED, UNSIGNED):
        mids = (code[:-1] + code[1:]) / 2
        x = torch.cat([mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(torch.tensor(-2.0)), code])
        x = torch.cat([x, torch.tensor([-1.0, 1.0, 0.0, -0.0])]).clamp(-1, 1)
        want = (x[:, None] - code[None, :]).abs().argmin(dim=1)
        assert torch.equal(low.nearest(x, code), want)


def test_the_maps_are_bitsandbytes():
    import bitsandbytes.functional as bnbf

    for signed in (True, False):
        ours, theirs = low.dynamic_map(signed), bnbf.create_dynamic_map(signed=signed)
        assert same(ours, theirs) and same(dynamic_map(signed), theirs)


# ---------------------------------------------------------------------------- bitsandbytes itself
def lut_resolution() -> float:
    """The width of a bin of bitsandbytes' CPU quantiser's table (csrc/cpu_ops.cpp,
    `build_quantize_lut`: [-1, 1] in 65536 bins, each mapped to one code)."""
    return 2.0 / 65535


@pytest.mark.parametrize("n", [1000, 4096, 5000])
def test_bitsandbytes_adamw8bit_steps_as_the_engine_step_for_step(n):
    """bitsandbytes' AdamW8bit on a CPU tensor (min_8bit_size=0: every tensor 8-bit) and the
    engine's step, each step from bitsandbytes' state: the same weights and absmax (to fp32
    rounding: bitsandbytes' CPU update fuses multiply-adds), and the same codes but where its
    table's bins are coarser than the map (the engine's code is the nearest; bitsandbytes' within
    a bin of it)."""
    import bitsandbytes as bnb

    gen = torch.Generator().manual_seed(n)
    param = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02)
    opt = bnb.optim.AdamW8bit([param], lr=1e-3, betas=BETAS, eps=EPS, weight_decay=WD, min_8bit_size=0)
    differ = 0
    for step in range(1, 6):
        g = torch.randn(n, generator=gen) * 1e-2
        if step == 3:
            g[: BLOCK + 3] = 0.0  # a block of zero gradient: its moments decay
        if step == 4:
            g[11] = 1e17
        st = opt.state[param] if step > 1 else None
        ours = [param.detach().clone()]
        if st is None:
            ours += [torch.zeros(n, dtype=torch.uint8) for _ in "mv"] + [
                torch.zeros(-(-n // BLOCK)) for _ in "mv"
            ]
        else:
            ours += [st[k].clone() for k in ("state1", "state2", "absmax1", "absmax2")]
        before = [t.clone() for t in ours]
        low.step_span(ours[0], g, tuple(ours[1:]), low.Hyper.of(1e-3, step, BETAS, EPS, WD), decay=True)
        param.grad = g.clone()
        opt.step()
        st = opt.state[param]
        torch.testing.assert_close(ours[0], param.detach(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(ours[3], st["absmax1"], rtol=1e-6, atol=0)
        torch.testing.assert_close(ours[4], st["absmax2"], rtol=1e-6, atol=0)
        # The new moments in fp32 (the transcription's arithmetic is the engine's), over their absmax.
        spread = [t.repeat_interleave(BLOCK)[:n] for t in before[3:]]
        m, v = SIGNED[before[1].long()] * spread[0], UNSIGNED[before[2].long()] * spread[1]
        _, m, v = adamw32(before[0], g, m, v, 1e-3, step, True)
        new = [t.repeat_interleave(BLOCK)[:n] for t in ours[3:]]
        for x, scale, codes, theirs, code in (
            (m, new[0], ours[1], st["state1"], SIGNED),
            (v, new[1], ours[2], st["state2"], UNSIGNED),
        ):
            x = torch.nan_to_num(x / scale).clamp(-1, 1)  # a block of zeros: 0/0, index 0
            assert torch.equal(codes.long(), low.nearest(x, code).masked_fill_(scale == 0, 0)), step
            mine, bins = (x - code[codes.long()]).abs(), (x - code[theirs.long()]).abs()
            assert bool((bins <= mine + lut_resolution()).all()), (step, (bins - mine).max().item())
            differ += int((codes != theirs).sum())
    assert differ < 0.1 * 5 * 2 * n  # most codes agree


def test_a_kernel_whose_results_differ_is_refused_and_the_torch_ops_step(monkeypatch, caplog):
    """The kernel is checked against the torch ops before it steps anything: one that differs in
    a bit is refused with why, and the host steps with the torch ops."""
    good = momentkernel.load()[0]
    assert good is not None

    class Off(momentkernel.MomentKernel):
        def __init__(self):
            self.__dict__.update(good.__dict__)

        def step(self, p, *args, **kw):
            super().step(p, *args, **kw)
            p[-1:] = p[-1:].nextafter(torch.tensor(1.0))  # one ulp off

    with pytest.raises(momentkernel.Unavailable, match="differ from the torch ops"):
        momentkernel.check(Off())
    monkeypatch.setattr(momentkernel, "_LOADED", None)
    monkeypatch.setattr(momentkernel, "MomentKernel", Off)
    with caplog.at_level("WARNING"):
        assert momentkernel.load()[0] is None
    assert "the torch ops step" in caplog.text


# ---------------------------------------------------------------------------- the GPU's paths
@pytest.mark.parametrize("prestage", [False, True], ids=["chunked", "prestaged"])
@pytest.mark.parametrize("moments", [Q8, BF16], ids=["8bit", "bf16"])
def test_gpu_stepped_units_end_where_the_host_optimizer_puts_them(moments, prestage):
    """The GPU stepper in program order (the CPU; with a skip flag, so its steps take the torch
    ops CUDA runs) through scratch chunks of whole blocks, or prestaged a share of blocks at a
    time, gives bitwise the state the host optimizer's kernel gives whole units, clipped, over
    three steps; its fresh weights are the master's in the compute dtype; a skipped step changes
    nothing; it moves each unit's state in its format's bytes."""
    from megatrain.engine.gpustep import GpuStepper
    from megatrain.engine.optim import clip_scaled

    adamw = AdamWConfig(1e-2, BETAS, EPS, WD, moments)
    state, ref = _state(moments), _state(moments)
    units = state.units[:3]
    stepper = GpuStepper(state, adamw, units, torch.bfloat16, chunk=1024, prestage=prestage)
    host = HostAdamW(ref, adamw)
    gen = torch.Generator().manual_seed(5)
    buffers = state.buffers
    for step in (1, 2, 3, 4):
        coef, skip = torch.tensor(0.3 + 0.1 * step), torch.tensor(step == 4)
        for share in (0.3, 0.61):
            stepper.prestage(share)
        grads = [torch.randn(u.numel, generator=gen) * 1e-2 for u in units]
        stepper.step([(u, g.clone()) for u, g in zip(units, grads)], coef, 1e-2, step, skip)
        if step < 4:
            for u, g in zip(units, grads):
                host.step_range(u, 0, u.numel, clip_scaled(g.clone(), coef), 1e-2, step)
        for w in buffers:
            assert same(getattr(state, w), getattr(ref, w)), (step, w)
        for u in units:
            assert same(stepper.take(u)[0], ref.flat(u, "hi"))
    nbytes = sum(4 * u.numel + moments.nbytes(u.numel) for u in units)
    assert stepper.d2h_bytes == 4 * nbytes and stepper.h2d_bytes == 4 * nbytes


@pytest.mark.parametrize("moments", [Q8, BF16], ids=["8bit", "bf16"])
def test_the_embeddings_rows_computed_ahead_are_its_updates_rows(moments):
    """`step_rows` (the next pass's rows of the embedding, engine/rows.py) on bf16 and 8-bit
    moments: from the table's gradient and from the step's rows alone, the weights the whole
    table's pass then writes for them, bitwise; the state is left as it was. A row of 48 elements
    is not a block: rows read the absmax of the blocks their elements lie in."""
    state = _state(moments)
    unit = state.units[0]
    opt = HostAdamW(state, AdamWConfig(1e-2, BETAS, EPS, WD, moments))
    V, H = unit.params[0].shape
    assert H % BLOCK
    gen = torch.Generator().manual_seed(1)
    for step, coef in enumerate((0.37, None, 0.6), start=1):
        grad = torch.zeros(unit.numel)  # the table, then its padding to the unit's page
        table_grad = grad[: V * H].view(V, H)
        touched = torch.randperm(V, generator=gen)[: V // 2].sort().values
        table_grad[touched] = torch.randn(len(touched), H, generator=gen) * 1e-2
        rows = torch.randperm(V, generator=gen)[: V // 3].sort().values
        c = None if coef is None else torch.tensor(coef)
        before = [state.flat(unit, w).clone() for w in state.buffers]
        pos = torch.searchsorted(touched, rows).clamp(max=len(touched) - 1)
        index = torch.where(touched[pos] == rows, pos, -1)
        outs = [torch.empty(len(rows), H, dtype=torch.bfloat16), torch.empty(len(rows), H)]
        opt.step_rows(unit, rows, table_grad, c, 1e-2, step, outs[0])
        opt.step_rows(unit, rows, table_grad[touched].contiguous(), c, 1e-2, step, outs[1], index)
        for w, was in zip(state.buffers, before):
            assert same(state.flat(unit, w), was)
        opt.step_held(unit, grad, c, 1e-2, step, 1 << 20)
        table = state.master(unit)[: V * H].view(V, H).index_select(0, rows)
        assert same(outs[0], to_bf16(table)) and same(outs[1], table), step


@pytest.mark.gpu
@pytest.mark.parametrize("moments", [Q8, BF16], ids=["8bit", "bf16"])
def test_the_one_pass_gpu_kernel_steps_the_transcriptions_bits(moments):
    """engine/momentgpu.py's Triton kernel loads on CUDA (its self-check against the CPU's torch
    ops passed) and, through the engine's step of each unit's GPU-resident state (`adamw_range`:
    spans of several tensors, frozen and undecayed ones, tensors that end mid-block, clipped
    gradients, zero gradients, huge elements among tiny ones), gives the transcription's bits step
    for step, as the host's kernel does; a nonzero skip flag leaves everything as it was."""
    from megatrain.engine import momentgpu
    from megatrain.engine.optim import adamw_range, clip_scaled

    dev = torch.device("cuda")
    loaded, why = momentgpu.load(dev)
    assert loaded, why
    state = _state(moments)
    cfg = AdamWConfig(1e-2, BETAS, EPS, WD, moments)
    gpu = {
        u.index: [state.master(u).to(dev)] + [state.flat(u, f.name).to(dev) for f in moments.fields]
        for u in state.units
    }
    specs = [(u, p) for u in state.units for p in u.params]
    ref = {p.key: [t.clone() for t in _tensors(state, u, p)] for u, p in specs}
    gen = torch.Generator().manual_seed(0)
    for step, (coef, lr, _) in enumerate(STEPS, start=1):
        grads = _grads(state, step, gen)
        c = None if coef is None else torch.tensor(coef, device=dev)
        for u in state.units:
            p, *ms = gpu[u.index]
            adamw_range(u, 0, u.numel, p, clip_scaled(grads[u.index].to(dev), c), tuple(ms), cfg, lr, step)
        _reference_step(ref, specs, grads, coef, lr, step, moments)
        for u, p in specs:
            a, b = p.offset, p.offset + p.numel
            ours = [gpu[u.index][0][a:b]] + [
                t[a // f.per : -(-b // f.per)] for t, f in zip(gpu[u.index][1:], moments.fields)
            ]
            for i, (o, t) in enumerate(zip(ours, ref[p.key])):
                assert same(o.cpu(), t), (step, p.key, i, (o.cpu() != t).sum().item())
    before = {k: [t.clone() for t in v] for k, v in gpu.items()}
    flag = torch.ones((), device=dev)
    for u in state.units:
        p, *ms = gpu[u.index]
        adamw_range(u, 0, u.numel, p, torch.randn(u.numel, device=dev), tuple(ms), cfg, 1e-2, 9, flag)
    assert all(same(a, b) for k in gpu for a, b in zip(gpu[k], before[k]))


def test_a_gpu_kernel_that_fails_to_build_or_check_is_refused_with_its_reason(monkeypatch, caplog):
    """momentgpu.load: a Triton that raises while building or checking the kernel, or one whose
    results differ, leaves the torch ops to step on that device, saying why in one warning."""
    from megatrain.engine import momentgpu
    from megatrain.engine.clipadam import Unavailable

    monkeypatch.setattr(momentgpu, "triton", object())  # as if installed
    monkeypatch.setattr(momentgpu, "_LOADED", {})

    cases = [
        (
            "cuda:0",
            RuntimeError("PTX assembly aborted\nmore"),
            "Triton failed: RuntimeError: PTX assembly aborted",
        ),
        ("cuda:1", Unavailable("its results differ from the torch ops' on the CPU"), None),
    ]
    for device, error, why in cases:

        def check(_device, error=error):
            raise error

        monkeypatch.setattr(momentgpu, "check", check)
        assert momentgpu.load(torch.device(device)) == (False, why or str(error))
        assert "the torch ops step them" in caplog.text
    assert momentgpu.load(torch.device("cuda:0"))[0] is False  # decided once a device

"""momentkernel.py's kernel on the master's halves (`step_halves`, the clip multiplied in its pass)
against the path it replaces, fp32 joined from the halves, stepped and split back: bitwise, over
several clipped steps, spans of every kind of block end, zero blocks and huge gradients, in the
engine's host pass and in the kernel alone; and a kernel whose halves differ is refused."""

from __future__ import annotations

import pytest
import torch
from test_moments import BETAS, EPS, WD, _grads, _state, same

from megatrain.engine import momentkernel
from megatrain.engine import moments as low
from megatrain.engine.optim import AdamWConfig, HostAdamW, clip_scaled
from megatrain.host.moments import BF16, BLOCK, Q8
from megatrain.host.split import join, split

# (clip coefficient, learning rate, elements a chunk of the join/step/split pass): a clip that
# fires, none, a norm under the threshold, a clip again; the fifth step's gradient is huge.
STEPS = [(0.37, 1e-2, 512), (None, 5e-3, 10**9), (1.0, 2e-3, 256), (0.6, 1e-3, 1280), (0.25, 1e-3, 768)]


def _kernel() -> momentkernel.MomentKernel:
    kernel, why = momentkernel.load()
    assert kernel is not None, why
    return kernel


@pytest.mark.parametrize("moments", [Q8, BF16], ids=["8bit", "bf16"])
def test_the_host_pass_on_the_halves_equals_join_step_split_bitwise(moments, monkeypatch):
    """`step_held` with the kernel on the halves and with the join/step/split path (`fused_clip`
    off: fp32 made from the halves a chunk at a time, the clip multiplied apart) leave every
    buffer of the state the same bits, step for step, on two threads taking small blocks."""
    kernel = _kernel()
    monkeypatch.setattr(momentkernel, "MIN_PER_THREAD", 64)
    monkeypatch.setattr(momentkernel, "TAKE", 1)  # a block at a time: the threads interleave
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        states = [_state(moments), _state(moments)]
        opts = [HostAdamW(st, AdamWConfig(1e-2, BETAS, EPS, WD, moments)) for st in states]
        opts[1].fused_clip = False
        assert opts[0]._loaded() is kernel and opts[1]._loaded() is None
        gen = torch.Generator().manual_seed(1)
        for step, (coef, lr, chunk) in enumerate(STEPS, start=1):
            grads = _grads(states[0], step, gen)
            if step == 5:
                grads[1][3 * BLOCK : 3 * BLOCK + 9] = 1e21  # times 0.25: squares past fp32's top
            c = None if coef is None else torch.tensor(coef)
            for opt, st in zip(opts, states):
                for u, g in zip(st.units, grads):
                    opt.step_held(u, g.clone(), c, lr, step, chunk)
            for w in states[0].buffers:
                a, b = getattr(states[0], w), getattr(states[1], w)
                assert same(a, b), (step, w, (a != b).sum().item())
        squares = states[0].flat(states[0].units[1], "exp_avg_sq" + ("_absmax" if moments == Q8 else ""))
        assert squares.float().isinf().any()  # the huge gradients reached the moments
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 511, 768, 1025, 5000])
@pytest.mark.parametrize("moments", [Q8, BF16], ids=["8bit", "bf16"])
def test_the_kernel_on_halves_equals_the_torch_ops_on_joined_weights(n, moments):
    """`step_halves` on a span that ends anywhere in a block, against the torch ops on fp32 joined
    from the same halves, the gradient clipped by `clip_scaled`, then split: the same halves and
    moments bit for bit, and the gradient left as it was; a block of zero gradients (its moments
    stay zero from the start: index 0, absmax 0), tiny and huge gradients in one block, weights
    at the halves' special cases (the largest magnitudes, whose bf16 half is a zero)."""
    kernel = _kernel()
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen) * 0.02
    p[: min(n, 2)] = torch.tensor([3.4028235e38, -3.4e38])[: min(n, 2)]
    if moments == Q8:
        st = [torch.zeros(n, dtype=torch.uint8) for _ in "mv"] + [torch.zeros(-(-n // BLOCK)) for _ in "mv"]
    else:
        st = [torch.zeros(n, dtype=torch.bfloat16) for _ in "mv"]
    ours, theirs = [split(p), *(t.clone() for t in st)], [split(p), *(t.clone() for t in st)]
    for step, coef in enumerate((0.37, None, 0.5, 0.8), start=1):
        g = torch.randn(n, generator=gen) * 10.0 ** (step - 4)
        if step == 3:
            g[n // 3] = 3e18
            g[: min(n, BLOCK)] *= torch.where(torch.arange(min(n, BLOCK)) % 2 == 0, 1e-30, 1.0)
        g[BLOCK : 2 * BLOCK] = 0.0  # a block of zeros throughout (where the span has one)
        h = low.Hyper.of(1e-3, step, BETAS, EPS, WD)
        held = g.clone()
        kernel.step_halves(ours[0], g, tuple(ours[1:]), h, True, threads=2, coef=coef)
        assert same(g, held)
        w, scaled = join(theirs[0]), clip_scaled(g.clone(), None if coef is None else torch.tensor(coef))
        low.step_span(w, scaled, tuple(theirs[1:]), h, True)
        theirs[0] = split(w)
        for i, (a, b) in enumerate(zip((*ours[0], *ours[1:]), (*theirs[0], *theirs[1:]))):
            assert same(a, b), (n, step, i, (a != b).sum().item())
    if n > BLOCK:
        zero = ours[1][BLOCK : min(n, 2 * BLOCK)]
        assert not zero.float().any()


def test_a_kernel_whose_halves_differ_is_refused_and_the_join_path_steps(monkeypatch, caplog):
    """A kernel whose halves are not host/split.py's (a bf16 half truncated: its weights come back
    through its own join, its fetches would differ) is refused by the load-time check; the host
    then steps bf16 moments on fp32 made from the halves, as the torch ops do, with a warning."""
    rule = (
        "uint32_t hi = top + (carry & (mag < 0x7F7Fu));",
        "uint32_t top_ = top - (carry & (mag == 0x7F7Fu)); uint32_t hi = top_;",
    )
    undo = ("uint32_t top = hi - (carry & (mag != 0) & (mag <= 0x7F7Fu));", "uint32_t top = hi;")
    truncating = momentkernel.SOURCE.replace(*rule).replace(*undo)
    assert truncating != momentkernel.SOURCE
    monkeypatch.setattr(momentkernel, "SOURCE", truncating)
    with pytest.raises(momentkernel.Unavailable, match="differ from the torch ops"):
        momentkernel.check(momentkernel.MomentKernel())
    monkeypatch.setattr(momentkernel, "_LOADED", None)
    with caplog.at_level("WARNING"):
        assert momentkernel.load()[0] is None
    assert "fp32 made from the halves" in caplog.text
    state, ref = _state(BF16), _state(BF16)
    opt = HostAdamW(state, AdamWConfig(1e-2, BETAS, EPS, WD, BF16))
    assert opt._loaded() is None
    gen = torch.Generator().manual_seed(2)
    grads = _grads(state, 1, gen)
    for u, g in zip(state.units, grads):
        opt.step_held(u, g.clone(), torch.tensor(0.37), 1e-2, 1, 512)
    for u, g in zip(ref.units, grads):  # the torch ops, spec by spec, on the joined weights
        g = g * torch.tensor(0.37)
        for spec in u.params:
            if not spec.train:
                continue
            a, b = spec.offset, spec.offset + spec.numel
            w = ref.master(u, a, b)
            moments = tuple(ref.flat(u, name)[a:b] for name in ref.moment_names)
            wd = WD if spec.decay else 0.0
            low.step_span(w, g[a:b], moments, low.Hyper.of(1e-2, 1, BETAS, EPS, wd), spec.decay)
            ref.set_master(u, a, w)
    for name in state.buffers:
        assert same(getattr(state, name), getattr(ref, name)), name


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_the_kernels_lookup_gives_the_torch_ops_nearest_index(signed):
    """The kernel's table for the nearest value of the dynamic map (one load and one comparison a
    value, `momentkernel.lookup`) gives the index engine/moments.py's `nearest` gives: at every
    edge between two values and the floats either side of it, at 0, -0, 1 and -1, and on values
    spread over [-1, 1] and over their magnitudes down to 1e-12."""
    code = low.dynamic_map(signed)
    look = momentkernel.lookup(code)
    gen = torch.Generator().manual_seed(3)
    edge = momentkernel.edges(code)[:-1]
    spread = torch.rand(1 << 20, generator=gen) * 2 - 1
    x = torch.cat([
        edge, edge.nextafter(torch.tensor(2.0)), edge.nextafter(torch.tensor(-2.0)), code,
        torch.tensor([0.0, -0.0, 1.0, -1.0]), spread, spread * 10 ** (-12 * torch.rand(1 << 20, generator=gen)),
    ])  # fmt: skip
    x = x.clamp(-1.0, 1.0) if signed else x.abs().clamp(max=1.0)
    assert torch.equal(momentkernel._nearest(look, x), low.nearest(x, code))

"""The loss head's two shortcuts (objectives/): cross-entropy's one-pass loss and gradient against
autograd through `F.cross_entropy` of the fp32 logits, which it replaces (fp32 and bf16, ignored
labels, through the engine's chunked head); the LM weight's gradient added into its buffer by the
projection's own backward, the same numbers as autograd's gradient added after."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILY_OVERRIDES, tiny_hf_model
from test_parity import _batch, _megatrain

from megatrain.data.batch import IGNORE_INDEX
from megatrain.objectives import losshead
from megatrain.objectives.base import Objective
from megatrain.objectives.cross_entropy import CrossEntropy, loss_and_grad
from megatrain.planning.placement import Choices


def _autograd(z: torch.Tensor, labels: torch.Tensor, total: int):
    """What the head did before: fp32 logits, `F.cross_entropy` summed, over the step's count."""
    zl = z.detach().requires_grad_()
    l_sum = F.cross_entropy(zl.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (g,) = torch.autograd.grad(l_sum / total, zl)
    return l_sum.detach(), g


def _case(dtype, T=37, V=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::5] = IGNORE_INDEX
    return z, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_loss_and_gradient_equal_autograds(dtype):
    z, labels = _case(dtype)
    total = 29
    ref_loss, ref_grad = _autograd(z, labels, total)
    loss, grad, _ = loss_and_grad(z, labels, torch.full((), 1.0 / total))
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == z.shape
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-8)
    else:  # both round an fp32 gradient to bf16: at most one unit in its last place apart
        diff = (grad.float() - ref_grad.float()).abs()
        assert (diff <= ref_grad.float().abs() * 2**-7 + 1e-9).all()
        assert (grad == ref_grad).float().mean() > 0.95
    ignored = labels == IGNORE_INDEX
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    # each counted row sums to zero (softmax minus one-hot), scaled; to bf16's rounding in bf16
    sums = grad[~ignored].float().sum(-1)
    assert sums.abs().max() < (1e-7 if dtype == torch.float32 else 4e-4)
    assert z.dtype == dtype and torch.equal(z, _case(dtype)[0])  # the logits are left as they were


def test_a_chunk_with_no_label_has_no_loss_and_no_gradient():
    z, _ = _case(torch.bfloat16, T=4)
    loss, grad, _ = loss_and_grad(z, torch.full((4,), IGNORE_INDEX), torch.ones(()))
    assert loss.item() == 0.0 and not grad.any()


def test_it_compiles_as_one_graph():
    """Compiled on CUDA (`Head.fused`): traced whole, its in-place steps functionalised (the
    compiler's tracing and autograd-free lowering, no code generated on the CPU)."""
    z, labels = _case(torch.bfloat16)
    scale = torch.full((), 0.25)
    fn = torch.compile(loss_and_grad, backend="aot_eager", fullgraph=True)
    loss, grad, stats = fn(z, labels, scale)
    ref_loss, ref_grad, ref_stats = loss_and_grad(z, labels, scale)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad) and torch.equal(stats, ref_stats)


def test_its_metric_sums_are_trls_entropy_and_token_accuracy():
    """The entropy and top-1 sums over the labels, as a plain fp64 computation (TRL's SFT
    `entropy` and `mean_token_accuracy` numerators); a tie at the maximum counts for the first."""
    z, labels = _case(torch.float32)
    z[0, 5] = z[0].max() + 1
    z[0, 9] = z[0, 5]  # a tie: the first index is the most likely one
    labels[0], labels[1] = 9, int(z[1].argmax())  # row 0's label ties the maximum, row 1's is it
    _, _, (ent, top1) = loss_and_grad(z, labels, torch.ones(()))
    valid = labels != IGNORE_INDEX
    p = z.double().softmax(-1)
    want_ent = -(p * p.log()).sum(-1)[valid].sum()
    want_top1 = (z.argmax(-1) == labels)[valid].sum()
    assert ent.item() == pytest.approx(want_ent.item(), rel=1e-6)
    assert top1.item() == want_top1.item() and 0 < want_top1 < valid.sum()


def _grads(objective: Objective, path, family="llama", tied=False):
    hf = tiny_hf_model(family, tied, **FAMILY_OVERRIDES.get(family, {}))
    mt = _megatrain(hf, path, objective=objective, choices=Choices(loss_chunk_tokens=7))
    loss, _ = mt.engine.forward_backward([_batch(hf.config.vocab_size)])
    return loss, mt.engine.named_grads()


def test_the_engine_trains_on_it_as_on_autograds_cross_entropy(tmp_path):
    loss, grads = _grads(CrossEntropy(), tmp_path / "a")
    ref_loss, ref = _grads(CrossEntropy(one_pass=False), tmp_path / "b")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert grads.keys() == ref.keys()
    for k, g in grads.items():
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# decoder.Head, Gemma 2's soft-capped logits, Cohere's scaled and tied ones, transformers' own head
# (the generic path: Granite's), and Phi's LM head with a bias, which the projection leaves to autograd.
HEADS = [("llama", False, True), ("gemma2", False, True), ("cohere", True, True), ("granite", False, True)]
HEADS += [("phi", False, False)]


@pytest.mark.parametrize("family,tied,routed", HEADS, ids=[h[0] for h in HEADS])
def test_the_lm_weights_gradient_added_by_the_projection_is_autograds(
    family, tied, routed, tmp_path, monkeypatch
):
    taken = []
    backward = losshead._IntoGradW.backward
    monkeypatch.setattr(losshead._IntoGradW, "backward", lambda ctx, dz: taken.append(1) or backward(ctx, dz))
    loss, grads = _grads(CrossEntropy(), tmp_path / "a", family, tied)
    assert bool(taken) == routed
    monkeypatch.setattr(losshead._IntoGradW, "routed", lambda W, g: contextlib.nullcontext())
    ref_loss, ref = _grads(CrossEntropy(), tmp_path / "b", family, tied)
    assert torch.equal(loss, ref_loss) and grads.keys() == ref.keys()
    assert all(torch.equal(g, ref[k]) for k, g in grads.items())


@pytest.mark.gpu
def test_on_cuda_the_projection_accumulates_the_weights_gradient_in_fp32():
    """One GEMM with an fp32 output adds bf16 operands' product into the fp32 buffer: the fp32
    product of the same operands added, to fp32 rounding (not bf16's)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 3000, device="cuda", generator=g).bfloat16()
    b = torch.randn(3000, 256, device="cuda", generator=g).bfloat16()
    out = torch.randn(512, 256, device="cuda", generator=g)
    ref = out + a.double().mm(b.double()).float()
    rounded_first = out + (a @ b).float()  # autograd's bf16 gradient, then added
    losshead.add_product(out, a, b)
    err = (ref - out).abs().max().item()
    assert err < 1e-3 and (ref - rounded_first).abs().max().item() > 10 * err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_on_cuda_it_equals_the_eager_function(dtype):
    z, labels = _case(dtype, T=300, V=32000)
    z, labels, scale = z.cuda(), labels.cuda(), torch.full((), 1 / 77, device="cuda")
    head = losshead.Head(None, {}, z, 1, compile=True)
    loss, grad, _ = head.fused(loss_and_grad)(z, labels, scale)
    ref_loss, ref_grad, _ = loss_and_grad(z, labels, scale)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    rel = 1e-5 if dtype == torch.float32 else 2**-7  # fp32's rounding of exp and the sum; one bf16 step
    assert ((grad.float() - ref_grad.float()).abs() <= ref_grad.float().abs() * rel + 1e-9).all()


def _peak_bytes(fn) -> int:
    """The most bytes of tensors alive at once while `fn` runs, counted storage by storage as each
    operation makes them and freed as they are collected."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Live(TorchDispatchMode):
        now = peak = 0
        seen: dict = {}

        def free(self, key, n):
            self.seen.pop(key, None)
            self.now -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and (st := t.untyped_storage()).data_ptr() not in self.seen:
                    key, n = st.data_ptr(), st.nbytes()
                    self.seen[key] = weakref.finalize(st, self.free, key, n)
                    self.now += n
                    self.peak = max(self.peak, self.now)
            return out

    live = Live()
    with live:
        fn()
    return live.peak


class _NormProject(torch.nn.Module):
    """A final norm's scale, then the LM weight's projection."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))

    def forward(self, x, W):
        return (x * self.weight) @ W.T


@pytest.mark.parametrize("objective", ["grpo", "sequence sums"])
def test_a_log_prob_objectives_head_holds_what_the_plan_counts_a_logit(objective):
    """The objectives that take their loss through autograd over a chunk's fp32 logits (grpo's with
    a temperature, a KL term and its entropy metric; the preference stages' weighted log-probs)
    hold at most the plan's AUTOGRAD_LOGIT_BYTES a logit, and more than cross-entropy's one pass
    (LOGIT_BYTES), by which the plan sized their chunks before."""
    from megatrain.data.batch import MicroBatch
    from megatrain.objectives.grpo import GRPO, GRPOConfig
    from megatrain.objectives.logprobs import token_logps
    from megatrain.planning.footprint import AUTOGRAD_LOGIT_BYTES, LOGIT_BYTES

    g = torch.Generator().manual_seed(0)
    vocab, hidden_size, rows, width = 4096, 32, 4, 64
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    labels = ids.clone()
    labels[:, :8] = IGNORE_INDEX
    hidden = [torch.randn(rows, width, hidden_size, generator=g).to(torch.bfloat16)]
    W = (torch.randn(vocab, hidden_size, generator=g) * 0.1).to(torch.bfloat16)
    scale = {"weight": torch.ones(hidden_size, dtype=torch.bfloat16)}
    head = losshead.Head(
        _NormProject(hidden_size), scale, W, chunk=rows * width,
        grads={"weight": torch.zeros(hidden_size)}, grad_W=torch.zeros(vocab, hidden_size),
    )  # fmt: skip
    if objective == "grpo":
        obj = GRPO(
            GRPOConfig(num_generations=2, beta=0.04, num_iterations=2, temperature=0.7), micro_batches=1
        )
        mb = MicroBatch(
            ids, labels, extra=torch.randn(rows, 1, generator=g).double(),
            token_extra=torch.randn(rows, width, 2, generator=g) * 0.1 - 8,
        )  # fmt: skip
        targets = [obj.targets(mb, torch.device("cpu"))]

        def run():
            obj.loss_and_grads(head, hidden, targets, total=rows)
    else:
        tokens, weights = ids.reshape(-1), torch.randn(rows * width, generator=g)

        def chunk_loss(m, a, z):  # objectives/sequence_sums.py's
            term = (weights[a : a + len(z)] * token_logps(z, tokens[a : a + len(z)])).sum()
            return term, term.detach() * 0

        def run():
            head.backward(hidden, chunk_loss)

    per_logit = _peak_bytes(run) / (rows * width * vocab)
    assert LOGIT_BYTES < per_logit <= AUTOGRAD_LOGIT_BYTES, per_logit

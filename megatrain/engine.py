"""The layer-streaming engine: a forward sweep that keeps only layer-boundary activations, a
loss head that never materialises the full logits, and a backward sweep that recomputes each
layer from its saved input and produces its gradients.

Every micro-batch of an optimizer step passes through a layer during one visit, so each unit's
weights reach the device twice per optimizer step (forward, backward) however many micro-batches
there are. Weights arrive through a `Transport` (transport.py), which also carries the fp32
gradients back and applies the optimizer; the engine itself does only arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call

from .batch import IGNORE_INDEX, MicroBatch
from .models.config import ModelConfig
from .models.decoder import DecoderLayer, Head, attention_mask, rope_cos_sin, rope_inv_freq
from .state import HostState, Unit, unit_views


@dataclass
class _Prepared:
    ids: torch.Tensor  # [B, S] on device
    targets: torch.Tensor  # [B*S] shifted labels on device
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None


@dataclass
class _Graph:
    """A layer whose autograd graph was kept from the forward sweep: no recompute, no refetch."""

    params: dict[str, torch.Tensor]
    xs: list[torch.Tensor | None]
    ys: list[torch.Tensor | None]


def _bind(unit: Unit, flat: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
    views = unit_views(flat, unit)
    if grad:
        views = {k: v.detach().requires_grad_() for k, v in views.items()}
    return views


def _accumulate(gflat: torch.Tensor, unit: Unit, names: list[str], grads) -> None:
    """Add per-parameter gradients (compute dtype) into the unit's fp32 gradient buffer."""
    views = unit_views(gflat, unit)
    torch._foreach_add_([views[n] for n in names], [g.to(torch.float32) for g in grads])


class Engine:
    """Runs forward and backward sweeps over a host-resident model.

    `forward_backward` leaves fp32 gradients (one flat buffer per unit, on the compute device);
    `step` clips them by the global norm and hands them to the transport's optimizer.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        state: HostState,
        transport,
        device: torch.device,
        compute_dtype: torch.dtype,
        loss_chunk_tokens: int | None = None,
        compile: bool = False,
        keep_layers: int | str = "auto",
        offload_activations: bool | str = "auto",
    ):
        self.cfg, self.state, self.transport = cfg, state, transport
        self.device, self.dtype = torch.device(device), compute_dtype
        self.units = state.units
        self.embed_unit, self.head_unit = self.units[0], self.units[-1]
        self.layer_units = self.units[1:-1]
        self._host_acts_on = False
        with torch.device("meta"):
            self.layer = DecoderLayer(cfg)
            self.head = Head(cfg)
        self._layer_call = self._call_layer
        if compile:
            # Fuses the norms, rotary embedding, SiLU gating and residual adds around the matmuls.
            self._layer_call = torch.compile(self._call_layer)
        self.inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(self.device)
        # Logits of one chunk in fp32 plus their gradient: about 1 GiB on the CPU, 4 GiB on a GPU.
        budget = 2**32 if self.device.type == "cuda" else 2**30
        self.loss_chunk_tokens = loss_chunk_tokens or max(256, budget // (8 * cfg.vocab_size))
        self.grads: dict[int, torch.Tensor] = {}
        self._norms: dict[int, list[torch.Tensor]] = {}
        # Trailing layers whose autograd graphs are kept from the forward sweep instead of being
        # recomputed: "auto" sizes this from free GPU memory after two measured steps.
        self.keep_layers = 0 if keep_layers == "auto" else int(keep_layers)
        self._keep_auto = keep_layers == "auto" and self.device.type == "cuda"
        self._calls = 0
        self._graph_bytes = 0  # activation memory one layer's graph holds, measured on CUDA
        # Boundary activations stay on the GPU while they fit; "auto" parks them in host memory
        # when they would take more than a third of the card.
        self.offload_activations = offload_activations
        self._host_acts = None

    def _call_layer(self, params, x, cos, sin, mask):
        return functional_call(self.layer, params, (x, (cos, sin), mask))

    # ------------------------------------------------------------------ schedule
    def _schedule(self, backward: bool) -> list[Unit]:
        """The order in which unit weights are needed, so the transport can prefetch."""
        order = [self.embed_unit, *self.layer_units, self.head_unit]
        if self.cfg.tie_word_embeddings:
            order.append(self.embed_unit)  # the head borrows the embedding matrix
        if backward:
            order += self.layer_units[: len(self.layer_units) - self.keep_layers][::-1]
        return order

    def _prepare(self, mb: MicroBatch) -> _Prepared:
        dev = self.device
        ids = mb.input_ids.to(dev, non_blocking=True)
        B, S = ids.shape
        pos = mb.position_ids
        pos = pos.to(dev) if pos is not None else torch.arange(S, device=dev).expand(B, S)
        doc = mb.document_ids.to(dev) if mb.document_ids is not None else None
        return _Prepared(
            ids=ids,
            targets=mb.shifted_labels.to(dev, non_blocking=True).reshape(-1),
            rope=rope_cos_sin(self.inv_freq, self.rope_scale, pos, self.dtype),
            mask=attention_mask(doc, S, self.cfg.sliding_window, dev),
        )

    def _grad(self, unit: Unit) -> torch.Tensor:
        g = self.grads.get(unit.index)
        if g is None:
            g = self.grads[unit.index] = torch.zeros(unit.numel, device=self.device)
        return g

    def _finish_unit(self, unit: Unit) -> None:
        """A unit's gradient is complete: take its per-parameter norms (for clipping) now, on the
        compute stream, while the buffer is hot."""
        views = unit_views(self.grads[unit.index], unit)
        self._norms[unit.index] = torch._foreach_norm([views[p.name] for p in unit.params])

    # ------------------------------------------------------------------ sweeps
    def _forward_sweep(self, prep: list[_Prepared], keep: bool):
        t = self.transport
        w = t.fetch(self.embed_unit)
        emb = unit_views(w, self.embed_unit)["embed_tokens.weight"]
        h = [F.embedding(p.ids, emb) for p in prep]
        del w, emb
        saved: list[list[torch.Tensor] | _Graph] = []
        first_kept = len(self.layer_units) - (self.keep_layers if keep else 0)
        for j, unit in enumerate(self.layer_units):
            if j < first_kept:
                params = _bind(unit, t.fetch(unit), grad=False)
                if keep:
                    saved.append([self._host_acts.park(x) for x in h] if self._host_acts_on else h)
                with torch.no_grad():
                    h = [self._layer_call(params, x, *p.rope, p.mask) for x, p in zip(h, prep)]
            else:
                params = _bind(unit, t.fetch(unit), grad=True)
                xs = [x.detach().requires_grad_() for x in h]
                with torch.enable_grad():
                    ys = [self._layer_call(params, x, *p.rope, p.mask) for x, p in zip(xs, prep)]
                saved.append(_Graph(params, xs, ys))
                h = [y.detach() for y in ys]
            del params
        return h, saved

    def _fetch_parked(self, s):
        """Start bringing a layer's parked inputs back (a kept graph needs nothing)."""
        return s if isinstance(s, _Graph) else [self._host_acts.fetch(p) for p in s]

    def _wait_parked(self, f):
        """Make the compute stream wait for fetched inputs, just before their first use."""
        if isinstance(f, _Graph):
            return f
        stream = torch.cuda.current_stream(self.device)
        for _, ready in f:
            stream.wait_event(ready)
        return [x for x, _ in f]

    def _plan_activations(self, micro_batches: list[MicroBatch]) -> None:
        """Decide whether this step's boundary activations live on the GPU or in host memory."""
        per_layer = sum(mb.num_tokens for mb in micro_batches) * self.cfg.hidden_size * self.dtype.itemsize
        n_saved = len(self.layer_units) - self.keep_layers
        want = self.offload_activations
        if want == "auto":
            want = (
                self.device.type == "cuda"
                and per_layer * n_saved > torch.cuda.get_device_properties(self.device).total_memory / 3
            )
        self._host_acts_on = bool(want) and self.device.type == "cuda" and n_saved > 0
        if self._host_acts_on:
            if self._host_acts is None:
                from .activations import HostActivations

                self._host_acts = HostActivations(self.device)
            aligned = sum(
                -(-mb.num_tokens * self.cfg.hidden_size * self.dtype.itemsize // 512) * 512
                for mb in micro_batches
            )
            self._host_acts.begin(aligned * n_saved)

    def _lm_weight(self, head_params: dict[str, torch.Tensor]):
        if self.cfg.tie_word_embeddings:
            return unit_views(self.transport.fetch(self.embed_unit), self.embed_unit)["embed_tokens.weight"]
        return head_params["lm_head.weight"]

    def _head_loss_backward(self, h: list[torch.Tensor], prep: list[_Prepared], n_tokens: int):
        """Loss (sum over tokens / n_tokens) and its gradient w.r.t. each micro-batch's last hidden
        state, one chunk of tokens at a time; head gradients accumulate in fp32."""
        head = self.head_unit
        params = _bind(head, self.transport.fetch(head), grad=False)
        W = self._lm_weight(params)
        norm_w = params["norm.weight"]
        g_head = self._grad(head)
        g_norm = unit_views(g_head, head)["norm.weight"]
        if self.cfg.tie_word_embeddings:
            g_W = unit_views(self._grad(self.embed_unit), self.embed_unit)["embed_tokens.weight"]
        else:
            g_W = unit_views(g_head, head)["lm_head.weight"]
        loss = torch.zeros((), device=self.device)
        dh = []
        C = self.loss_chunk_tokens
        for x, p in zip(h, prep):
            shape = x.shape
            x = x.detach().reshape(-1, shape[-1]).requires_grad_()
            nw = norm_w.detach().requires_grad_()
            with torch.enable_grad():
                hn = functional_call(self.head.norm, {"weight": nw}, (x,))
            hn_d = hn.detach()
            dhn = torch.empty_like(hn_d)
            for a in range(0, hn_d.shape[0], C):
                tgt = p.targets[a : a + C]
                hc = hn_d[a : a + C].requires_grad_()
                Wl = W.detach().requires_grad_()
                with torch.enable_grad():
                    logits = F.linear(hc, Wl).float()
                    l_sum = F.cross_entropy(logits, tgt, ignore_index=IGNORE_INDEX, reduction="sum")
                    gh, gW = torch.autograd.grad(l_sum / n_tokens, (hc, Wl))
                dhn[a : a + C] = gh
                g_W.add_(gW)
                loss += l_sum.detach()
                del logits, gh, gW
            gx, gnw = torch.autograd.grad(hn, (x, nw), dhn)
            g_norm.add_(gnw)
            dh.append(gx.reshape(shape))
        self._finish_unit(head)
        return loss / n_tokens, dh

    def _backward_sweep(self, saved, dh, prep):
        t = self.transport
        measure = self.device.type == "cuda"
        order = list(zip(self.layer_units[::-1], saved[::-1]))
        if self._host_acts_on:
            fetched = {0: self._fetch_parked(order[0][1])}
        for k, (unit, s) in enumerate(order):
            if self._host_acts_on:
                if k + 1 < len(order):  # the next layer's inputs come back while this one computes
                    fetched[k + 1] = self._fetch_parked(order[k + 1][1])
                s = self._wait_parked(fetched.pop(k))
            kept = isinstance(s, _Graph)
            params = s.params if kept else _bind(unit, t.fetch(unit), grad=True)
            names = list(params)
            leaves = [params[n] for n in names]
            g = self._grad(unit)
            graph_bytes = 0
            for m, p in enumerate(prep):
                if kept:
                    x, y = s.xs[m], s.ys[m]
                    s.xs[m] = s.ys[m] = None
                else:
                    x = s[m].detach().requires_grad_()
                    s[m] = None  # the boundary activation is not needed again
                    before = torch.cuda.memory_allocated(self.device) if measure else 0
                    with torch.enable_grad():
                        y = self._layer_call(params, x, *p.rope, p.mask)
                    if measure:  # a host-side counter: no synchronisation
                        graph_bytes += torch.cuda.memory_allocated(self.device) - before
                grads = torch.autograd.grad(y, [x, *leaves], dh[m])
                dh[m] = grads[0]
                _accumulate(g, unit, names, grads[1:])
                del x, y, grads
            self._graph_bytes = max(self._graph_bytes, graph_bytes)
            del params, leaves
            self._finish_unit(unit)
        # Embedding: scatter-add of the input gradient; no weights needed.
        g = unit_views(self._grad(self.embed_unit), self.embed_unit)["embed_tokens.weight"]
        det = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # sort-based, reproducible on CUDA
        try:
            for d, p in zip(dh, prep):
                g.index_add_(0, p.ids.reshape(-1), d.reshape(-1, d.shape[-1]).to(torch.float32))
        finally:
            torch.use_deterministic_algorithms(det)
        self._finish_unit(self.embed_unit)

    # ------------------------------------------------------------------ public
    def forward_backward(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, int]:
        """Gradients of (sum of token losses over all micro-batches) / (number of label tokens).

        Returns the loss (a device scalar) and the number of label tokens.
        """
        n_tokens = sum(mb.num_label_tokens for mb in micro_batches)
        if n_tokens == 0:
            raise ValueError("optimizer step has no label tokens (all labels are -100)")
        self.grads, self._norms = {}, {}
        self._calls += 1
        if self._keep_auto and self._calls == 3:
            self._size_kept_layers()
        self._plan_activations(micro_batches)
        self.transport.begin(self._schedule(backward=True))
        prep = [self._prepare(mb) for mb in micro_batches]
        h, saved = self._forward_sweep(prep, keep=True)
        loss, dh = self._head_loss_backward(h, prep, n_tokens)
        del h
        self._backward_sweep(saved, dh, prep)
        return loss, n_tokens

    def _size_kept_layers(self, reserve: float = 0.15) -> None:
        """Spend GPU memory that two measured steps left free on keeping the last layers' graphs
        (each saves one layer's recompute, about a quarter of its compute)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        free = total * (1 - reserve) - torch.cuda.max_memory_reserved(self.device)
        if self._graph_bytes > 0 and free > 0:
            self.keep_layers = min(len(self.layer_units), int(free // self._graph_bytes))

    def clip_grad_norm(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global L2 norm of all gradients (as `torch.nn.utils.clip_grad_norm_` computes it) and
        the clip coefficient to apply (None when clipping is off)."""
        norms = [n for i in sorted(self._norms) for n in self._norms[i]]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if not max_norm or max_norm <= 0:
            return total, None
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total, coef

    def step(self, lr: float, coef: torch.Tensor | None) -> None:
        """Apply AdamW to every unit with its (clipped) gradients; asynchronous on CUDA."""
        self.state.step += 1
        grads, self.grads = self.grads, {}
        self.transport.update(grads, coef, lr, self.state.step)

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Checkpoint key -> fp32 gradient, after `forward_backward` (for tests and debugging)."""
        out = {}
        for u in self.units:
            views = unit_views(self.grads[u.index], u)
            out.update({p.key: views[p.name] for p in u.params})
        return out

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, int]:
        """Sum of token losses over `micro_batches` (an fp32 device scalar) and their number of
        label tokens, forward only: no gradients, nothing for the optimizer, no random numbers.

        All micro-batches pass each layer in one visit, so the weights cross once per call; the
        head computes the cross-entropy a chunk of tokens at a time exactly as in training, so
        the full logits never exist and the sum equals the training loss's numerator. On CUDA
        the optimizer may still be applying the previous step on its worker thread: the
        transport's fetch waits for that unit's update first (StreamingTransport._issue calls
        _wait_ready, set once the unit's AdamW has run; device-resident units are stepped on the
        compute stream, ahead of this sweep), so evaluation sees the updated weights.
        """
        n_tokens = sum(mb.num_label_tokens for mb in micro_batches)
        self.transport.begin(self._schedule(backward=False))
        prep = [self._prepare(mb) for mb in micro_batches]
        h, _ = self._forward_sweep(prep, keep=False)
        params = _bind(self.head_unit, self.transport.fetch(self.head_unit), grad=False)
        W = self._lm_weight(params)
        loss = torch.zeros((), device=self.device)
        C = self.loss_chunk_tokens
        for x, p in zip(h, prep):
            hn = functional_call(
                self.head.norm, {"weight": params["norm.weight"]}, (x.reshape(-1, x.shape[-1]),)
            )
            for a in range(0, hn.shape[0], C):
                logits = F.linear(hn[a : a + C], W).float()
                loss += F.cross_entropy(
                    logits, p.targets[a : a + C], ignore_index=IGNORE_INDEX, reduction="sum"
                )
                del logits
        return loss, n_tokens

    @torch.no_grad()
    def logits(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Full fp32 logits of one micro-batch (for evaluation and parity tests)."""
        self.transport.begin(self._schedule(backward=False))
        prep = [self._prepare(micro_batch)]
        h, _ = self._forward_sweep(prep, keep=False)
        params = _bind(self.head_unit, self.transport.fetch(self.head_unit), grad=False)
        W = self._lm_weight(params)
        hn = functional_call(self.head.norm, {"weight": params["norm.weight"]}, (h[0],))
        return F.linear(hn, W).float()

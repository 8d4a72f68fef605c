"""The layer-streaming engine: a forward sweep that keeps only layer-boundary activations, a
loss head that never materialises the full logits (the loss is an objective's, objectives/), and
a backward sweep that recomputes each layer from its saved input and produces its gradients.

Every micro-batch of an optimizer step passes through a layer during one visit, so each unit's
weights reach the device twice per optimizer step (forward, backward) however many micro-batches
there are. Weights arrive through a `Transport` (transport.py), which also carries the fp32
gradients back and applies the optimizer; the engine itself does only arithmetic, placed as the
`Plan` (placement.py) says. Where every unit is GPU-resident and its graphs fit, the plan may run
the step micro-batch-major instead (`Plan.update_order`): each micro-batch's forward, loss and
backward through every layer, its graphs kept, so nothing is recomputed; the same arithmetic in
the same order, so the same bits (`_micro_batch_major`).

How a step's gradients meet the exact global-norm clip depends on the plan's `grad_mode`:
* `stored`: `forward_backward` runs the whole backward sweep and hands each unit's gradient to
  the transport to hold; `step` applies AdamW to all of them once the norm is known.
* `two_pass`: `forward_backward` runs a backward sweep that only measures the norm (keeping the
  boundary activations); `step` runs it again and steps each unit as its gradient lands.
* `immediate` (no clipping): `forward_backward` stops after the loss; `step` runs the backward
  sweep, stepping each unit as its gradient lands (micro-batch-major, `forward_backward` has
  made every gradient: `step` steps them in the order they landed).
All three give the same weights: the same gradients, times the same coefficient, through the
same AdamW.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

from ..data.batch import MicroBatch
from ..data.shared import SharedPrompts, share_prompts
from ..determinism import sorted_sums
from ..host.state import HostState, Unit, unit_views
from ..models.compiling import compiled
from ..models.config import ModelConfig
from ..models.decoder import set_mlp_tiles
from ..models.family import family_of, templates
from ..models.vision import add_deepstack
from ..objectives.base import Objective
from ..objectives.losshead import Head
from ..parallel.distributed import Collective, Single
from ..planning.placement import Plan
from ..planning.planspec import EMBED_GRAD_ROWS
from .transport import Transport


@dataclass
class _Prepared:
    ids: torch.Tensor  # [B, S] on device
    targets: Any  # what the objective needs of the micro-batch, on device (cross-entropy: [B*S] labels)
    inputs: dict[str, dict]  # layer kind -> keyword inputs of its layers (rotary tables, mask)
    row_ids: torch.Tensor | None = None  # ids into the step's looked-up rows (`Plan.embed_rows`)
    images: dict | None = None  # a vision-language model's image inputs, on device
    image_mask: torch.Tensor | None = None  # [B, S]: the image tokens, whose embeddings are the features
    # Qwen3-VL's DeepStack features ([image tokens, hidden] each), from the embedding's forward:
    # the k-th is added to decoder layer k's output at the image tokens (models/vision.py).
    deepstack: tuple[torch.Tensor, ...] = ()


@dataclass
class _Graph:
    """A layer whose autograd graph was kept from the forward sweep: no recompute, no refetch."""

    params: dict[str, torch.Tensor]
    xs: list[torch.Tensor | None]
    ys: list[torch.Tensor | None]


def _bind(unit: Unit, flat: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
    views = unit_views(flat, unit)
    if grad:  # frozen tensors (ParamSpec.train) take no gradient
        views = {p.name: views[p.name].detach().requires_grad_(p.train) for p in unit.params}
    return views


def _accumulate(gflat: torch.Tensor, unit: Unit, names: list[str], grads, first: bool) -> None:
    """Put per-parameter gradients (compute dtype) into the unit's fp32 gradient buffer: the first
    micro-batch's copied (a layer's buffer is not zeroed first: `Engine._grad_buffer`), the
    others' added. Both upcast on the fly (exactly), so no fp32 copy of the gradients is made."""
    views = unit_views(gflat, unit)
    dst = [views[n] for n in names]
    (torch._foreach_copy_ if first else torch._foreach_add_)(dst, list(grads))


def _unwritten(unit: Unit, names: list[str], length: int) -> list[tuple[int, int]]:
    """The ranges of a unit's gradient buffer (`length` long) that no gradient of `names` covers:
    the frozen parameters', the alignment between parameters, the padding to the ranks' pieces."""
    covered = sorted((p.offset, p.offset + p.numel) for p in unit.params if p.name in names)
    gaps, at = [], 0
    for a, b in covered:
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    return gaps + ([(at, length)] if length > at else [])


class Engine:
    """Runs forward and backward sweeps over a host-resident model, placed as `plan` says.

    `forward_backward` computes the loss (and, as the plan's gradient mode says, the gradients or
    their norm); `clip_grad_norm` gives the global norm and the clip coefficient; `step` applies
    AdamW through the transport (asynchronously on CUDA).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        state: HostState,
        transport: Transport,
        device: torch.device,
        compute_dtype: torch.dtype,
        plan: Plan,
        objective: Objective,
        compile: bool = False,
        collective: Collective | None = None,
    ):
        self.cfg, self.state, self.transport, self.plan = cfg, state, transport, plan
        self.objective = objective
        # The other ranks of a data-parallel world (distributed.py): label tokens counted and
        # gradients summed over all of them; a world of one changes nothing.
        self.collective = collective or Single()
        self.device, self.dtype = torch.device(device), compute_dtype
        if self.device.type == "cuda" and compute_dtype == torch.float32:
            # float32 compute is exact float32: cuBLAS's matmuls are by PyTorch's default, but
            # cuDNN's convolutions (a vision tower's patch embedding) round to TF32 unless told.
            torch.backends.cudnn.allow_tf32 = False
        self.units = state.units
        self.embed_unit, self.head_unit = self.units[0], self.units[-1]
        self.layer_units = self.units[1:-1]
        if plan.grad_mode == "two_pass" and plan.keep_layers:
            raise ValueError("a two-pass step recomputes every layer twice: it keeps no graphs")
        if plan.update_order == "micro_batch" and (why := self._micro_batch_refused(plan, objective)):
            raise ValueError(f"a micro-batch-major update: {why}")
        if plan.embed_rows and cfg.tie_word_embeddings:
            raise ValueError("a tied LM head reads the whole table: the embedding's rows alone do not do")
        family, t = family_of(cfg), templates(cfg)
        self.embed, self.head, self.layers = t["embed"], t["head"], t["layers"]
        for module in (self.embed, self.head, *self.layers.values()):
            _buffers_to(module, self.device)
        for layer in self.layers.values():
            set_mlp_tiles(layer, plan.mlp_tile_tokens)
        self.layer_keys = t["keys"]
        self.layer_kinds = [family.layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.inputs = family.inputs(cfg, self.device)
        # Packed documents and sliding windows: FlexAttention's block masks on CUDA, dense masks on
        # the CPU (models/attention.py says why).
        self.flex_masks = self.device.type == "cuda"
        # Families whose layers also return statistics for an auxiliary loss (mixture of experts:
        # routing.py) declare its keeper; None: a layer returns its hidden state alone.
        self.aux = family.aux(cfg, len(self.layer_units), self.device) if family.aux else None
        # A vision-language model's image features are written over its image tokens' embeddings
        # (models/vision.py); where its tower or projector trains, the backward sweep fetches the
        # embedding unit again to recompute and differentiate them.
        self.vision = cfg.vision
        self.vision_grad = cfg.vision is not None and cfg.vision.trains
        self.positions = family.positions(cfg) if family.positions else None
        self._layer_call = self._call_layer
        self.compile = compile  # the loss head's one-pass objectives too (Head.fused)
        if compile and family.compile:
            # Fuses the norms, rotary embedding, SiLU gating and residual adds around the matmuls.
            self._layer_call = compiled(self._call_layer)
        self.keep_layers = plan.keep_layers
        self.loss_chunk_tokens = plan.loss_chunk_tokens
        self.host_acts = None
        if plan.parked_layers and self.device.type == "cuda":
            from ..host.activations import HostActivations

            self.host_acts = HostActivations(self.device)
        self._norms: dict[int, list[torch.Tensor]] = {}
        self._pending = None  # two_pass, immediate: what `step` needs to run the backward sweep
        self._head_grads: dict[int, torch.Tensor] = {}

    def _micro_batch_refused(self, plan: Plan, objective: Objective) -> str:
        """Why this engine cannot run `plan`'s micro-batch-major update ("": it can)."""
        if plan.grad_mode == "two_pass":
            return "a two-pass step keeps no graphs"
        if plan.parked_layers:
            return "it keeps one micro-batch's activations, none parked"
        if self.collective.world_size > 1:
            return "built for one process (the objectives meet the other ranks once a step)"
        return objective.coupled

    def _call_layer(self, layer, params, x, inputs):
        return functional_call(layer, params, (x,), inputs)

    def _run(self, j: int, params, x, p: _Prepared) -> torch.Tensor:
        """Layer j on one micro-batch."""
        return self._layer_call(self.layers[self.layer_keys[j]], params, x, p.inputs[self.layer_kinds[j]])

    def _stacked(self, j: int, h: torch.Tensor, p: _Prepared) -> torch.Tensor:
        """Layer j's output hidden state with the micro-batch's DeepStack features for it added
        (Qwen3-VL's first layers); as it is for every other layer and model."""
        if j >= len(p.deepstack):
            return h
        return add_deepstack(h, p.image_mask, p.deepstack[j])

    def _hidden(self, j: int, m: int, out, record: bool) -> torch.Tensor:
        """A layer's output hidden state; with an auxiliary loss, its statistics recorded first."""
        if self.aux is None:
            return out
        if record:
            self.aux.record(j, m, out[1])
        return out[0]

    def _grad_targets(self, m: int, out, dh: torch.Tensor):
        """What to differentiate in a layer's output, and with which gradients."""
        if self.aux is None:
            return [out], [dh]
        return self.aux.grad_targets(m, out, dh)

    # ------------------------------------------------------------------ schedule
    def _forward_order(self) -> list[Unit]:
        order = [self.embed_unit, *self.layer_units, self.head_unit]
        if self.cfg.tie_word_embeddings:
            order.append(self.embed_unit)  # the head borrows the embedding matrix
        return order

    def _backward_order(self) -> list[Unit]:
        """Units whose weights the backward sweep fetches: the layers but the kept ones, last
        first, then the embedding where its vision modules train."""
        order = self.layer_units[: len(self.layer_units) - self.keep_layers][::-1]
        return order + ([self.embed_unit] if self.vision_grad else [])

    def step_order(self) -> list[Unit]:
        """The order a step hands units to the optimizer: forward order where gradients wait for
        the clip (the transport steps the held ones in order), last first where they land in the
        backward sweep. What the disk tier reads ahead in (host/disk.py)."""
        units = self.state.units
        return list(units) if self.plan.grad_mode == "stored" else units[::-1]

    def _looked_up(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor | None, list]:
        """Where the plan fetches the embedding's rows (`Plan.embed_rows`): the sorted token ids
        the micro-batches look up (host memory) and each micro-batch's ids into them; else None
        and Nones."""
        if not self.plan.embed_rows:
            return None, [None] * len(micro_batches)
        ids = [mb.input_ids.reshape(-1) for mb in micro_batches]
        rows, into = torch.unique(torch.cat(ids), sorted=True, return_inverse=True)
        into = into.split([i.numel() for i in ids])
        return rows, [j.view(mb.input_ids.shape) for j, mb in zip(into, micro_batches)]

    def _prepare_all(
        self, micro_batches: list[MicroBatch], targets: bool = True
    ) -> tuple[list[_Prepared], torch.Tensor | None]:
        """Each micro-batch on the device (with the objective's targets, unless `targets` is
        false: a shared layout's, data/shared.py), and the rows of the embedding they look up
        (None: the whole table is fetched)."""
        rows, into = self._looked_up(micro_batches)
        return [self._prepare(mb, j, targets) for mb, j in zip(micro_batches, into)], rows

    def _shared(self, micro_batches: list[MicroBatch]) -> SharedPrompts | None:
        """The step's layout with each shared prompt once in the layers, where the objective asks
        for it and the update is layer-major (None: the micro-batches as they are)."""
        if not self.objective.shares_prompts or self.plan.update_order == "micro_batch":
            return None
        shared = share_prompts(micro_batches)
        return None if shared is None else shared.to(self.device)

    def _prepare_step(self, micro_batches: list[MicroBatch]):
        """(the layers' micro-batches on the device, the embedding's rows, the loss's targets,
        the shared layout or None)."""
        shared = self._shared(micro_batches)
        if shared is None:
            prep, rows = self._prepare_all(micro_batches)
            return prep, rows, [p.targets for p in prep], None
        prep, rows = self._prepare_all(shared.compute, targets=False)
        return prep, rows, [self.objective.targets(mb, self.device) for mb in micro_batches], shared

    def _prepare(
        self, mb: MicroBatch, row_ids: torch.Tensor | None = None, targets: bool = True
    ) -> _Prepared:
        dev = self.device
        ids = mb.input_ids.to(dev, non_blocking=True)
        B, S = ids.shape
        pos = mb.position_ids
        pos = pos.to(dev) if pos is not None else torch.arange(S, device=dev).expand(B, S)
        if self.positions is not None and mb.position_ids is None:  # M-RoPE: from the images' grids
            mrope = self.positions(mb.input_ids, mb.images, mb.attention_mask)
            pos = pos if mrope is None else mrope.to(dev)
        doc = mb.shared_rows or mb.document_ids
        doc = doc.to(dev) if doc is not None else None
        images = mask = None
        if self.vision is not None and mb.images is not None:
            images = {k: self._image_input(v) for k, v in mb.images.items()}
            mask = ids == self.vision.image_token_id
        seen = {"image_mask": mask} if self.vision is not None else {}  # Gemma 3's masks read it
        return _Prepared(
            ids=ids,
            targets=self.objective.targets(mb, dev) if targets else None,
            inputs=self.inputs(pos, doc, S, self.dtype, self.flex_masks, **seen),
            row_ids=None if row_ids is None else row_ids.to(dev, non_blocking=True),
            images=images,
            image_mask=mask,
        )

    def _image_input(self, v):
        """An image input on the device, pixel values in the compute dtype (transformers casts
        them to the tower's)."""
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(self.device, self.dtype if v.is_floating_point() else None, non_blocking=True)

    def _embed(self, weights, p: _Prepared) -> torch.Tensor:
        """The embedding unit on one micro-batch: its first hidden state (a vision-language
        model's with the image features in place, its DeepStack features kept in `p`)."""
        if self.vision is None:
            return functional_call(self.embed, weights, (p.ids,))
        h, p.deepstack = functional_call(self.embed, weights, (p.ids,), {"images": p.images})
        return h

    def _features(self, weights, p: _Prepared) -> tuple[torch.Tensor, ...]:
        """A vision-language model's image features of one micro-batch, then its DeepStack ones."""
        return functional_call(self.embed, weights, (p.ids,), {"images": p.images, "features": True})

    def _grad_buffer(self, unit: Unit, names: list[str] | None = None) -> torch.Tensor:
        """A unit's fp32 gradient buffer, as long as the collective reduces it (padded to equal
        pieces where ranks receive only theirs): zeroed, or for a layer whose first micro-batch's
        gradients of `names` are copied in (`_accumulate`), zeroed only where none of them lies (a
        pass over 4 bytes a parameter saved, and the add that read them)."""
        n = self.collective.padded(unit)
        if names is None:
            return torch.zeros(n, device=self.device)
        g = torch.empty(n, device=self.device)
        for a, b in _unwritten(unit, names, n):
            g[a:b].zero_()
        return g

    def _norm(self, unit: Unit, g: torch.Tensor) -> None:
        """The norms of a unit's complete gradient (for clipping), of which `g` is this rank's
        piece (the whole gradient in one process), taken while the buffer is hot."""
        self._norms[unit.index] = self.collective.norms(unit, g)

    # ------------------------------------------------------------------ sweeps
    def _embed_all(self, prep: list[_Prepared], rows: torch.Tensor | None) -> list[torch.Tensor]:
        """Every micro-batch's first hidden state, the embedding fetched once (or its looked-up rows)."""
        t = self.transport
        if rows is None:
            w = unit_views(t.fetch(self.embed_unit), self.embed_unit)
            return [self._embed(w, p) for p in prep]
        # the looked-up rows alone, each token's id remapped into them: the same lookup
        w = {self.embed.weight_name: t.fetch_rows(self.embed_unit, rows)}
        return [functional_call(self.embed, w, (p.row_ids,)) for p in prep]

    def _with_graph(self, j: int, params, x: torch.Tensor, m: int, p: _Prepared):
        """Layer j on micro-batch m with autograd, its graph kept: (its input, a leaf; its output;
        the next layer's input, detached)."""
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = self._run(j, params, x, p)
        return x, y, self._stacked(j, self._hidden(j, m, y, True).detach(), p)

    def _forward_sweep(self, prep: list[_Prepared], keep: bool, rows: torch.Tensor | None = None):
        t = self.transport
        h = self._embed_all(prep, rows)
        saved: list[list | _Graph] = []
        first_kept = len(self.layer_units) - (self.keep_layers if keep else 0)
        for j, unit in enumerate(self.layer_units):
            if j < first_kept:
                params = _bind(unit, t.fetch(unit), grad=False)
                if keep:
                    park = j < self.plan.parked_layers and self.host_acts is not None
                    saved.append([self.host_acts.park(x, j) for x in h] if park else h)
                with torch.no_grad():
                    h = [
                        self._stacked(j, self._hidden(j, m, self._run(j, params, x, p), keep), p)
                        for m, (x, p) in enumerate(zip(h, prep))
                    ]
            else:  # kept layers (keep is true)
                params = _bind(unit, t.fetch(unit), grad=True)
                kept = [self._with_graph(j, params, x, m, p) for m, (x, p) in enumerate(zip(h, prep))]
                saved.append(_Graph(params, [x for x, _, _ in kept], [y for _, y, _ in kept]))
                h = [nxt for _, _, nxt in kept]
                del kept
            del params
        return h, saved

    def _head_params(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The head's own parameters (norm, any bias) and the LM weight: its own, or the
        embedding's table in a tied model."""
        params = _bind(self.head_unit, self.transport.fetch(self.head_unit), grad=False)
        if self.cfg.tie_word_embeddings:
            embed = unit_views(self.transport.fetch(self.embed_unit), self.embed_unit)
            return params, embed[self.embed.weight_name]
        return params, params.pop(self.head.lm_weight_name)

    def _bound_head(self) -> tuple[Head, dict[int, torch.Tensor]]:
        """The chunked loss head (objectives/) bound to its weights and to fresh fp32 gradient
        buffers, which `loss_and_grads` adds its gradients into, and those buffers by unit index:
        the head's and, tied, the embedding's (the LM head's share of it)."""
        head = self.head_unit
        params, W = self._head_params()
        g_head = self._grad_buffer(head)
        g_views = unit_views(g_head, head)
        grads = {head.index: g_head}
        if self.cfg.tie_word_embeddings:
            grads[self.embed_unit.index] = self._grad_buffer(self.embed_unit)
            g_W = unit_views(grads[self.embed_unit.index], self.embed_unit)[self.embed.weight_name]
        else:
            g_W = g_views[self.head.lm_weight_name]
        return Head(self.head, params, W, self.loss_chunk_tokens, g_views, g_W, self.compile), grads

    def _head_loss_backward(self, h: list[torch.Tensor], targets: list, n_tokens: int, bound=None):
        """Loss (the objective's, over `n_tokens`: its count over the step) and its gradient w.r.t.
        each micro-batch's last hidden state, through the chunked loss head bound now
        (`_bound_head`) or, micro-batch-major, the step's `bound` (head, buffers), which each
        micro-batch's call continues. Returns the loss, the gradients and the units' buffers."""
        head, grads = bound or self._bound_head()
        loss, dh = self.objective.loss_and_grads(head, h, targets, n_tokens)
        return loss, dh, grads

    def _fetch_parked(self, s):
        """Start bringing a layer's parked inputs back (resident inputs and kept graphs need nothing)."""
        if isinstance(s, _Graph) or not s or not hasattr(s[0], "written"):
            return s
        return [self.host_acts.fetch(p) for p in s]

    def _wait_parked(self, f):
        """Make the compute stream wait for fetched inputs, just before their first use."""
        if isinstance(f, _Graph) or not f or not isinstance(f[0], tuple):
            return f
        stream = torch.cuda.current_stream(self.device)
        for _, ready in f:
            stream.wait_event(ready)
        return [x for x, _ in f]

    def _backward_sweep(self, saved, dh, prep, finish, embed_grad, consume: bool = True):
        """Recompute and differentiate each layer, last first; `finish(unit, grad)` takes each
        unit's complete fp32 gradient, the embedding's last (a scatter-add of the input gradient
        into `embed_grad`, which holds the tied LM head's share or is None). With
        `consume=False` the boundary activations are left for a second sweep."""
        t = self.transport
        stacked = [{} for _ in prep]  # micro-batch -> layer -> its DeepStack features' gradient
        order = list(zip(self.layer_units[::-1], saved[::-1]))
        fetched = {0: self._fetch_parked(order[0][1])} if order else {}
        for k, (unit, s) in enumerate(order):
            if k + 1 < len(order):  # the next layer's parked inputs come back while this one computes
                fetched[k + 1] = self._fetch_parked(order[k + 1][1])
            s = self._wait_parked(fetched.pop(k))
            kept = isinstance(s, _Graph)
            params = s.params if kept else _bind(unit, t.fetch(unit), grad=True)
            names = [n for n, v in params.items() if v.requires_grad]
            leaves = [params[n] for n in names]
            g = self._grad_buffer(unit, names if prep else [])
            for m, p in enumerate(prep):
                if kept:
                    x, y = s.xs[m], s.ys[m]
                    s.xs[m] = s.ys[m] = None
                else:
                    x = s[m].detach().requires_grad_()
                    if consume:
                        s[m] = None  # the boundary activation is not needed again
                    with torch.enable_grad():
                        y = self._run(unit.index - 1, params, x, p)
                dh[m] = self._differentiate(unit, names, leaves, g, x, y, m, p, dh[m], stacked[m])
                del x, y
            del params, leaves
            if kept:  # its weights are not needed again (the sweep's list still holds the graph)
                s.params = {}
            self.collective.reduce_then(unit, g, finish)  # reduced over ranks, then finished
            del g
        self._embedding_backward(dh, prep, finish, embed_grad, stacked)

    def _differentiate(self, unit: Unit, names, leaves, g, x, y, m: int, p: _Prepared, dh, stacked):
        """Layer `unit`'s output `y` on micro-batch m (from its input leaf `x`) differentiated with
        `dh`, the gradient that reached it: its weights' gradients into the unit's fp32 buffer `g`
        (`_accumulate`: micro-batch 0's copied, the others' added), a DeepStack layer's output
        gradient kept in `stacked` (layer -> gradient) for the vision backward. Returns the input's
        gradient."""
        j = unit.index - 1
        if self.vision_grad and j < len(p.deepstack):  # added to the output: its gradient
            stacked[j] = dh[p.image_mask]
        outs, gouts = self._grad_targets(m, y, dh)
        grads = torch.autograd.grad(outs, [x, *leaves], gouts)
        del outs, gouts
        _accumulate(g, unit, names, grads[1:], first=m == 0)
        return grads[0]

    def _micro_batch_major(self, prep: list[_Prepared], rows, n_tokens: int) -> torch.Tensor:
        """The micro-batch-major update (`Plan.update_order`): each micro-batch's forward through
        every layer with its graphs kept, its loss head and its backward, then the next one's; no
        layer is recomputed, and each unit is fetched once a step (its weights bound for all
        micro-batches). The arithmetic is the layer-major sweep's, in its order: one fp32 buffer a
        unit for the step, micro-batch 0's gradient copied in and the others' added, the head's
        chunks one running sum (`Head.loss_sum`) and one set of buffers over the objective's
        calls, one a micro-batch; the embedding's gradient taken at the end from every
        micro-batch's (`_embedding_backward`), so the tied LM head's share is complete before it
        as there. Each unit is finished after the last micro-batch, in the order the layer-major
        sweep finishes it (head, last layer first, embedding): stored mode holds it; immediate mode
        keeps the list for `step`. Returns the step's loss."""
        landed: list[tuple[Unit, torch.Tensor]] = []
        finish = self._hold if self.plan.grad_mode == "stored" else lambda u, g: landed.append((u, g))
        t, last = self.transport, len(prep) - 1
        t.begin(self._forward_order() + ([self.embed_unit] if self.vision_grad else []), rows)
        h0 = self._embed_all(prep, rows)
        layers: list[tuple[dict, list[str]]] = []  # each layer's weights, bound at its first visit
        bound = None  # the loss head and its buffers, for every micro-batch
        grads: dict[int, torch.Tensor] = {}
        dh0, stacked = [], [{} for _ in prep]
        for m, p in enumerate(prep):
            h, h0[m] = h0[m], None
            xs, ys = [], []
            for j, unit in enumerate(self.layer_units):
                if m == 0:
                    weights = _bind(unit, t.fetch(unit), grad=True)
                    layers.append((weights, [n for n, v in weights.items() if v.requires_grad]))
                    del weights
                x, y, h = self._with_graph(j, layers[j][0], h, m, p)
                xs.append(x)
                ys.append(y)
            bound = bound or self._bound_head()
            loss, (dh,), head_grads = self._head_loss_backward([h], [p.targets], n_tokens, bound)
            del h
            if m == last:  # the head's gradient is complete
                loss = self._step_loss(loss)
                g = head_grads.pop(self.head_unit.index)
                finish(self.head_unit, self.collective.reduce(self.head_unit, g))
                del g
            for j in reversed(range(len(self.layer_units))):
                unit, names = self.layer_units[j], layers[j][1]
                if m == 0:
                    grads[unit.index] = self._grad_buffer(unit, names)
                leaves = [layers[j][0][n] for n in names]
                x, y = xs.pop(), ys.pop()
                dh = self._differentiate(unit, names, leaves, grads[unit.index], x, y, m, p, dh, stacked[m])
                del x, y, leaves
                if m == last:
                    self.collective.reduce_then(unit, grads.pop(unit.index), finish)
            dh0.append(dh)
            del dh
        del layers
        self._embedding_backward(dh0, prep, finish, head_grads.pop(self.embed_unit.index, None), stacked)
        self._pending = landed or None
        return loss

    def _embedding_backward(self, dh, prep, finish, embed_grad, stacked) -> None:
        """The embedding's gradient: a scatter-add of the input gradient (no weights needed), in
        fp32, `EMBED_GRAD_ROWS` tokens at a time, so that the gradient's fp32 copy (and what the
        deterministic scatter allocates beside it) is a chunk's, not the sequence's: whole, it
        would be 4 bytes per token x hidden, 6 GiB at 400k tokens of a 4096-wide model."""
        g = self._grad_buffer(self.embed_unit) if embed_grad is None else embed_grad
        view = unit_views(g, self.embed_unit)[self.embed.weight_name]
        scale = self.embed.scale  # the embedding's forward multiplies the looked-up rows by it
        pad = self.embed.padding_idx
        with sorted_sums():  # reproducible on CUDA
            for d, p in zip(dh, prep):
                d, ids = d.reshape(-1, d.shape[-1]), p.ids.reshape(-1)
                images = p.image_mask.reshape(-1) if p.image_mask is not None else None
                for a in range(0, d.shape[0], EMBED_GRAD_ROWS):
                    dc, ic = d[a : a + EMBED_GRAD_ROWS], ids[a : a + EMBED_GRAD_ROWS]
                    if pad is not None:  # nn.Embedding(padding_idx=...) gives its row no gradient
                        dc = dc.masked_fill((ic == pad)[:, None], 0)
                    if images is not None:  # image tokens' embeddings were replaced by features
                        cut = images[a : a + EMBED_GRAD_ROWS]
                        dc, ic = dc.masked_fill(cut[:, None], 0), ic.masked_fill(cut, 0)
                    if scale != 1.0:
                        dc = dc * torch.tensor(scale, device=dc.device).to(
                            dc.dtype
                        )  # rounded as the forward's
                    view.index_add_(0, ic, dc.to(torch.float32))
        if self.vision_grad:
            self._vision_backward(dh, prep, g, stacked)
        self.collective.reduce_then(self.embed_unit, g, finish)
        self.collective.flush()

    def _vision_backward(self, dh, prep, g: torch.Tensor, stacked) -> None:
        """The trained vision modules' gradients, added into the embedding unit's buffer `g`: the
        image features of each micro-batch recomputed (the unit fetched again) and differentiated
        with the gradient that reached their image tokens, its DeepStack features (`stacked`:
        micro-batch -> layer -> gradient) with the gradient that reached their layer's output."""
        params = _bind(self.embed_unit, self.transport.fetch(self.embed_unit), grad=True)
        names = [n for n, v in params.items() if v.requires_grad]
        leaves = [params[n] for n in names]
        views = unit_views(g, self.embed_unit)
        for d, p, at in zip(dh, prep, stacked):
            if p.images is None:
                continue
            with torch.enable_grad():
                feats, *deepstack = self._features(params, p)
            pairs = [(feats, d[p.image_mask])] + [(f, at[j]) for j, f in enumerate(deepstack) if j in at]
            # only what the trained modules reach: a frozen tower's DeepStack features take none
            outs, gouts = zip(*[(f, df.to(f.dtype)) for f, df in pairs if f.requires_grad])
            grads = torch.autograd.grad(outs, leaves, gouts, allow_unused=True)
            used = [(views[n], gr) for n, gr in zip(names, grads) if gr is not None]
            if used:  # parameters the features do not depend on (CLIP's unused last norm) get none
                torch._foreach_add_([v for v, _ in used], [gr for _, gr in used])
            del feats, deepstack, pairs, outs, gouts, grads, used

    # ------------------------------------------------------------------ public
    def forward_backward(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, int]:
        """The objective's loss (cross-entropy: (sum of token losses over all micro-batches) / (number
        of label tokens)) and its count (that number); the gradients or their norm as the plan's
        gradient mode says. A family with an auxiliary loss (mixture of experts:
        `router_aux_loss_coef` times each micro-batch's load-balancing loss, routing.py) adds it to
        the loss."""
        # Every rank normalises by the label tokens of the whole step, on all ranks.
        n_tokens = self.collective.sum_count(sum(self.objective.count(mb) for mb in micro_batches))
        if n_tokens == 0 and not self.objective.empty_step_ok:
            raise ValueError("optimizer step has no label tokens (all labels are -100)")
        self._norms, self._pending = {}, None
        self.transport.discard()
        prep, rows, targets, shared = self._prepare_step(micro_batches)
        compute = micro_batches if shared is None else shared.compute
        self._begin_parking(compute)
        if self.aux is not None:  # padding is left out of the aux loss
            masks = [mb.attention_mask for mb in compute]
            self.aux.begin([None if a is None else a.to(self.device).reshape(-1).float() for a in masks])
        if self.plan.update_order == "micro_batch" and prep:
            return self._micro_batch_major(prep, rows, n_tokens), n_tokens
        return self._layer_major(prep, rows, n_tokens, targets, shared), n_tokens

    def _step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss from the objective's, once every micro-batch's forward is done: a
        family's auxiliary loss added (every layer's routing was counted), summed over ranks."""
        if self.aux is not None:
            loss = loss + self.aux.loss()
        self.collective.sum_(loss)
        return loss

    def _layer_major(
        self, prep: list[_Prepared], rows, n_tokens: int, targets: list, shared=None
    ) -> torch.Tensor:
        """The layer-major update: the forward sweep, the loss head over every micro-batch, then
        (as the gradient mode says) the backward sweep, a norm-only one, or none until `step`.
        With a `shared` layout the sweeps run over its micro-batches (`prep`) and the head over
        the loss's (`targets`), the last hidden states and their gradients mapped between them."""
        mode = self.plan.grad_mode
        order = self._forward_order()
        if mode != "immediate":
            order += self._backward_order()
        self.transport.begin(order, rows)
        h, saved = self._forward_sweep(prep, keep=True, rows=rows)
        if shared is not None:
            h = shared.to_loss(h)  # the layers' last hidden states freed as the loss rows' are made
        loss, dh, head_grads = self._head_loss_backward(h, targets, n_tokens)
        del h
        if shared is not None:
            dh = shared.to_compute(dh, [p.ids for p in prep])
        loss = self._step_loss(loss)
        head = self.head_unit
        # Reduced over ranks now (this rank's piece of it); the tied embedding's share with its unit.
        head_grads[head.index] = self.collective.reduce(head, head_grads[head.index])
        self._norm(head, head_grads[head.index])
        embed_part = head_grads.get(self.embed_unit.index)  # tied: the LM head's share
        if mode == "stored":
            # handed over, not kept: the transport frees it once it is in host memory
            self.transport.hold(head, head_grads.pop(head.index))
            self._backward_sweep(saved, dh, prep, self._hold, embed_part)
        elif mode == "two_pass":
            dh_copy = [d.clone() for d in dh]
            part = None if embed_part is None else embed_part.clone()
            self._backward_sweep(saved, dh, prep, self._norm, part, consume=False)
            self._pending = (saved, dh_copy, prep, head_grads)
        else:
            self._pending = (saved, dh, prep, head_grads)
        return loss

    def _begin_parking(self, micro_batches: list[MicroBatch]) -> None:
        if self.host_acts is None:
            return
        tokens = [mb.num_tokens for mb in micro_batches]
        layer = self.host_acts.layer_bytes(tokens, self.cfg.hidden_size, self.dtype.itemsize)
        self.host_acts.begin(layer, self.plan.parked_layers)

    def _hold(self, unit: Unit, g: torch.Tensor) -> None:
        self._norm(unit, g)
        self.transport.hold(unit, g)

    def clip_grad_norm(self, max_norm: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Global L2 norm of all gradients (as `torch.nn.utils.clip_grad_norm_` computes it) and
        the clip coefficient to apply (None when clipping is off). Without clipping in
        `immediate` mode the norm is only known after `step`: (None, None)."""
        if self.plan.grad_mode == "immediate":
            return None, None
        total = self._total_norm()
        if not max_norm or max_norm <= 0:
            return total, None
        return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)

    def _total_norm(self) -> torch.Tensor:
        norms = [n for i in sorted(self._norms) for n in self._norms[i]]
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def step(self, lr: float, coef: torch.Tensor | None) -> torch.Tensor | None:
        """Apply AdamW to every unit with its (clipped) gradients; asynchronous on CUDA. In
        `immediate` mode this runs the backward sweep and returns the gradient norm it measured
        (a device scalar); otherwise None."""
        self.state.step += 1
        st = self.state.step
        if self.plan.grad_mode == "stored":
            self.transport.step(coef, lr, st)
            return None
        pending, self._pending = self._pending, None
        immediate = self.plan.grad_mode == "immediate"

        def land(unit: Unit, g: torch.Tensor) -> None:
            skip = None
            if immediate:  # nothing checked this gradient before: a non-finite one is not applied
                self._norm(unit, g)
                skip = ~torch.isfinite(torch.stack(self._norms[unit.index]).sum())
            self.transport.step_unit(unit, g, coef, lr, st, skip)

        if isinstance(pending, list):  # a micro-batch-major step's gradients, every one complete
            pending.reverse()
            while pending:  # in the order they landed, each freed once stepped
                land(*pending.pop())
            return self._total_norm()
        saved, dh, prep, head_grads = pending
        head = self.head_unit
        land(head, head_grads.pop(head.index))
        self.transport.begin(self._backward_order())
        self._backward_sweep(saved, dh, prep, land, head_grads.pop(self.embed_unit.index, None))
        return self._total_norm() if immediate else None

    def keep_pace(self) -> None:
        """What a rank with no evaluation chunk left does while the others evaluate one: the
        weight fetches of a forward sweep, where fetches are collectives (sharded: every rank's
        gathers must pair up); nothing otherwise."""
        if not self.collective.layout.sharded:
            return
        order = self._forward_order()
        self.transport.begin(order)
        for unit in order:
            self.transport.fetch(unit)

    def aux_metrics(self) -> dict[str, float]:
        """The last step's auxiliary-loss metrics (MoE: aux loss, expert load) over every rank's
        micro-batches (a collective: every rank asks); empty without one."""
        if self.aux is None or (totals := self.aux.totals()) is None:
            return {}
        return self.aux.metrics(self.collective.sum_(totals))

    def skip_step(self) -> None:
        """Drop this step's gradients: weights and AdamW moments stay as they were."""
        self._pending = None
        self.transport.discard()

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Checkpoint key -> fp32 gradient held by a SerialTransport (the CPU's, or CUDA's with
        `overlap=False`) after `forward_backward` in stored mode (for tests and debugging)."""
        out = {}
        for u in self.units:
            views = unit_views(self.transport.held[u.index], u)
            out.update({p.key: views[p.name] for p in u.params if p.train})
        return out

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> tuple[torch.Tensor, int]:
        """The objective's loss sum over `micro_batches` (an fp32 device scalar; cross-entropy: of
        token losses) and their count (label tokens), forward only: no gradients, nothing for the
        optimizer, no random numbers. Called between optimizer steps (after `step` or
        `skip_step`), when no gradient is held.

        All micro-batches pass each layer in one visit. The head runs the chunks training runs
        (objectives/), so the sum is the training loss's numerator bit for bit. On CUDA the previous
        step's optimizer may still run on the worker thread: each fetch waits for its unit's
        update (resident units are stepped on the compute stream, ahead of this sweep).
        """
        n_tokens = sum(self.objective.count(mb) for mb in micro_batches)
        return self.head_outputs(micro_batches, self.objective.loss_sum), n_tokens

    @torch.no_grad()
    def head_outputs(self, micro_batches: list[MicroBatch], fn: Callable[[Head, list, list], Any]) -> Any:
        """Forward only, as `eval_loss`: `fn(head, last hidden states, targets)` of the objective's
        targets of `micro_batches` (the objective's loss sum; a preference stage's per-sequence
        sums for its reference pass)."""
        if self._pending is not None:
            # Its boundary activations are still on the device, and the plan has no room for two.
            raise RuntimeError("a forward pass inside an optimizer step: call it after step() or skip_step()")
        prep, rows, targets, shared = self._prepare_step(micro_batches)
        self.transport.begin(self._forward_order(), rows)
        h, _ = self._forward_sweep(prep, keep=False, rows=rows)
        head = Head(self.head, *self._head_params(), self.loss_chunk_tokens, compile=self.compile)
        return fn(head, h if shared is None else shared.to_loss(h), targets)

    @torch.no_grad()
    def logits(self, micro_batch: MicroBatch) -> torch.Tensor:
        """Full fp32 logits of one micro-batch (for evaluation and parity tests)."""
        prep, rows = self._prepare_all([micro_batch])
        self.transport.begin(self._forward_order(), rows)
        h, _ = self._forward_sweep(prep, keep=False, rows=rows)
        return Head(self.head, *self._head_params(), self.loss_chunk_tokens).logits(h[0])


def _buffers_to(module: torch.nn.Module, device: torch.device) -> None:
    """A template's buffers (a vision tower's position ids: transformers computes them on the
    host) onto the device it runs on; its parameters are the streamed state's, given per call."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                m._buffers[name] = b.to(device)

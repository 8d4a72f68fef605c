"""The model-family interface: everything the engine, the host state and the planner need to know
about a decoder family, and nothing more.

A family is a small dataclass of callables (`Family`). The engine never names a block: it asks
the family of a `ModelConfig` (`family_of`) for stateless *templates*, built on the meta device
and bound to a unit's weights for each use with `torch.func.functional_call`:

* `embedding(cfg)`: a module whose `forward(input_ids)` gives the first hidden state (a
  vision-language model's: `forward(input_ids, images)`, models/vision.py). It carries
  two plain attributes: `weight_name` (the name of its token table among its parameters) and
  `scale` (the constant `forward` multiplies the looked-up rows by, 1.0 for most families,
  sqrt(hidden) for Gemma), so the backward sweep scatter-adds `scale * dh` into the table's
  gradient without fetching any weights; and `padding_idx` (a row that gets no gradient, as
  `nn.Embedding(padding_idx=...)` has it, or None). Optional: `looks_up_rows = True` where
  `forward` reads a token's row alone and takes a table of any number of rows, so a step may
  fetch only the rows it looks up, the ids remapped into them (`Plan.embed_rows`).
* `layer(cfg, i)`: layer i's block; `forward(x, **inputs)` returns the next hidden state. Layers
  whose `layer_key` is equal share one template (and one compiled graph); `layer_kind(cfg, i)`
  names the entry of the per-micro-batch inputs it takes (e.g. global vs sliding-window
  attention, which may differ in mask and rotary tables).
* `inputs(cfg, device)`: a function `(position_ids [B, S], document_ids [B, S] | None, seq_len,
  dtype, flex) -> {kind: {name: value}}`, computed once per micro-batch and passed to every layer
  of that kind as keyword arguments (rotary cos/sin, attention masks, position ids). `flex`: masks
  as FlexAttention block masks (CUDA) rather than dense tensors (models/attention.py).
* `head(cfg)`: final norm and LM head; `forward(x, lm_weight)` gives the logits (compute dtype,
  any soft-capping or scaling applied). `lm_weight` is passed in because a tied model borrows the
  embedding's table; the head's attribute `lm_weight_name` names it among the head's parameters
  when it is untied. The engine runs it a chunk of tokens at a time.
* `param_key(cfg, kind, layer, name)`: the Hugging Face checkpoint key of a template parameter
  (`kind` is `embed`, `layer` or `head`), so loading and export need no other mapping.
* `pieces(cfg, kind, layer, name, shape)` (optional): where a checkpoint stores one parameter as
  several tensors (an MoE layer's fused experts, one tensor per expert on disk), the list of
  (checkpoint key, element offset inside the parameter, shape); None: the parameter is one tensor
  under its `param_key` (`checkpoint_pieces`).
* `positions(cfg)` (optional): a function `(input_ids [B, S], images, attention_mask) ->
  position_ids` for the micro-batches whose layers take positions other than the tokens' own
  (M-RoPE's [3, B, S] of a vision-language model, vision.py), None where they take those.
* `aux(cfg, num_layers, device)` (optional): the one hook for an auxiliary loss that spans layers
  (MoE load balancing, `routing.RouterBalance`). With it a layer returns (hidden state,
  statistics); the object records each layer's statistics in the forward sweep (`begin`,
  `record`), gives the step's extra loss (`loss`), the gradients it sends into a recomputed
  layer (`grad_targets`) and its metrics (`metrics`). None: a layer returns its hidden state.

`path` says how a family runs: `fast` (megatrain's own blocks in `decoder.py`) or `generic`
(transformers' own modules, `hf.py`): slower, exact for any decoder transformers implements.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .config import ModelConfig

Inputs = Callable[[torch.Tensor, torch.Tensor | None, int, torch.dtype, bool], dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Family:
    """How one decoder family builds its templates and the inputs its layers take."""

    name: str
    path: str
    """`fast` (megatrain's block) or `generic` (transformers' own modules)."""
    embedding: Callable[[ModelConfig], nn.Module]
    layer: Callable[[ModelConfig, int], nn.Module]
    layer_key: Callable[[ModelConfig, int], Hashable]
    layer_kind: Callable[[ModelConfig, int], str]
    inputs: Callable[[ModelConfig, torch.device], Inputs]
    head: Callable[[ModelConfig], nn.Module]
    param_key: Callable[[ModelConfig, str, int, str], str]
    pieces: Callable[[ModelConfig, str, int, str, tuple[int, ...]], list] | None = None
    """Checkpoint tensors of a parameter stored in several (see the module docstring)."""
    positions: Callable[[ModelConfig], Callable] | None = None
    """The position ids a micro-batch's layers take, where not its tokens' (see the module docstring)."""
    aux: Callable[[ModelConfig, int, torch.device], Any] | None = None
    """The keeper of an auxiliary loss over all layers (see the module docstring)."""
    compile: bool = True
    """Whether the layer may be compiled with torch.compile (one graph per layer key)."""
    hf_init: bool = True
    """Random initialisation by transformers' `_init_weights` of the model type, applied to the
    templates (Gemma's norms start at 0); False: N(0, initializer_range), norms 1, biases 0."""


def meta(build: Callable[[], nn.Module]) -> nn.Module:
    """A template: built on the meta device, in eval mode (no dropout: a layer's recompute in the
    backward sweep must give the same output as its forward)."""
    with torch.device("meta"):
        return build().eval()

"""The pre-norm decoder of Llama, Mistral, Qwen2 and Qwen3, with Hugging Face parameter names.

These modules are *templates*: the engine builds each one once, on the meta device, and binds
weights to it for every visit with `torch.func.functional_call`. Nothing here owns state.

The four families differ only by flags of `ModelConfig`: q/k/v bias (Qwen2, Llama with
`attention_bias`), q/k RMSNorm (Qwen3; over all heads for OLMoE), and Mistral's sliding window.
The mixture-of-experts families reuse `Attention` with an expert block as MLP (`moe.py`; gpt-oss,
with attention sinks, in `gpt_oss.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .attention import Mask, attend, attention_mask
from .base import Family, meta
from .compiling import eager
from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the compute dtype, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, S, head_dim] by cos/sin [B, 1, S, r]: its first r dimensions (all of them
    but with a partial rotary factor, as in Phi-4-mini)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr = x[..., :r]
    return torch.cat((xr * cos + rotate_half(xr) * sin, x[..., r:]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings. Families that differ only in the scores
    say so through parameters: `norm` builds the q/k norms (with `cfg.qk_norm`), `scale`
    replaces 1/sqrt(head_dim), `softcap` caps the scores at +-softcap with tanh (Gemma 2),
    `sinks` adds a learned logit per head to the softmax denominator (gpt-oss's `sinks`)."""

    has_sinks = False  # also for subclasses that build their own projections (Phi-3)

    def __init__(
        self,
        cfg: ModelConfig,
        norm=None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            norm = norm or (lambda dim: RMSNorm(dim, cfg.rms_norm_eps))
            full = cfg.qk_norm_full  # OLMoE: one norm over all heads, before the split
            self.q_norm = norm(self.n_heads * d if full else d)
            self.k_norm = norm(self.n_kv * d if full else d)
        self.qk_norm, self.qk_norm_full = cfg.qk_norm, cfg.qk_norm_full
        self.scale, self.softcap = scale, softcap
        if sinks:
            self.has_sinks, self.sinks = True, nn.Parameter(torch.empty(self.n_heads))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [B, S, heads, head_dim]."""
        B, S, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [B, H, S, D] with the rotary embedding applied."""
        return apply_rope(q, *rope), apply_rope(k, *rope)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: Mask) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.project(x)
        if self.qk_norm and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.rotate(q, k, rope)
        y = attend(q, k, v, mask, self.scale, self.softcap, self.sinks if self.has_sinks else None)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


def mlp(x: torch.Tensor, act, gate_w, gate_b, up_w, up_b, down_w, down_b) -> torch.Tensor:
    """The gated MLP of every family: down(act(gate(x)) * up(x))."""
    return F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


_backward_hooks: list[Callable[[str], None]] = []


@contextlib.contextmanager
def tiled_backward_phases(hook: Callable[[str], None]) -> Iterator[None]:
    """Within this block `hook("start")` and `hook("end")` run around every tiled MLP's backward,
    so that the probe can measure the memory of that phase apart from the rest of the layer's."""
    _backward_hooks.append(hook)
    try:
        yield
    finally:
        _backward_hooks.remove(hook)


class _TiledMLP(torch.autograd.Function):
    """`mlp` over `tile` tokens at a time: the forward saves only its input (and the weights it was
    given), the backward recomputes one tile at a time and sums the weight gradients in fp32, so
    the intermediates (3 x tokens x ffn) exist for one tile only. Only the summation order of the
    weight gradients differs from the untiled MLP; in bf16 the fp32 sum is rounded once, as the
    untiled matmul's fp32 accumulator is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tile: int, act, *weights):
        ctx.tile, ctx.act = tile, act
        ctx.save_for_backward(x, *weights)
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(flat.shape[0], weights[4].shape[0])
        for a in range(0, flat.shape[0], tile):
            out[a : a + tile] = mlp(flat[a : a + tile], act, *weights)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        for hook in _backward_hooks:
            hook("start")
        x, *weights = ctx.saved_tensors
        need_x, *need_w = ctx.needs_input_grad[:1] + ctx.needs_input_grad[3:]
        need_w = [n and w is not None for n, w in zip(need_w, weights)]
        leaves = [None if w is None else w.detach().requires_grad_(n) for w, n in zip(weights, need_w)]
        sums = [  # at least fp32, whatever the compute dtype
            torch.zeros_like(w, dtype=torch.promote_types(w.dtype, torch.float32)) if n else None
            for w, n in zip(weights, need_w)
        ]
        flat, dflat = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        dx = torch.empty_like(flat) if need_x else None
        wanted = [leaf for leaf, n in zip(leaves, need_w) if n]
        for a in range(0, flat.shape[0], ctx.tile):
            xt = flat[a : a + ctx.tile].detach().requires_grad_(need_x)
            with torch.enable_grad():
                yt = mlp(xt, ctx.act, *leaves)
            grads = list(torch.autograd.grad(yt, ([xt] if need_x else []) + wanted, dflat[a : a + ctx.tile]))
            if need_x:
                dx[a : a + ctx.tile] = grads.pop(0)
            if grads:
                torch._foreach_add_([s for s in sums if s is not None], grads)
            del yt, grads
        dw = [None if s is None else s.to(w.dtype) for s, w in zip(sums, weights)]
        for hook in _backward_hooks:
            hook("end")
        return (None if dx is None else dx.view_as(x)), None, None, *dw


@eager
def tiled_mlp(x: torch.Tensor, tile: int, act, *weights) -> torch.Tensor:
    """`_TiledMLP`, run eagerly inside a compiled layer: the compiler traces the layer around it
    (norms, attention, residual adds) and leaves the tile loop and its nested backward alone."""
    return _TiledMLP.apply(x, tile, act, *weights)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tile_tokens: int = 0):
        super().__init__()
        h, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=b)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)
        self.act = ACT2FN[cfg.hidden_act]
        self.tile_tokens = tile_tokens
        """Tokens per MLP tile (0: untiled); the plan's `mlp_tile_tokens` (`set_mlp_tiles`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = [
            w for lin in (self.gate_proj, self.up_proj, self.down_proj) for w in (lin.weight, lin.bias)
        ]
        if self.tile_tokens and x.numel() // x.shape[-1] > self.tile_tokens:
            return tiled_mlp(x, self.tile_tokens, self.act, *weights)
        return mlp(x, self.act, *weights)


def set_mlp_tiles(template: nn.Module, tile_tokens: int) -> None:
    """Run every gated MLP of a layer template over `tile_tokens` tokens at a time (0: untiled)."""
    for m in template.modules():
        if isinstance(m, MLP):
            m.tile_tokens = tile_tokens


class DecoderLayer(nn.Module):
    """One transformer block; parameter names are those under `model.layers.{i}.`."""

    def __init__(self, cfg: ModelConfig, mlp_tile_tokens: int = 0):
        super().__init__()
        # Declared in transformers' order, so parameters iterate in the checkpoint's order.
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg, mlp_tile_tokens)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask: Mask = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Parameter names are those under `model.`."""

    weight_name = "embed_tokens.weight"
    scale = 1.0
    looks_up_rows = True  # forward: a row of the table per token, any number of rows (base.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # transformers builds nn.Embedding(padding_idx=pad_token_id): that row gets no gradient.
        self.padding_idx = getattr(cfg.hf_config, "pad_token_id", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class Head(nn.Module):
    """Final norm and LM head. Names: `norm.weight` lives under `model.`, `lm_head.weight` at top
    level; a tied model has no `lm_head` here and borrows the embedding's weight."""

    lm_weight_name = "lm_head.weight"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm (what a score head reads: models/score.py)."""
        return self.norm(x)

    def forward(self, x: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self.normed(x), lm_weight)


def rope_inv_freq(cfg: ModelConfig, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, exactly as transformers computes them (for the
    layers of `layer_type` where they differ by layer type, as in Gemma 3)."""
    hf = cfg.hf_config
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    by_type = layer_type is not None and isinstance(params.get(layer_type), dict)
    params = params[layer_type] if by_type else params
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        d = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {"layer_type": layer_type} if by_type else {}
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **kw)
    return inv.float(), float(scale)


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, position_ids: torch.Tensor, dtype):
    """cos/sin tables for `position_ids` [B, S], shaped [B, 1, S, head_dim] for broadcasting."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def layer_type(cfg: ModelConfig, i: int) -> str:
    """Layer i's kind in families that alternate attention by `layer_types` (`sliding_attention`,
    `full_attention`)."""
    return cfg.hf_config.layer_types[i]


def layer_type_inputs(cfg: ModelConfig, device: torch.device, always_mask: bool = False):
    """The per-micro-batch inputs of families that alternate sliding-window and full attention
    (`layer_types`): each kind's rotary tables (Gemma 3's local layers have their own base) and
    mask. `always_mask`: the scores have no fused kernel but FlexAttention's (Gemma 2's soft cap,
    gpt-oss's sinks), so on CUDA even plain rows take a block mask and no score matrix exists.
    `groups`: images whose tokens attend to all of their image (attention.py's `image_groups`)."""
    windows = {layer_type(cfg, i): w for i, w in enumerate(cfg.windows)}
    ropes = {}
    for kind in windows:
        inv, scale = rope_inv_freq(cfg, kind)
        ropes[kind] = (inv.to(device), scale)

    def inputs(position_ids, document_ids, seq_len, dtype, flex, groups=None):
        return {
            kind: {
                "rope": rope_cos_sin(*ropes[kind], position_ids, dtype),
                "mask": attention_mask(
                    document_ids, seq_len, window, position_ids.device, flex, always_mask and flex, groups
                ),
            }
            for kind, window in windows.items()
        }

    return inputs


def _inputs(cfg: ModelConfig, device: torch.device):
    inv_freq, scale = rope_inv_freq(cfg)
    inv_freq = inv_freq.to(device)

    def inputs(position_ids, document_ids, seq_len, dtype, flex, groups=None):
        rope = rope_cos_sin(inv_freq, scale, position_ids, dtype)
        mask = attention_mask(
            document_ids, seq_len, cfg.sliding_window, position_ids.device, flex, groups=groups
        )
        return {"layer": {"rope": rope, "mask": mask}}

    return inputs


def _key(cfg: ModelConfig, kind: str, layer: int, name: str) -> str:
    if kind == "layer":
        return f"model.layers.{layer}.{name}"
    return name if name.startswith("lm_head.") else f"model.{name}"


# One block, every layer alike: Llama, Mistral, Qwen2, Qwen3 (config.FAMILIES).
BLOCKS = {
    "llama": Family(
        name="llama",
        path="fast",
        embedding=lambda cfg: meta(lambda: Embedding(cfg)),
        layer=lambda cfg, i: meta(lambda: DecoderLayer(cfg)),
        layer_key=lambda cfg, i: "layer",
        layer_kind=lambda cfg, i: "layer",
        inputs=_inputs,
        head=lambda cfg: meta(lambda: Head(cfg)),
        param_key=_key,
        hf_init=False,  # the same rule, kept so that seeded runs reproduce
    )
}

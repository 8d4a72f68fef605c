"""Causal self-attention for plain, packed and sliding-window batches: one rule, three kernels.

The rule: a token attends to itself and earlier tokens of the same document (packed rows carry
`document_ids`; where documents share a prefix, a pair for each token: its document and the one
it also reads, `shared_prefix_ids`), at most `sliding_window - 1` positions back (Mistral); a
vision-language model's image tokens also attend to every token of their own image, later ones too (Gemma 3's `groups`,
transformers' blockwise overlay: the window still bounds how far back). How it is applied:
* no documents, no window shorter than the row: SDPA's `is_causal` (the flash kernel on CUDA);
* otherwise, on CUDA: FlexAttention with a `BlockMask`, compiled. Its tables are per 128x128
  block of the score matrix, built here from each block's first/last position and document ids
  (rows x (S/128)^2 entries, never S x S), so a 512k-token row costs memory linear in S in the
  kernel and ~16 bytes per block pair in the tables;
* otherwise (the CPU, which FlexAttention cannot differentiate on): SDPA with the rule
  materialised as a dense boolean [B, 1, S, S] mask. CPU runs are small; this is also the
  plain reference the GPU tests compare FlexAttention against;
* rows that share a prefix (`SharedRows`, data/shared.py), on every device: each completion's
  queries, keys and values gathered into the unshared row it stands for (its prefix's, then its
  own), SDPA's `is_causal` over those rows (the flash kernel on CUDA), and each token's output
  read back from one of them. The gathered rows are the unshared ones' tokens again, but only
  in attention, a few percent of a layer's FLOPs at a step's lengths; FlexAttention's forward
  and backward over the shared tables cost more.

The mask of a micro-batch is built once (`attention_mask`) and shared by every layer and by the
backward recompute.

Two score variants have no SDPA kernel: Gemma 2's tanh soft-capping and gpt-oss's attention
sinks (a learned logit per head joined to every query's softmax denominator, attending to
nothing). On CUDA both stay on FlexAttention (a score_mod; the sinks from the log-sum-exp it
returns), so those families take a block mask even for plain rows; elsewhere the scores are
explicit, as transformers' eager attention computes them (`eager_attention`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_mask, flex_attention

from .compiling import compiled

BLOCK = 128  # FlexAttention's default block size: the tables' granularity
BLOCK_TABLE_BYTES = 16  # int32 kv/q counts and indices of partial and full blocks


@dataclass(frozen=True)
class SharedRows:
    """A shared-prefix layout's attention as the unshared rows it stands for (data/shared.py):
    `rows` [R, W], each unshared row's tokens as flat indices into the micro-batch's B x S (its
    prefix's, then its own, right-padded with its last, which causal attention never lets a real
    token see); `pick` [B x S], the flat index into R x W each token's output is read from; `ids`
    the layout's document ids ([B, S, 2], `shared_prefix_ids`), for the kernels that take a mask."""

    rows: torch.Tensor
    pick: torch.Tensor
    ids: torch.Tensor

    def to(self, device) -> SharedRows:
        return SharedRows(*(t.to(device, non_blocking=True) for t in (self.rows, self.pick, self.ids)))


Mask = BlockMask | SharedRows | torch.Tensor | None


def dense_ids(document_ids: torch.Tensor | SharedRows | None) -> torch.Tensor | None:
    """Document ids as a tensor (a shared layout's `ids`), for masks over the layout itself."""
    return document_ids.ids if isinstance(document_ids, SharedRows) else document_ids


def effective_window(sliding_window: int | None, seq_len: int) -> int | None:
    """The window that limits a row of `seq_len` tokens (None: it reaches the row's start)."""
    return sliding_window if sliding_window and sliding_window < seq_len else None


def span(lengths: Sequence[int], windows: Sequence[int | None]) -> float:
    """Keys a token's attention covers on average, times two (the causal mean: whole rows of S
    tokens give S), over documents of `lengths` and averaged over the layers' `windows` (None:
    unlimited). A document of n tokens under a window w < n covers n*w - w^2/2 keys, not n^2/2."""
    twice = sum(n * n if w is None or n <= w else 2 * n * w - w * w for w in windows for n in lengths)
    return twice / max(1, len(windows) * sum(lengths))


def uses_mask(packing: bool, sliding_window: int | None, seq_len: int) -> bool:
    """Whether rows of `seq_len` tokens need a mask (FlexAttention on CUDA) rather than plain causal."""
    return packing or effective_window(sliding_window, seq_len) is not None


def mask_bytes(rows: int, seq_len: int, flex: bool, compute_bytes: int = 4) -> int:
    """Bytes of one micro-batch's mask: the BlockMask tables (`flex`; the rule's document ids
    aside), or the dense boolean mask and the additive copy SDPA makes of it."""
    if not flex:
        return rows * seq_len * seq_len * (1 + compute_bytes)
    n = -(-seq_len // BLOCK)
    return rows * n * (n + 1) * BLOCK_TABLE_BYTES


def image_groups(image_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool (image tokens) -> each image token's image, numbered along its row from 0 (a
    run of image tokens is one image, as transformers' `get_block_sequence_ids_for_mask` reads
    them), -1 for every other token."""
    start = image_mask & ~F.pad(image_mask, (1, 0))[:, :-1]
    return torch.where(image_mask, start.long().cumsum(1) - 1, -1)


def shared_prefix_ids(document: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """Document ids [B, S, 2] of rows whose documents share a prefix: each token's document
    (`document`, [B, S], ids >= 0) and the document it also reads (`reads`, an earlier one: its
    shared prefix; -1: none). A completion packed after its prompt's tokens, shared with the
    other completions of the prompt, reads the prompt's document (data/shared.py)."""
    return torch.stack([document, reads], -1)


def _split(document_ids: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(each token's document, the document it also reads or None) of [B, S] or [B, S, 2] ids."""
    if document_ids is None or document_ids.dim() == 2:
        return document_ids, None
    return document_ids[..., 0], document_ids[..., 1]


def mask_rule(document_ids: torch.Tensor | None, window: int | None, groups: torch.Tensor | None = None):
    """The rule as a FlexAttention mask_mod: (batch, head, q, kv) -> attend?"""
    doc, reads = _split(document_ids)

    def rule(b, h, q, kv):
        keep = q >= kv
        if groups is not None:
            keep = keep | ((groups[b, q] == groups[b, kv]) & (groups[b, q] >= 0))
        if window is not None:
            keep = keep & (q - kv < window)
        if doc is not None:
            same = doc[b, q] == doc[b, kv]
            keep = keep & (same if reads is None else same | (reads[b, q] == doc[b, kv]))
        return keep

    return rule


def attention_mask(
    document_ids: torch.Tensor | SharedRows | None,
    seq_len: int,
    sliding_window: int | None,
    device,
    flex: bool,
    always: bool = False,
    groups: torch.Tensor | None = None,
) -> Mask:
    """The mask of one micro-batch: None (plain causal, unless `always`: for attention that takes
    no causal flag), a shared layout's rows (`SharedRows`, where no window, image or score
    variant asks for a mask), a BlockMask (`flex`) or a dense boolean [B|1, 1, S, S] tensor (True =
    attend). `document_ids` ([B, S], or [B, S, 2]: `shared_prefix_ids`, or `SharedRows`) and the
    image `groups` ([B, S], `image_groups`) must be on `device`."""
    window = effective_window(sliding_window, seq_len)
    if isinstance(document_ids, SharedRows):
        if window is None and groups is None and not always:
            return document_ids
        document_ids = document_ids.ids
    if document_ids is None and window is None and groups is None and not always:
        return None
    rule = mask_rule(document_ids, window, groups)
    rows = next((t.shape[0] for t in (document_ids, groups) if t is not None), 1)
    if not flex:
        return create_mask(rule, rows, 1, seq_len, seq_len, device)
    return _block_mask(rule, document_ids, seq_len, window, torch.device(device), groups)


def _blocks(ids: torch.Tensor, n: int, seq_len: int, fill: int | None) -> torch.Tensor:
    """[B, S] ids -> [B, n, BLOCK]: the row cut into blocks, the last one padded with `fill` (None:
    its last id)."""
    pad = n * BLOCK - seq_len
    tail = ids[:, -1:].expand(-1, pad) if fill is None else ids.new_full((ids.shape[0], pad), fill)
    return torch.cat([ids, tail], 1).view(-1, n, BLOCK)


def _bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, n, BLOCK] ids, -1 for none -> each block's least and greatest id (none: lo > hi)."""
    return torch.where(ids >= 0, ids, torch.iinfo(ids.dtype).max).amin(-1), ids.amax(-1)


def _block_mask(rule, document_ids, seq_len: int, window: int | None, device, groups=None) -> BlockMask:
    """Classify each (q block, kv block) pair from block bounds alone: *empty* when no pair of
    tokens in it may attend, *full* when every pair may (the kernel then skips the rule), else
    *partial*. Both tests are exact bounds, so the classification is safe for any ids."""
    n = -(-seq_len // BLOCK)
    first = torch.arange(n, device=device) * BLOCK
    last = torch.clamp(first + BLOCK, max=seq_len) - 1
    q0, q1, k0, k1 = first[:, None], last[:, None], first[None], last[None]
    some = (k0 <= q1)[None]  # causal: the earliest key is not after the latest query
    every = (k1 <= q0)[None]
    if groups is not None:  # or an image's tokens in both blocks (a full block stays full)
        lo, hi = _bounds(_blocks(groups, n, seq_len, -1))
        some = some | ((lo[:, :, None] <= hi[:, None]) & (lo[:, None] <= hi[:, :, None]))
    if window is not None:
        some = some & (q0 - k1 < window)
        every = every & (q1 - k0 < window)
    whole = last - first + 1 == BLOCK  # a block cut by the row's end is never full, as in torch
    every = every & whole[:, None] & whole[None]
    doc, reads = _split(document_ids)
    if doc is not None:
        d = _blocks(doc, n, seq_len, None)
        lo, hi = d.amin(-1), d.amax(-1)
        own = (lo[:, :, None] <= hi[:, None]) & (lo[:, None] <= hi[:, :, None])
        single = lo == hi
        whole_doc = single[:, :, None] & single[:, None] & (lo[:, :, None] == lo[:, None])
        if reads is not None:  # or a kv block's documents among those its queries also read
            r = _blocks(reads, n, seq_len, -1)
            r_lo, r_hi = _bounds(r)
            own = own | ((r_lo[:, :, None] <= hi[:, None]) & (lo[:, None] <= r_hi[:, :, None]))
            # full: a kv block of one document that each query is of or reads (B x n^2 x BLOCK
            # tests: a shared layout's rows are a step's prompt and completions, not 512k tokens)
            x = lo[:, None, :, None]
            each = ((d[:, :, None] == x) | (r[:, :, None] == x)).all(-1)
            whole_doc = whole_doc | (each & single[:, None])
        some = some & own
        every = every & whole_doc
    every = every & some  # a no-op but for the batch dimension (images' groups are per row)
    partial = some & ~every
    return BlockMask.from_kv_blocks(
        *_ordered(partial), *_ordered(every), BLOCK_SIZE=BLOCK, mask_mod=rule, seq_lengths=(seq_len, seq_len)
    )


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, n, n] bool -> per query block, the number of its kv blocks and their indices first."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[:, None].contiguous(), idx[:, None].contiguous()


@functools.cache
def _compiled_flex():
    # Compiled once per process: eager FlexAttention materialises the whole score matrix.
    return compiled(flex_attention)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Mask,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v under the causal rule and `mask`; q [B, H, S, d], k and v
    [B, H_kv, S, d] (grouped-query heads are read as they are, never repeated). `scale` replaces
    1/sqrt(d); `softcap` caps the scores at +-softcap with tanh first (Gemma 2); `sinks` [H] are
    extra logits in each head's softmax denominator (gpt-oss)."""
    if isinstance(mask, SharedRows):
        return _attend_rows(q, k, v, mask, scale, softcap, sinks)
    gqa = k.shape[1] != q.shape[1]
    if isinstance(mask, BlockMask):
        # Inside a compiled layer the compiler traces FlexAttention itself; a nested compiled
        # function there is refused.
        fn = flex_attention if torch.compiler.is_compiling() or q.device.type != "cuda" else _compiled_flex()
        kw = dict(score_mod=_capped(softcap), block_mask=mask, scale=scale, enable_gqa=gqa)
        if q.device.type == "cuda":
            # Forward only, a query shorter than 128 tokens takes the decoding kernel, which gives
            # wrong results under these block masks (torch 2.11: a packed eval row of 24 tokens
            # was off by 6 nats a sequence); the main kernel is exact at every length.
            kw["kernel_options"] = {"FORCE_USE_FLEX_ATTENTION": True}
        if sinks is None:
            return fn(q, k, v, **kw)
        out, aux = fn(q, k, v, **kw, return_aux=AuxRequest(lse=True))
        return sink_rescale(out, aux.lse, sinks)
    if softcap is not None or sinks is not None:
        return eager_attention(q, k, v, mask, scale, softcap, sinks)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _attend_rows(q, k, v, shared: SharedRows, scale, softcap, sinks) -> torch.Tensor:
    """`attend` over a shared layout's unshared rows (causal, no mask), each token's output read
    back from its row; the gathers' backward adds a prefix's gradients over its rows."""
    B, H, S, d = q.shape

    def rows(t: torch.Tensor) -> torch.Tensor:  # [B, h, S, e] -> [R, h, W, e]
        flat = t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[-1])
        return flat[shared.rows].transpose(1, 2)

    y = attend(rows(q), rows(k), rows(v), None, scale, softcap, sinks)  # [R, H, W, e]
    flat = y.transpose(1, 2).reshape(-1, H, y.shape[-1])
    return flat[shared.pick].view(B, S, H, -1).transpose(1, 2)


def _capped(cap: float | None):
    """FlexAttention's score_mod for tanh soft-capping (None: scores as they are)."""
    if cap is None:
        return None

    def score_mod(score, b, h, q, kv):
        return torch.tanh(score / cap) * cap

    return score_mod


def sink_rescale(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output `out` [B, H, S, d] of a softmax whose log-sum-exp is `lse` [B, H, S] (fp32),
    rescaled as if each head's sink logit had joined the denominator:
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink). Differentiable in all three (the
    sinks' gradient flows through the log-sum-exp)."""
    keep = torch.sigmoid(lse - sinks.float()[:, None])
    return (out * keep[..., None]).to(out.dtype)


def eager_attention(
    q, k, v, mask, scale: float | None, cap: float | None = None, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention with explicit scores, as transformers' eager attention computes them: scores,
    tanh cap (Gemma 2), mask, a sink column per head (gpt-oss: in the softmax, then dropped),
    fp32 softmax. q [B, H, S, D], k/v grouped; quadratic in memory (CUDA takes FlexAttention)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = F.softmax(s, dim=-1, dtype=torch.float32)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p.to(q.dtype), v)

"""The rollout engine: a generation batch sampled from a transformers causal LM on the device.

One KV cache for the whole batch, allocated once (`KVCache`: every row at the batch's prompt
width + max_new_tokens - 1, the rows left-padded); one batched prefill of the distinct prompts
(a prompt repeated num_generations times is prefilled once, its cache rows copied); then one decode
step per new token for every row at once. Each row's token is drawn on the device from its own
stream (sampling.draw at sampling.device_uniforms), so a completion depends on its prompt, seed
and the weights alone. A row that has drawn an end token takes padding from then on; the host
looks every SYNC_EVERY steps which rows are still drawing, and where at most LEAVE_AT of the
batch's rows are and the step is not compiled, the ended ones leave it (`_State.leave`: the live
rows' cache, tokens and streams gathered to the front, the later steps that many rows wide).

Attention goes through a function of this module registered with transformers
(`ATTENTION`): the model's own layers, projections (the rollout's policy fuses q/k/v and gate/up,
rl/fuse.py) and rotary embeddings, with the cache and the mask this module owns. A decode step reads the keys up to the current length rounded up to
SPAN_BLOCK; grouped-query heads are read once (the query heads of a group as the rows of one
attention). On CUDA, with the whole policy on the device, each decode step of a span is captured
once in a CUDA graph and replayed (no launch overhead, no host sync); streamed layers
(rl/policy.py) run eagerly, paced by their fetches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import Cache

from ..models.attention import eager_attention
from ..objectives.logprobs import token_logps
from .sampling import Warpers, device_uniforms, draw

ATTENTION = "megatrain_rollout"  # the attention implementation the engine's model runs with
SPAN_BLOCK = 128  # decode steps attend to the filled cache rounded up to this: one graph each
SYNC_EVERY = 16  # decode steps between the host's checks of which rows have ended
# The ended rows leave the batch where at most this share of its rows still draws, in an eager
# step: there narrower steps pay (7B, one H100, end tokens 1 in 128: 3,506 completion tokens/s
# against 2,996 keeping every row). A compiled step keeps every row: its narrower steps would run
# eager or compile again, and the 128-row compiled step kept beats both (4,171 against 3,640
# leaving; bench/results/2026-12-06_0736_rollout-leave).
LEAVE_AT = 0.5

# The forward in progress, for the attention function (a plain holder, which the compiler traces).
_current: list[_Forward] = []


class KVCache(Cache):
    """Keys and values of every layer for `rows` rows of `length` positions, allocated at the
    first write of each layer (its heads and dims are the model's). `at` is the position the next
    forward writes at (a device tensor, so a CUDA graph advances it); a forward's keys are read up
    to `span` (a host number). The prefill (`prefilling`, from position 0) attends to its own keys,
    written into the cache; where it runs over the distinct prompts only, `expand` maps each cache
    row to the prefill row it copies."""

    def __init__(self, rows: int, length: int, device):
        super().__init__(layers=[])
        self.rows, self.length, self.device = rows, length, torch.device(device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.at = torch.zeros(1, dtype=torch.long, device=self.device)
        self._span = torch.empty(0)
        self.span = length
        self.prefilling = False
        self.expand: torch.Tensor | None = None
        self.seen = 0  # host mirror of `at`, for callers that ask the length

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            shape = (self.rows, key.shape[1], self.length)
            self.keys[layer_idx] = key.new_zeros(*shape, key.shape[-1])
            self.values[layer_idx] = value.new_zeros(*shape, value.shape[-1])
        if self.prefilling:  # from position 0: the forward's own keys are the cache's so far
            rows = self.expand
            self.keys[layer_idx][:, :, : key.shape[2]] = key if rows is None else key.index_select(0, rows)
            self.values[layer_idx][:, :, : key.shape[2]] = (
                value if rows is None else value.index_select(0, rows)
            )
            return key, value
        where = self.at + torch.arange(key.shape[2], device=self.device)
        self.keys[layer_idx].index_copy_(2, where, key)
        self.values[layer_idx].index_copy_(2, where, value)
        return self.keys[layer_idx][:, :, : self.span], self.values[layer_idx][:, :, : self.span]

    @property
    def span(self) -> int:
        return self._span.shape[0]

    @span.setter
    def span(self, n: int) -> None:
        # The span is the length of an (empty) tensor, its size marked dynamic: one compile of the
        # decode step serves every span (a plain int would be specialised, one compile each).
        if n != self._span.shape[0]:
            self._span = torch.empty(n, dtype=torch.uint8, device=self.device)
            torch._dynamo.maybe_mark_dynamic(self._span, 0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def nbytes(self) -> int:
        """The buffers' bytes (as allocated: rows that left the batch still hold theirs)."""
        return sum(t.untyped_storage().nbytes() for d in (self.keys, self.values) for t in d.values())


@dataclass
class _Forward:
    """One forward's view of the cache for the attention function: the cache positions its queries
    sit at (`at` on, `queries` of them), each row's left padding, and the masks made from them, one
    per sliding window (None: none), made at its first layer and shared by the others."""

    cache: KVCache
    pad: torch.Tensor  # [rows] left padding of each row (after `expand`)
    queries: int
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """[rows, 1, queries, span] bool: a query attends to itself and the earlier positions of its
        row's tokens, within `window` positions back. Padding queries attend to themselves alone
        (their outputs are never read, and keep every row finite)."""
        if window not in self.masks:
            q = (self.cache.at + torch.arange(self.queries, device=self.pad.device))[:, None]
            k = torch.arange(self.cache.span, device=self.pad.device)[None]
            keep = (k <= q) & ((k >= self.pad[:, None, None]) | (k == q))
            if window is not None:
                keep = keep & (q - k < window)
            self.masks[window] = keep[:, None]
        return self.masks[window]


def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, **kwargs):  # fmt: skip
    """The engine's attention (transformers' interface): query [B, H, S, D] against the cache's
    keys and values [B, H_kv, span, D] under `_Forward.mask`; returns [B, S, H, D]. One query a
    row (decode) reads the grouped keys once: the G query heads of a group are G rows of one
    attention over that group's keys. Soft-capped scores (Gemma 2) and sinks (gpt-oss) take the
    explicit scores of models/attention.py."""
    fwd = _current[-1]
    mask = fwd.mask(sliding_window)
    B, H, S, D = query.shape
    if softcap is not None or s_aux is not None:
        out = eager_attention(query, key, value, mask, scaling, softcap, s_aux)
    elif S == 1:
        groups = key.shape[1]
        q = query.reshape(B, groups, H // groups, D)  # a copy where the heads are strided apart
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
        out = out.reshape(B, H, 1, -1)
    else:
        gqa = key.shape[1] != H
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _registered() -> None:
    # With transformers' attention interface at the first use: importing it loads transformers'
    # modeling_utils and torch's compiler, which a process that samples nothing never needs.
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


@contextlib.contextmanager
def engine_attention(model):
    """The model's attention switched to the engine's within the block."""
    _registered()
    configs = [m.config for m in model.modules() if hasattr(m, "config")]
    before = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b


def supports(model) -> bool:
    """Whether a transformers model's attention goes through transformers' interface (so through
    the engine's function)."""
    return bool(getattr(model, "_supports_attention_backend", False))


class Decoder:
    """Samples completions of left-padded prompts: `rows` of them at most `max_new` tokens each,
    from `model` (a transformers causal LM on `device`), each row's tokens from its seed's stream,
    a row ending at its first token in `stops`. `graphs`: capture each decode step in a CUDA graph
    (the whole model on the device, no hooks that stream weights). `compile`: the decode step
    compiled by torch.compile first (its elementwise work fused; once a process, `compiled_decode`)."""

    def __init__(self, model, device, stops: list[int], pad_id: int, warpers: Warpers, graphs: bool,
                 compile: bool = False, logps: bool = False):  # fmt: skip
        self.model, self.device = model, torch.device(device)
        self.logps = logps  # keep each drawn token's log-prob (`sampled_logps`)
        self.sampled_logps: torch.Tensor | None = None  # the last `sample`'s [rows, max_new], on the host
        self.compile = compile and self.device.type == "cuda"  # the CPU runs the step as it is
        self.stops = torch.tensor(stops or [-1], device=self.device)
        self.pad_id, self.warpers = pad_id, warpers
        self.graphs = graphs and self.device.type == "cuda"
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.timing: dict[str, float] = {}  # the last `sample`'s: prefill, graph captures, decode steps

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], seeds: list[int], max_new: int) -> list[list[int]]:
        """Each prompt's `max_new` tokens (padding after its first end token), on the host."""
        rows, width = len(prompts), max(len(p) for p in prompts)
        length = width + max_new - 1  # the last token drawn is never fed back
        # One position more than is written: no span reaches the whole buffer, so every span's
        # slice of it is strided alike and one compile of the decode step serves them all.
        cache = KVCache(rows, length + 1, self.device)
        pad = torch.tensor([width - len(p) for p in prompts], device=self.device)
        s = _State(self, cache, pad, torch.tensor(seeds, dtype=torch.long, device=self.device), max_new)
        t0 = time.perf_counter()
        capture_s, steps = 0.0, 0
        with engine_attention(self.model):
            s.prefill(prompts, width)
            self._sync()
            t1 = time.perf_counter()
            graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by span, at the batch's current rows
            pool = torch.cuda.graph_pool_handle() if self.graphs else None
            widths = [(1, rows)]  # (the decode step from which, rows in the batch)
            for n in range(1, max_new):
                cache.span = min(length, -(-(width + n) // SPAN_BLOCK) * SPAN_BLOCK)
                if not self.graphs:
                    s.decode()
                elif cache.span in graphs:
                    graphs[cache.span].replay()
                else:  # the step run as it is, then captured: its replays are the next steps
                    s.decode()
                    c0 = time.perf_counter()
                    graphs[cache.span] = s.capture(pool)
                    capture_s += time.perf_counter() - c0
                cache.seen, steps = width + n, n
                if n % SYNC_EVERY == 0:
                    live = (~s.done).nonzero().squeeze(1)
                    if len(live) == 0:
                        break
                    if len(live) <= LEAVE_AT * cache.rows and not self.compile:
                        s.leave(live)
                        graphs.clear()  # captured over the wider buffers
                        widths.append((n + 1, len(live)))
            out = s.out.cpu()
            self.sampled_logps = s.logps.cpu() if s.logps is not None else None
        self.timing = {"prefill_s": t1 - t0, "capture_s": capture_s, "graphs": len(graphs),
                       "decode_s": time.perf_counter() - t1 - capture_s, "steps": steps,
                       "cache_bytes": cache.nbytes(), "widths": widths}  # fmt: skip
        del graphs, s, cache
        return out.tolist()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _State:
    """The static buffers of one `Decoder.sample`: the next token fed and its position, the draw
    counter, which rows have ended, the tokens drawn. A decode step reads and writes only these, so
    a CUDA graph of it is replayed as the next step."""

    def __init__(self, dec: Decoder, cache: KVCache, pad: torch.Tensor, seeds: torch.Tensor, max_new: int):
        self.dec, self.cache, self.pad, self.seeds = dec, cache, pad, seeds
        rows, device = len(pad), dec.device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.drawn = torch.zeros(1, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.rows = torch.arange(rows, device=device)  # the sampled row each row of the batch is
        self.out = torch.full((rows, max_new), dec.pad_id, dtype=torch.long, device=device)
        # Each drawn token's log-prob under the warped distribution it was drawn from (vLLM's
        # processed logprobs: the stale sampler's, for its correction in the loss).
        self.logps = torch.zeros(rows, max_new, device=device) if dec.logps else None

    def _forward(self, ids, positions, pad, queries) -> torch.Tensor:
        """The last position's fp32 logits [rows, vocab] of `ids` at `positions`, the cache written."""
        _current.append(_Forward(self.cache, pad, queries))
        try:
            kw = {self.dec.cache_kw: self.cache}
            out = self.dec.model(
                input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **kw
            )
        finally:
            _current.pop()
        self.cache.at += queries
        return out.logits[:, -1].float()

    def _take(self, logits: torch.Tensor) -> None:
        """Draw every row's next token, record it, and feed it next."""
        u = device_uniforms(self.seeds, self.drawn)
        warped = self.dec.warpers(logits)
        token = draw(warped, u)
        at = (self.rows, self.drawn.expand(len(self.rows)))
        if self.logps is not None:
            self.logps.index_put_(at, token_logps(warped, token))
        token = torch.where(self.done, self.dec.pad_id, token)
        self.out.index_put_(at, token)
        # (not torch.isin: past a few end tokens it sorts, which a CUDA graph cannot capture)
        self.done |= (token[:, None] == self.dec.stops).any(1)
        self.tokens.copy_(token[:, None])
        self.positions += 1
        self.drawn += 1

    def prefill(self, prompts: list[list[int]], width: int) -> None:
        """Every distinct prompt through the model once, left-padded to `width`; each row's cache
        and first token from its prompt's."""
        distinct = {tuple(p): i for i, p in enumerate(dict.fromkeys(map(tuple, prompts)))}
        ids = torch.full((len(distinct), width), self.dec.pad_id, dtype=torch.long)
        for p, i in distinct.items():
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in distinct], device=self.dec.device)
        pad = width - lengths
        positions = (torch.arange(width, device=self.dec.device)[None] - pad[:, None]).clamp_(min=0)
        expand = torch.tensor([distinct[tuple(p)] for p in prompts], device=self.dec.device)
        self.cache.expand = None if len(distinct) == len(prompts) else expand
        self.cache.prefilling, self.cache.span = True, width
        try:
            logits = self._forward(ids.to(self.dec.device), positions, pad, width)
        finally:
            self.cache.prefilling, self.cache.expand = False, None
        if len(distinct) != len(prompts):
            logits = logits.index_select(0, expand)
        self.positions.copy_(lengths.index_select(0, expand)[:, None] - 1)  # _take moves it on
        self._take(logits)

    def decode(self) -> None:
        """One token for every row."""
        if self.dec.compile:
            capturing = self.dec.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            # (a graph captures a step that already ran plainly)
            counters = None if capturing else [t.clone() for t in self._moving()]
            try:
                compiled_decode()(self)
                return
            except torch._dynamo.exc.TorchDynamoException as e:
                # What part of the step ran wrote the cache and tokens where the eager step writes
                # them again; the counters it moved are put back.
                _current.clear()
                for now, before in zip(self._moving(), counters):
                    now.copy_(before)
                self.dec.compile = False
                warnings.warn(f"rollout_compile: the decode step did not compile, sampling eagerly "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})", stacklevel=2)  # fmt: skip
        self._step()

    def leave(self, live: torch.Tensor) -> None:
        """The batch narrowed to the rows `live` (ascending): their cache rows gathered to the
        front of each layer's buffers (one layer's live rows copied at a time), their tokens,
        positions, padding and streams with them; the ended rows' tokens stay where they were
        drawn. Their CUDA graphs are captured again at the new width."""
        cache, n = self.cache, len(live)
        for d in (cache.keys, cache.values):
            for layer, t in d.items():
                d[layer] = t[:n].copy_(t.index_select(0, live))
        cache.rows = n
        for name in ("tokens", "positions", "pad", "seeds", "done", "rows"):
            setattr(self, name, getattr(self, name).index_select(0, live))

    def _moving(self) -> list[torch.Tensor]:
        """What a step moves on rather than overwrites."""
        return [self.cache.at, self.positions, self.drawn, self.done]

    def _step(self) -> None:
        self._take(self._forward(self.tokens, self.positions, self.pad, 1))

    def capture(self, pool) -> torch.cuda.CUDAGraph:
        """A CUDA graph of `decode` at the cache's current span (capturing runs nothing)."""
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.dec.device)
        with torch.cuda.graph(graph, pool=pool):
            self.decode()
        return graph


@functools.cache
def compiled_decode():
    """`_State._step` compiled, once a process: a new model of the same shapes (every rollout's)
    reuses it, and one compile serves every attended span (`KVCache.span`'s size is dynamic)."""
    return torch.compile(_State._step, dynamic=False)

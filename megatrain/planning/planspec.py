"""The plan's data: the machine a run may use, the largest step of the run, the model's shape as
the memory and time models see it, and the `Plan` itself (every placement decision and what it
predicts). placement.py decides the plan, footprint.py and costmodel.py cost it; engine,
transport and the CLI read it. Nothing here decides or costs anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..host.moments import FP32, Moments, named
from ..host.split import HALF_BYTES
from ..host.state import MASTER_BYTES, build_units, state_bytes
from ..models.config import ModelConfig
from ..models.family import family_of
from ..models.vision import tower_shape
from ..parallel.layout import Layout
from .probe import LayerMemory, token_ffn

# The pools a plan sizes by default
PREFETCH = 2  # units copied ahead of compute
STAGING_CHUNK = 32 * 2**20  # elements per device->host gradient chunk
INFLIGHT_UNITS = 2  # gradients on their way to the host optimizer (immediate, two_pass)
EMBED_GRAD_ROWS = 32768  # tokens per scatter-add of the embedding's gradient
# A machine's rates where they are not measured: the link's, one way, and the CPU AdamW's inside a
# training step (costmodel.py says where the figures come from)
PCIE_BYTES_S = 55e9
ADAM_PARAMS_S = 3e9
# Bytes a parameter takes over the link at each fetch from host memory, by the compute dtype's
# bytes: the master weights' `hi` in bf16, both halves in fp32 (host/split.py); and those it lands
# in on the device beside its compute-dtype buffer: none in bf16, the halves (joined there) in fp32.
FETCH_BYTES = {2: 2, 4: HALF_BYTES}
LANDING_BYTES = {2: 0, 4: HALF_BYTES}


def fetch_bytes(plan: Plan, compute_bytes: int) -> int:
    """Bytes a parameter moves host->device at each fetch under `plan` (`fetch_both_halves`)."""
    return HALF_BYTES if plan.fetch_both_halves else FETCH_BYTES[compute_bytes]


def landing_bytes(plan: Plan, compute_bytes: int) -> int:
    """Bytes a parameter lands in on the device beside its compute-dtype buffer while fetched."""
    return HALF_BYTES if plan.fetch_both_halves else LANDING_BYTES[compute_bytes]


# The host AdamW kernel (torch's fused one, and engine/clipadam.py's) takes a tensor's last
# `n % KERNEL_TAIL` elements in a form of their own, the others all in one.
KERNEL_TAIL = 8
# The disk tier's rates, read and written, where nothing was measured: one NVMe drive (a
# conservative figure, not a measurement of this project's; a run measures its own, host/disk.py)
DISK_BYTES_S = 2e9


@dataclass(frozen=True)
class Machine:
    """What the run may use. Sizes are budgets in bytes (None: unknown, not checked)."""

    device: str  # "cuda" or "cpu"
    gpu_bytes: int | None = None
    host_bytes: int | None = None
    gpu_capped: bool = False
    """gpu_bytes is a user cap that includes the CUDA context (not a measured free size)."""
    gpu_flops: float | None = None
    pcie_bytes_s: float = PCIE_BYTES_S
    adam_params_s: float = ADAM_PARAMS_S
    """The host AdamW's rate inside a step with fp32 moments (placement.host_adam_rate)."""
    moment_adam_params_s: dict[str, float] = field(default_factory=dict)
    """Its rate in a moment format stepped by a kernel of its own (`Moments.name`: bf16, 8bit),
    probed as adam_params_s is, with that kernel (runtime.probe_machine); a format not here takes
    costmodel.py's rule."""
    world: Layout = Layout()
    """The data-parallel world this machine belongs to: partitioned over several machines, its
    host memory holds only its part of the state (layout.py); sharded, no state on the GPU."""
    disk_bytes: int | None = None
    """Room for the disk tier in `offload_dir` (None: no disk tier)."""
    disk_read_bytes_s: float = DISK_BYTES_S
    disk_write_bytes_s: float = DISK_BYTES_S
    disk_duplex_bytes_s: float = DISK_BYTES_S
    """Read and written together, at once (by default as if in turn)."""
    disk_direct: bool = True
    """The tier's I/O is O_DIRECT (False: offload_dir's file system refuses it; buffered)."""
    disk_folders: int = 1
    """Folders of offload_dir, one per drive, the tier is striped over (the rates are their sums)."""

    @classmethod
    def from_json(cls, d: dict) -> Machine:
        """The machine `dataclasses.asdict` wrote (records of bench/ runs; before the disk's read
        and write rates were apart, one rate for both)."""
        d = dict(d)
        d.pop("copy_in_kernel", None)  # records from when a bf16 copy of the weights was kept
        if "disk_bytes_s" in d:  # one rate each way, the two in turn
            rate = d.pop("disk_bytes_s")
            d |= {"disk_read_bytes_s": rate, "disk_write_bytes_s": rate, "disk_duplex_bytes_s": rate}
        return cls(**{**d, "world": Layout(**d.get("world", {}))})


@dataclass(frozen=True)
class Batch:
    """The largest optimizer step of the run: rows padded to max_length are an upper bound."""

    micro_batch_tokens: int
    micro_batches: int
    seq_len: int
    compute_bytes: int
    clip: bool
    masked: bool = False
    """Rows need attention masks (packing, a sliding window shorter than seq_len): FlexAttention's
    block tables, (seq_len / 128)^2 entries per row, all micro-batches' alive through the step."""
    rows: int = 1
    autograd_head: bool = False
    """The objective differentiates each loss-head chunk through autograd (stages.autograd_head),
    not in cross-entropy's one pass: more bytes a logit (footprint.logit_bytes)."""
    attention_span: float | None = None
    """Keys a token's attention covers, on average, times two (the causal mean: whole causal rows
    of S tokens give S), over packed documents and the layers' windows (`attention.span`); None:
    the whole row."""
    coupled: str = ""
    """Why the objective's loss couples a step's micro-batches beyond its normaliser
    (`Objective.coupled`, stages.coupled), so that the update stays layer-major; "": it does not."""

    @property
    def tokens(self) -> int:
        return self.micro_batch_tokens * self.micro_batches


@dataclass
class Plan:
    """Every placement decision of a run, and the memory and time it predicts."""

    device: str
    grad_mode: str  # stored | two_pass | immediate
    gpu_grad_units: int  # stored: leading units whose gradients wait on the GPU (the rest: host)
    resident_units: int  # leading units whose fp32 state lives on the GPU
    keep_layers: int  # trailing layers whose graphs are kept from the forward sweep
    parked_layers: int  # leading layers whose boundary activations wait in host memory
    loss_chunk_tokens: int
    mlp_tile_tokens: int = 0  # tokens per MLP tile in the decoder layer (0: untiled)
    gpu_stepped_units: int = 0
    """Streamed units (state in host memory) stepped on the GPU: the first ones after the resident
    units (`stepped`); the user's count (`gpu_step_units`), or with `auto` the cost model's."""
    prestage: bool = True
    """Stored mode: the GPU-stepped units' fp32 state comes in during the backward sweep and waits
    on the GPU for the step (`prestaged`); False: it comes in after the clip, through scratch (the
    schedule bench/results/2026-11-23_0402_gpustep.json measured). The plan takes the faster that
    fits (placement.py)."""
    disk_units: int = 0
    """Trailing units whose AdamW moments live on disk (host/disk.py), where host memory cannot
    hold the whole state."""
    disk: int = 0
    """Bytes those moments take in offload_dir."""
    rollout_layers: int | None = None
    """stage grpo: the decoder layers the rollout's policy keeps on the GPU, the others streamed
    through it in every forward (rl/policy.py); None: every layer (plan.py's `rollout_split`)."""
    embed_rows: bool = False
    """The embedding (untied, its state in host memory) stepped by the host optimizer and fetched
    as the rows a step looks up, each step's rows computed ahead of its whole table's pass
    (engine/rows.py); the GPU-stepped units then start after it. The user's `embedding_rows`, or
    with `auto` the cost model's choice (placement.py)."""
    update_order: str = "layer"
    """How a step visits layers and micro-batches: `layer`, each layer's pass over every
    micro-batch in turn (boundary activations kept, the layers but the kept ones recomputed in
    the backward sweep); `micro_batch`, each micro-batch's forward, loss and backward through every
    layer in turn, every layer's graph of it kept (no recompute), for models whose every unit is
    GPU-resident (engine.py). The user's `update_order`, or with `auto` the cost model's choice
    where the graphs fit (placement.py)."""
    fetch_both_halves: bool = False
    """In bf16 compute, each fetch from host memory moves both of the master's halves (4 B a
    parameter, as the fp32 master before the halves did) and the device keeps their `hi`: the
    same weights, today's bytes beside those of before, for comparison (bench.py's
    `--fetch-both-halves`); off, a fetch moves `hi` alone (FETCH_BYTES)."""
    moments: str = FP32.name
    """How the AdamW moments are stored (host/moments.py's `Moments.name`: fp32, bf16, 8bit), as
    `optim` says: every byte of state below is counted in it."""
    prefetch: int = PREFETCH
    staging_elems: int = STAGING_CHUNK
    inflight_units: int = INFLIGHT_UNITS
    gpu_peak: int = 0
    """Predicted peak of allocated GPU memory (torch.cuda.max_memory_allocated)."""
    gpu: dict[str, int] = field(default_factory=dict)
    """The tensors alive at that peak, by kind."""
    host: dict[str, int] = field(default_factory=dict)
    """Host memory by kind; its sum is the predicted growth of the resident set."""
    pinned: int = 0
    step_time_s: float = 0.0
    """Cost-model estimate of one optimizer step (comparisons and projections, not a promise)."""
    notes: list[str] = field(default_factory=list)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def stepped(self) -> range:
        """The GPU-stepped units (forward order): the first `gpu_stepped_units` after the resident
        ones (and after the embedding where its rows are fetched, `embed_rows`), so the next forward
        sweep finds their updated weights on the GPU first."""
        start = self.resident_units + int(self.embed_rows)
        return range(start, start + self.gpu_stepped_units)

    @property
    def prestaged(self) -> range:
        """The GPU-stepped units whose state is loaded during the backward sweep: all of them where
        gradients are held for the clip (the sweep lands none of them), else none."""
        return self.stepped if self.prestage and self.grad_mode == "stored" else range(0)

    def kept_fresh(self, layers: int, tied: bool) -> list[int]:
        """Prestaged units that a step fetches again after the forward sweep (their backward
        sweep's fetch; the embedding, a tied head's or a trained vision tower's: `tied`): their
        updated weights (compute dtype) stay on the GPU from their step to that fetch, which takes
        them."""
        backward = range(1, layers - self.keep_layers + 1)
        return [u for u in self.prestaged if u in backward or (u == 0 and tied)]

    @property
    def gpu_grad_lead(self) -> int:
        """Stored mode: the leading units whose gradients wait on the GPU for the clip (resident
        and GPU-stepped units' always, which the GPU steps there)."""
        return max(self.gpu_grad_units, self.stepped.stop)

    @property
    def moment_format(self) -> Moments:
        return named(self.moments)

    def state_bytes(self, numel: int) -> int:
        """Bytes of the state of `numel` elements (whole units): the master weights' halves and moments."""
        return MASTER_BYTES * numel + self.moment_format.nbytes(numel)

    def to_json(self) -> dict:
        # `halves`: the run fetched the master weights' halves (FETCH_BYTES), which the records of
        # the system before them lack (bench/replay.py replays those with the bytes they moved).
        per = state_bytes(self.moment_format)
        return {**asdict(self), "host_total": self.host_total, "halves": True, "state_bytes_per_param": per}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        """The decisions of a plan `to_json` wrote (plan.json, bench/ records); its predictions
        are made again by footprint.evaluate. Fields a record predates keep their defaults."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.init and f.name in d})


# ---------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class Shape:
    """What the memory model needs of a model: units in forward order (numel incl. padding)."""

    units: tuple[int, ...]  # embed, layers..., head
    largest_param: tuple[int, ...]  # per unit
    hidden: int
    ffn: int
    q_dim: int
    vocab: int
    layers: int
    tied: bool
    layer_mem: LayerMemory
    inactive: int = 0
    """Parameters of a layer that a token does not pass through (the experts it is not routed to)."""
    rows_embedding: bool = False
    """The embedding unit is one token table whose forward looks up rows alone (the template's
    `looks_up_rows`, models/base.py): its rows can be fetched instead of the table."""
    vision: tuple[float, int, int, int] | None = None
    """A vision-language model's tower in the embedding unit (models/vision.py's `tower_shape`):
    its tokens per image token at most, width, MLP width and layers; None: a text model."""
    vision_trains: bool = False
    """Its tower or projector trains: the backward sweep fetches the embedding again and holds the
    tower's graph of a micro-batch's images."""

    @property
    def layer(self) -> int:
        """The largest layer unit (DeepSeek's expert layers, not its dense first ones)."""
        return max(self.units[1:-1]) if self.layers else 0

    @property
    def total(self) -> int:
        return sum(self.units)

    @property
    def embed_again(self) -> bool:
        """Whether a step fetches the embedding after its forward pass: a tied head's, or the
        backward sweep's where a vision tower trains."""
        return self.tied or self.vision_trains


def model_shape(cfg: ModelConfig, layer_mem: LayerMemory) -> Shape:
    units = build_units(cfg)  # meta-device templates: shapes only
    return Shape(
        units=tuple(u.numel for u in units),
        largest_param=tuple(max(p.numel for p in u.params) for u in units),
        hidden=cfg.hidden_size,
        ffn=token_ffn(cfg),
        q_dim=cfg.attention_width,
        vocab=cfg.vocab_size,
        layers=cfg.num_hidden_layers,
        tied=cfg.tie_word_embeddings,
        layer_mem=layer_mem,
        inactive=cfg.moe.inactive_params(cfg.hidden_size) if cfg.moe else 0,
        rows_embedding=_rows_embedding(cfg, units[0]),
        vision=tower_shape(cfg.vision) if cfg.vision is not None else None,
        vision_trains=cfg.vision is not None and cfg.vision.trains,
    )


def _rows_embedding(cfg: ModelConfig, unit) -> bool:
    """Whether the embedding unit is one token table (vocab x hidden, trained, nothing beside it)
    and its template's forward takes any number of its rows (`looks_up_rows`)."""
    table = (cfg.vocab_size, cfg.hidden_size)
    one = len(unit.params) == 1 and unit.params[0].shape == table and unit.params[0].train
    return one and bool(getattr(family_of(cfg).embedding(cfg), "looks_up_rows", False))


# The embedding's rows' buffers (engine/rows.py) are made this much larger than the most rows a
# pass has looked up, so that the passes after it rarely make them again (fresh memory costs its
# page faults).
ROW_HEADROOM = 1.25


def looked_up_rows(s: Shape, b: Batch) -> int:
    """The most rows of the embedding's table a step looks up: one per token, at most the table."""
    return min(s.vocab, b.tokens)

"""How the AdamW moments are stored (`optim`, Hugging Face's names), and the bytes they take.

Three formats, each two moments of every parameter, element for element beside the fp32 master
(which is exact fp32 in all of them):

* `fp32`: torch's AdamW (`adamw_torch`, the default), 8 bytes a parameter;
* `bf16`: each moment rounded to bfloat16 (nearest even) once a step, after an fp32 update
  (`adamw_anyprecision` with bfloat16 `momentum_dtype` / `variance_dtype`), 4 bytes;
* `8bit`: bitsandbytes' 8-bit blockwise moments (`adamw_8bit`): one code of its dynamic map a
  moment (signed for exp_avg, unsigned for exp_avg_sq) and an fp32 absmax per `BLOCK` elements,
  2 bytes + 8 / BLOCK. A block never holds two tensors (every parameter starts on a multiple of
  BLOCK: state.py's ALIGN).

A format is a list of `Field`s, the host state's moment buffers; the arithmetic that steps them is
engine/moments.py's. Torch-free: the config checks `optim` before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

BLOCK = 256  # elements an 8-bit absmax covers: bitsandbytes' blockwise optimizers' block
# engine/moments.py steps bf16 and 8-bit moments a chunk of this many elements at a time: on the
# CPU its temporaries stay in cache; on CUDA they bound its memory, at most STEP_TEMP_BYTES an
# element of a chunk (fp32 moments, weights and quotients, int64 code indices: the plan counts it).
STEP_CHUNK = {"cpu": 1 << 16, "cuda": 1 << 20}
STEP_TEMP_BYTES = 64
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "uint8": 1}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Field:
    """A moment buffer of the host state: one element per `per` elements of the state."""

    name: str
    """`exp_avg`, `exp_avg_sq`, or the 8-bit ones' absmax (`exp_avg_absmax`, `exp_avg_sq_absmax`)."""
    dtype: str
    """torch's name of its dtype."""
    per: int = 1

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    def length(self, numel: int) -> int:
        """Its elements for `numel` elements of the state (a partial block takes one absmax)."""
        return -(-numel // self.per)

    def nbytes(self, numel: int) -> int:
        return self.length(numel) * self.itemsize


@dataclass(frozen=True)
class Moments:
    """A storage format of the two AdamW moments (see the module docstring)."""

    exp_avg: str
    exp_avg_sq: str
    """torch's dtype names: float32, bfloat16, or uint8 (both, 8-bit blockwise)."""

    @property
    def quantized(self) -> bool:
        return self.exp_avg == "uint8"

    @property
    def name(self) -> str:
        """What checkpoints and plan.json record: fp32, bf16, 8bit, or exp_avg's+exp_avg_sq's."""
        if self.quantized:
            return "8bit"
        a, b = _SHORT[self.exp_avg], _SHORT[self.exp_avg_sq]
        return a if a == b else f"{a}+{b}"

    @property
    def fields(self) -> tuple[Field, ...]:
        """The host state's moment buffers, in the order the optimizer takes them."""
        moments = (Field("exp_avg", self.exp_avg), Field("exp_avg_sq", self.exp_avg_sq))
        if not self.quantized:
            return moments
        return (
            *moments,
            Field("exp_avg_absmax", "float32", BLOCK),
            Field("exp_avg_sq_absmax", "float32", BLOCK),
        )

    def nbytes(self, numel: int) -> int:
        """Bytes of the moments of `numel` elements (whole blocks of BLOCK: a unit, a block of the disk tier)."""
        return sum(f.nbytes(numel) for f in self.fields)

    @property
    def bytes_per_param(self) -> float:
        return sum(f.itemsize / f.per for f in self.fields)

    @property
    def settings(self) -> dict[str, str]:
        """The `optim` (and `optim_args`) that select this format."""
        if self == FP32:
            return {"optim": "adamw_torch"}
        if self.quantized:
            return {"optim": "adamw_8bit"}
        return {
            "optim": ANYPRECISION,
            "optim_args": f"momentum_dtype={self.exp_avg},variance_dtype={self.exp_avg_sq}",
        }


FP32 = Moments("float32", "float32")
BF16 = Moments("bfloat16", "bfloat16")
Q8 = Moments("uint8", "uint8")
# Leanest last: what `megatrain plan` compares and proposes where a run does not fit.
FORMATS = (FP32, BF16, Q8)
ANYPRECISION = "adamw_anyprecision"

# transformers' OptimizerNames megatrain takes, and the format each selects. bitsandbytes pages its
# state out of GPU memory under pressure (`paged_`): here it lives in host memory anyway.
OPTIM = {
    "adamw_torch": FP32,
    "adamw_torch_fused": FP32,
    "paged_adamw_32bit": FP32,
    "adamw_8bit": Q8,
    "adamw_bnb_8bit": Q8,
    "paged_adamw_8bit": Q8,
    ANYPRECISION: FP32,  # momentum_dtype / variance_dtype in optim_args choose (default float32)
}
# Names a user may bring that are AdamW too but whose arithmetic is not built here, and why.
NOT_BUILT = {
    "adamw_torch_4bit": "torchao's 4-bit moments are not built; adamw_8bit is bitsandbytes' 8-bit blockwise moments",
    "adamw_torch_8bit": "torchao's 8-bit moments are not built; adamw_8bit is bitsandbytes' 8-bit blockwise moments",
    "adamw_torch_xla": "a kernel of torch_xla's; adamw_torch is the same AdamW",
    "adamw_torch_npu_fused": "a kernel of torch_npu's; adamw_torch is the same AdamW",
}
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16"}
_TRUE, _FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")  # strtobool's


def parse_optim_args(text: str | None) -> dict[str, str]:
    """`optim_args` as Hugging Face's Trainer reads it: "k=v,k=v", spaces ignored."""
    if not text:
        return {}
    out = {}
    for mapping in text.replace(" ", "").split(","):
        key, eq, value = mapping.partition("=")
        if not eq or not key or "=" in value:
            raise ConfigError(f"optim_args: {mapping!r} is not key=value (got {text!r})")
        out[key] = value
    return out


def resolve(optim: str, optim_args: str | None = None) -> Moments:
    """The format `optim` and `optim_args` select; a ConfigError (one line) for anything else."""
    if optim not in OPTIM:
        why = NOT_BUILT.get(optim, "megatrain's optimizer is AdamW")
        raise ConfigError(f"optim: {optim!r} is not supported ({why}); supported: {', '.join(OPTIM)}")
    args = parse_optim_args(optim_args)
    if optim != ANYPRECISION:
        if args:
            raise ConfigError(
                f"optim_args: {optim} takes none (got {optim_args!r}); {ANYPRECISION} takes the moments' dtypes"
            )
        return OPTIM[optim]
    known = ("momentum_dtype", "variance_dtype", "use_kahan_summation", "compensation_buffer_dtype")
    for key, value in args.items():
        if key not in known:
            raise ConfigError(f"optim_args: {ANYPRECISION} takes {', '.join(known)}, not {key!r}")
        if key.endswith("_dtype") and key != "compensation_buffer_dtype" and value not in _DTYPES:
            raise ConfigError(f"optim_args: {key} must be float32 or bfloat16 (got {value!r})")
        if key == "use_kahan_summation" and value.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"optim_args: use_kahan_summation must be true or false (got {value!r})")
    if args.get("use_kahan_summation", "false").lower() in _TRUE:
        raise ConfigError(
            "optim_args: use_kahan_summation compensates a bfloat16 master; megatrain's master weights are exact fp32"
        )
    m = _DTYPES[args.get("momentum_dtype", "float32")]
    v = _DTYPES[args.get("variance_dtype", "float32")]
    return Moments(m, v)


def named(name: str) -> Moments:
    """The format a checkpoint or plan.json records by `Moments.name`."""
    for m in (FP32, BF16, Q8, Moments("bfloat16", "float32"), Moments("float32", "bfloat16")):
        if m.name == name:
            return m
    raise ValueError(f"no AdamW moment format is named {name!r}")

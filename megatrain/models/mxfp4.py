"""MXFP4 checkpoints (gpt-oss as published): expert weights stored as 4-bit floats, decoded to
full precision as they are read.

The format (OCP Microscaling MXFP4, as OpenAI's checkpoints and transformers store it): a weight
of N values per row is two tensors, `{name}_blocks` (uint8 [..., rows, N/32, 16]: two FP4 E2M1
values per byte, the low nibble first) and `{name}_scales` (uint8 [..., rows, N/32]: one E8M0
scale per 32 values, the power of two 2^(s - 127)). The checkpoint stores the experts as the
matrix products read them, [E, out, in]; transformers' parameters are the transpose, [E, in, out]
(`gate_up_proj` [E, H, 2F], `down_proj` [E, F, H]), so `{name}` reads back as that transpose.
Every decoded value is exactly a bf16 (and fp32) number. Writing is always in the plain layout:
megatrain trains and saves full-precision weights.
"""

from __future__ import annotations

import torch

QUANT_METHOD = "mxfp4"  # a config.json's quantization_config.quant_method
BLOCKS, SCALES = "_blocks", "_scales"
GROUP = 32  # values per scale
# E2M1 magnitudes by the three low bits of a nibble; bit 3 is the sign.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127


def quantized_keys(keys) -> dict[str, tuple[str, str]]:
    """Parameter key -> (blocks key, scales key) for every MXFP4 pair among a checkpoint's keys."""
    keys = set(keys)
    return {
        k.removesuffix(BLOCKS): (k, k.removesuffix(BLOCKS) + SCALES)
        for k in keys
        if k.endswith(BLOCKS) and k.removesuffix(BLOCKS) + SCALES in keys
    }


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The parameter's shape, [..., N, rows], of blocks shaped [..., rows, N/32, 16]."""
    *lead, rows, groups, nbytes = blocks_shape
    return (*lead, groups * nbytes * 2, rows)


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of [..., rows, N/32, 16] blocks and [..., rows, N/32] scales, as the parameter
    [..., N, rows] (the transpose of the stored matrix) in `dtype`."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=blocks.device)
    nibbles = blocks.to(torch.int32)
    values = torch.stack((table[nibbles & 0x0F], table[nibbles >> 4]), dim=-1)  # low nibble first
    values = values.reshape(*scales.shape, GROUP)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - E8M0_BIAS).flatten(-2)
    return values.transpose(-2, -1).to(dtype)


def decode_into(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Decode into `out` (the parameter's shape) one expert at a time, so no more than one
    expert's values exist beside it (a whole gpt-oss-120b layer's would be 8.5 GB in fp32)."""
    if blocks.dim() < 4:  # no expert dimension
        out.copy_(decode(blocks, scales, out.dtype))
        return
    for e in range(out.shape[0]):
        out[e].copy_(decode(blocks[e], scales[e], out.dtype))

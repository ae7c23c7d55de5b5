"""MXFP8 (OCP E4M3 elements, one E8M0 scale per 32) quantize-dequantize of activations, as the seed system applies
to the inputs of Kimi K3's routed-expert projections (`expert_input_mxfp8`).

Scale rule (the seed's): 2^e with e = round_half_even(log2(amax / 448)) clamped to [-127, 127], 1 for an all-zero
block. Elements are x / 2^e saturated to +-448 and rounded to the nearest E4M3 value, ties to even (torch's float8
cast does exactly that, subnormals included), then multiplied back.
"""
from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0


def quantize_dequantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> the MXFP8 round trip, in x's dtype."""
    K = x.shape[-1]
    if K % BLOCK:
        raise ValueError(f"MXFP8 needs the last dimension to be a multiple of {BLOCK}, got {K}")
    blocks = x.float().reshape(*x.shape[:-1], K // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    e = torch.round(torch.log2(amax.clamp_min(1e-38) / E4M3_MAX)).clamp(-127, 127)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).to(torch.int32)
    scaled = torch.ldexp(blocks, -e).clamp(-E4M3_MAX, E4M3_MAX)         # exact: a power-of-two rescale
    out = torch.ldexp(scaled.to(torch.float8_e4m3fn).float(), e)
    return out.reshape(x.shape).to(x.dtype)

"""Weight-only int8 in llama.cpp's Q8_0 layout: symmetric int8 values with one scale per 32 consecutive inputs
(absmax / 127, rounded to nearest even), kept in fp32 here. 8 bits + 1 per weight instead of 16 (bf16)."""
from __future__ import annotations

import torch

BLOCK = 32


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (int8 [..., K], float32 scales [..., K/32])."""
    K = w.shape[-1]
    if K % BLOCK:
        raise ValueError(f"int8 weights need the input dimension to be a multiple of {BLOCK}, got {K}")
    blocks = w.float().reshape(*w.shape[:-1], K // BLOCK, BLOCK)
    scales = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scales > 0, blocks / scales, torch.zeros_like(blocks)).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(w.shape), scales.squeeze(-1)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    K = q.shape[-1]
    w = q.float().reshape(*q.shape[:-1], K // BLOCK, BLOCK) * scales.unsqueeze(-1)
    return w.reshape(q.shape).to(dtype)

"""The model's matrix products (projections and attention), with the one CPU case that needs care: without bf16
arithmetic (AVX512-BF16 or AMX), oneDNN's bf16 GEMM runs several times slower than fp32 MKL (measured 3.7x at 256
rows on this project's CI machine), so bf16 operands of a product with more than a few rows are widened to fp32
first. Either way the products accumulate in fp32 and the result is rounded to bf16 once; only the summation order
differs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

CPU_BF16_ARITHMETIC = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
WIDEN_FROM_ROWS = 4       # below this, reading bf16 weights (half the bytes of fp32) wins


def _widen(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (b.dtype == torch.bfloat16 and not CPU_BF16_ARITHMETIC and b.device.type == "cpu"
            and a.numel() >= WIDEN_FROM_ROWS * a.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T."""
    if _widen(x, weight):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched)."""
    if _widen(a, b):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b

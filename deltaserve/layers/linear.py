"""The model's matrix products (projections, experts, attention), each picking the fastest exact way on its device:

- 1..8 rows on a CPU with deltaserve's decode kernels (ops/cpu_kernels.py): one pass over fp32, bf16, int8 or MXFP4
  weights, widened to fp32 in registers;
- bf16 operands of a larger product on a CPU without bf16 arithmetic (AVX512-BF16 or AMX) are widened to fp32
  first: oneDNN's bf16 GEMM runs several times slower there than fp32 MKL (3.7x at 256 rows on this project's CI
  machine).
Either way products accumulate in fp32 and a bf16 result is rounded once; only the summation order differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from torch import nn

from ..ops.cpu_kernels import MAX_ROWS, kernels
from ..ops.int8 import dequantize_int8, quantize_int8
from ..ops.mxfp4 import dequantize_mxfp4

CPU_BF16_ARITHMETIC = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
WIDEN_FROM_ROWS = 4       # below this, reading bf16 weights (half the bytes of fp32) wins


@dataclass(frozen=True)
class Int8Weight:
    """A projection weight quantized at load (`quantization="int8"`): int8 [..., N, K] and fp32 scales per 32 inputs.
    Indexing selects along the leading dimensions (stacked experts)."""
    q: torch.Tensor
    scales: torch.Tensor

    def __getitem__(self, index: int) -> "Int8Weight":
        return Int8Weight(self.q[index], self.scales[index])

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4


def weight_parts(weight: torch.Tensor | Int8Weight) -> list[torch.Tensor]:
    """A weight as the CPU kernels take one: (W) dense, or (q, scales) int8."""
    return [weight.q, weight.scales] if isinstance(weight, Int8Weight) else [weight]


def quantize_module_weights(model: nn.Module) -> int:
    """Replace every weight the layers list in `int8_weights` (projections and experts) by an Int8Weight; weights
    whose input width is not whole blocks of 32 stay as they are. Returns how many were quantized."""
    count = 0
    for module in model.modules():
        for name in getattr(module, "int8_weights", ()):
            weight = module._parameters.get(name)
            if weight is None or weight.shape[-1] % 32:
                continue
            del module._parameters[name]
            setattr(module, name, Int8Weight(*quantize_int8(weight)))
            count += 1
    return count


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _decode_kernels(x: torch.Tensor, weight: torch.Tensor):
    """The CPU decode kernels when they apply to this product, else None."""
    if weight.device.type != "cpu" or _rows(x) > MAX_ROWS or not weight.is_contiguous():
        return None
    return kernels()


def _widen(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (b.dtype == torch.bfloat16 and not CPU_BF16_ARITHMETIC and b.device.type == "cpu"
            and _rows(a) >= WIDEN_FROM_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor | Int8Weight, float_out: bool = False) -> torch.Tensor:
    """x @ weight^T in x's dtype; `float_out`: then given back in fp32 (logits), which the decode kernels write at once
    rather than in a second pass."""
    if isinstance(weight, Int8Weight):
        k = _decode_kernels(x, weight.q)
        if k is not None:
            return k.gemv_q8(x, weight.q, weight.scales, float_out)
        return linear(x, dequantize_int8(weight.q, weight.scales, x.dtype), float_out)
    # fp32 too: as fast as MKL's GEMV for one row, 2x for 8 (measured), and batch-invariant
    k = _decode_kernels(x, weight) if weight.dtype in (torch.bfloat16, torch.float32) else None
    if k is not None:
        return k.gemv(x, weight, float_out)
    if _widen(x, weight):
        y = F.linear(x.float(), weight.float()).to(x.dtype)
    else:
        y = F.linear(x, weight)
    return y.float() if float_out else y


def linear_mxfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ W^T for MXFP4 W (packed [N, K/2], scales [N, K/32]): read packed by the decode kernels, else
    dequantized exactly to x's dtype first."""
    k = _decode_kernels(x, packed)
    if k is not None:
        return k.gemv_mxfp4(x, packed, scales)
    return linear(x, dequantize_mxfp4(packed, scales, x.dtype))


def product_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to keep operands of attention products in: fp32 for bf16 on a CPU without bf16 arithmetic (values
    are rounded to bf16 first, so only the cost changes), else the activation dtype."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not CPU_BF16_ARITHMETIC:
        return torch.float32
    return dtype


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (batched), rounded to a's dtype; in fp32 when b is kept in fp32 or bf16 operands need widening."""
    if a.dtype != b.dtype or _widen(a, b):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b

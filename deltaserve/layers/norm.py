"""RMS norms as the Kimi family computes them: statistics in float32, weight applied after the cast back."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.cpu_kernels import MAX_ROWS, kernels

GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu}


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, in float32, without a weight."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = kernels() if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
                          and x.numel() <= MAX_ROWS * x.shape[-1]) else None
        if k is not None:                 # decode: one op instead of five (same math, ops/cpu_kernels.py)
            return k.rms_norm(x, self.weight, self.eps)
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "sigmoid") -> torch.Tensor:
    """KDA output norm: RMSNorm(x) * weight * act(gate), all in float32 (fla FusedRMSNormGated)."""
    return rms_normalize(x, eps) * weight.float() * GATE_ACTIVATIONS[activation](gate.float())

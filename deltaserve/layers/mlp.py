"""SwiGLU MLP (dense layers and shared experts) with gate and up fused into one matrix."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter; the checkpoint loader fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = param(2 * intermediate, hidden, dtype=dtype)
        self.down = param(hidden, intermediate, dtype=dtype)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        i = self.intermediate
        return {"gate_proj.weight": self.gate_up[:i], "up_proj.weight": self.gate_up[i:], "down_proj.weight": self.down}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down)

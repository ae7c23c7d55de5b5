"""Gated MLPs (dense layers, shared experts, routed experts) with gate and up fused into one matrix, and the gated
activations the Kimi family uses, chosen from the config by name."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .linear import linear

GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised, frozen parameter; the checkpoint loader fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """Kimi K3's SiTU: beta tanh(g / beta) sigmoid(g), times the soft-capped up projection
    linear_beta tanh(u / linear_beta); in float32, cast back to the gate's dtype."""
    g, u = gate.float(), up.float()
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def gated_activation(name: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> GatedActivation:
    """config.json's hidden_act -> f(gate, up)."""
    if name == "situ":
        return functools.partial(situ, beta=situ_beta, linear_beta=situ_linear_beta)
    return swiglu


class Weight(nn.Module):
    """One checkpoint weight as its own module (embeddings, LM head, residual-mixture queries)."""

    def __init__(self, *shape: int, dtype: torch.dtype, int8: bool = False):
        super().__init__()
        self.weight = param(*shape, dtype=dtype)
        self.int8_weights = ("weight",) if int8 else ()


class GatedMLP(nn.Module):
    int8_weights = ("gate_up", "down")

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, act: GatedActivation = swiglu):
        super().__init__()
        self.intermediate, self.act = intermediate, act
        self.gate_up = param(2 * intermediate, hidden, dtype=dtype)
        self.down = param(hidden, intermediate, dtype=dtype)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        i = self.intermediate
        return {"gate_proj.weight": self.gate_up[:i], "up_proj.weight": self.gate_up[i:], "down_proj.weight": self.down}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return linear(self.act(gate, up), self.down)

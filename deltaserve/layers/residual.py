"""Block Attention Residuals (Kimi K3): a sub-layer's input is a softmax mixture over depth of the archived block
sums and the current partial sum, instead of the plain running sum of every sub-layer's output."""
from __future__ import annotations

import torch
from torch import nn

from .mlp import Weight
from .norm import RMSNorm, rms_normalize


def depth_mix(values: list[torch.Tensor], norm: RMSNorm, proj: nn.Module) -> torch.Tensor:
    """Scores each candidate v_i by <RMSNorm(v_i) * norm.weight, proj.weight>, softmax over the candidates, and
    returns their weighted sum; all in float32, cast back to the candidates' dtype. `proj.weight` [1, D] is the
    (rank-1) query of this mixture."""
    v = torch.stack(values).float()                                              # [n, ..., D]
    query = norm.weight.float() * proj.weight[0].float()
    weights = (rms_normalize(v, norm.eps) * query).sum(-1).softmax(0)            # [n, ...]
    return (weights.unsqueeze(-1) * v).sum(0).to(values[-1].dtype)


def mix_params(size: int, eps: float, dtype: torch.dtype) -> tuple[RMSNorm, nn.Module]:
    """A mixture's (`*_res_norm`, `*_res_proj`) pair, as the checkpoint names them."""
    return RMSNorm(size, eps, dtype), Weight(1, size, dtype=dtype)

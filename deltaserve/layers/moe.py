"""Kimi / DeepSeek-V3 style MoE: sigmoid router with a selection-only correction bias, routed SwiGLU experts
stored stacked ([E, ...]) and dispatched by expert, plus always-on shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.mxfp4 import BLOCK, dequantize_mxfp4
from .mlp import SwiGLU, param


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids and weights per token ([N, k] each), computed in float32."""
    scores = F.linear(x.float(), gate_weight.float()).sigmoid()
    choice = scores + bias.float()
    groups = cfg.num_expert_group
    if groups > 1:   # group-limited routing: keep the topk_group groups with the best top-2 sums
        per_group = choice.view(-1, groups, cfg.num_experts // groups)
        best = per_group.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(per_group[..., 0], dtype=torch.bool).scatter_(1, best, True)
        choice = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(cfg.num_experts_per_token, dim=-1, sorted=False).indices
    weights = (choice if cfg.router_bias_in_weights else scores).gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp_size: int = 1):
        """Under tensor parallelism every rank holds a 1/tp_size slice of every expert's intermediate dimension;
        the caller sums the partial outputs across ranks."""
        super().__init__()
        self.cfg = cfg
        E, I, D = cfg.num_experts, cfg.moe_intermediate_size // tp_size, cfg.hidden_size
        self.I = I
        self.dtype = dtype
        self.gate_weight = param(E, D, dtype=torch.float32)
        self.e_score_correction_bias = param(E, dtype=torch.float32)
        if cfg.experts_mxfp4:      # packed FP4 codes and E8M0 scales, dequantized per selected expert
            self.w13_packed = param(E, 2 * I, D // 2, dtype=torch.uint8)
            self.w13_scale = param(E, 2 * I, D // BLOCK, dtype=torch.uint8)
            self.w2_packed = param(E, D, I // 2, dtype=torch.uint8)
            self.w2_scale = param(E, D, I // BLOCK, dtype=torch.uint8)
        else:
            self.w13 = param(E, 2 * I, D, dtype=dtype)     # w1 (gate) rows, then w3 (up) rows
            self.w2 = param(E, D, I, dtype=dtype)
        self.shared_experts = SwiGLU(D, I * cfg.num_shared_experts, dtype) if cfg.num_shared_experts else None

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        I = self.I
        views = {"gate.weight": self.gate_weight, "gate.e_score_correction_bias": self.e_score_correction_bias}
        parts = ((("weight_packed", "w13_packed", "w2_packed"), ("weight_scale", "w13_scale", "w2_scale"))
                 if self.cfg.experts_mxfp4 else (("weight", "w13", "w2"),))
        for suffix, w13_name, w2_name in parts:
            w13, w2 = getattr(self, w13_name), getattr(self, w2_name)
            for e in range(self.cfg.num_experts):
                views[f"experts.{e}.w1.{suffix}"] = w13[e, :I]
                views[f"experts.{e}.w3.{suffix}"] = w13[e, I:]
                views[f"experts.{e}.w2.{suffix}"] = w2[e]
        if self.shared_experts is not None:
            views.update({f"shared_experts.{k}": v for k, v in self.shared_experts.checkpoint_views().items()})
        return views

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, D], w2 [D, I]) in the activation dtype."""
        if not self.cfg.experts_mxfp4:
            return self.w13[e], self.w2[e]
        return (dequantize_mxfp4(self.w13_packed[e], self.w13_scale[e], self.dtype),
                dequantize_mxfp4(self.w2_packed[e], self.w2_scale[e], self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = route(x, self.gate_weight, self.e_score_correction_bias, self.cfg)
        k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)              # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.cfg.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):                 # experts in ascending order, as the reference sums them
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tokens = sel // k
            w13, w2 = self.expert(e)
            gate, up = F.linear(x[tokens], w13).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2) * flat_weights[sel, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)
